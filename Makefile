# kvbridge — two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv on first use (torch==2.13.0 first: the CPU build on disk, see
# ../shared/design/testing.md), then install the project with its extras.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbridge-installed

.PHONY: setup test lint typecheck imports unit demo bench-core crds clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[agent,operator,demo,test,bench]'
	@touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy agent operator

imports: setup
	$(VENV)/bin/lint-imports

unit: setup
	$(VENV)/bin/pytest

test: lint typecheck imports unit

demo: setup
	$(VENV)/bin/kvbridge demo $(DEMO_ARGS)

crds: setup
	$(VENV)/bin/kvbridge crd -o crds -o charts/kvbridge/crds

bench-core: setup
	$(PY) benchmarks/core_plan.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
