"""kvbridge_sim.images without building anything: the pip configuration a build sees, buildah's and podman's
command lines, the images it knows. tests/charts/test_image_runs.py builds and runs them."""

from __future__ import annotations

import configparser
import re
import resource
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_operator.config import VLLM_VERSION
from kvbridge_sim import images

#: what ``pip config list`` printed on a development machine (files and PIP_* variables)
LISTED = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/old.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple https://example.org/simple'
install.find-links='/srv/other'
"""


def test_the_variables_win_over_the_files_in_every_section() -> None:
    config = images.parse_pip_config(LISTED)
    assert config["global"]["cert"] == "/etc/ssl/certs/ca-certificates.crt"
    assert config["global"]["default-timeout"] == "180"
    assert config["global"]["constraint"] == "/etc/xdg/pip/constraints.txt"
    assert config["install"] == {"find-links": "/opt/wheels"}


def test_unparsable_lines_are_ignored() -> None:
    assert images.parse_pip_config("no equals sign\n=\nglobal=x\n.x='y'\n") == {}


option = st.from_regex(r"[a-z][a-z-]{0,20}", fullmatch=True)
value = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=40)


@given(st.dictionaries(option, value, max_size=6), st.dictionaries(option, value, max_size=6))
def test_any_listing_round_trips_with_the_variables_winning(files: dict[str, str], env: dict[str, str]) -> None:
    """pip prints each value with repr(): every value comes back as it was, a variable's where both set one."""
    text = "".join(f"global.{k}={v!r}\n" for k, v in files.items()) + "".join(
        f":env:.{k}={v!r}\n" for k, v in env.items()
    )
    assert images.parse_pip_config(text).get("global", {}) == {**files, **env}


def test_the_build_sees_the_local_files_the_configuration_names(tmp_path: Path) -> None:
    (tmp_path / "index" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "ca.crt").write_text("")
    config = {
        "global": {
            "cert": str(tmp_path / "ca.crt"),
            "find-links": f"{tmp_path / 'wheels'} {tmp_path / 'missing'} https://example.org/wheels",
            # a local index's pages link to the files beside its `simple` folder: its parent is mounted
            "extra-index-url": f"file://{tmp_path / 'index' / 'simple'}",
        }
    }
    assert images.local_paths(config) == [tmp_path / "ca.crt", tmp_path / "wheels", tmp_path / "index"]
    mounts = images.pip_mounts(config, tmp_path / "cache")
    assert mounts[0] == f"--volume={tmp_path / 'cache' / 'pip.conf'}:/etc/pip.conf:ro"
    assert f"--volume={tmp_path / 'wheels'}:{tmp_path / 'wheels'}:ro" in mounts
    written = configparser.ConfigParser(interpolation=None)
    written.read(tmp_path / "cache" / "pip.conf")
    assert dict(written["global"]) == config["global"]
    assert images.pip_mounts({}, tmp_path / "none") == []


def test_a_build_never_pulls_and_builds_on_the_debian_base() -> None:
    operator = images.IMAGES["operator"]
    argv = images.build_argv(operator, "localhost/kvbridge/base:x", ["--volume=/a:/a:ro"], torch_index="")
    assert argv[:2] == ["buildah", "bud"]
    assert {"--isolation=chroot", "--network=host", "--pull=never", "--layers", "--volume=/a:/a:ro"} <= set(argv)
    assert "--build-arg=BASE=localhost/kvbridge/base:x" in argv
    assert not any(a.startswith("--build-arg=TORCH_INDEX") for a in argv)  # the operator's Dockerfile has none
    assert argv[-1] == str(images.ROOT)
    engine = images.build_argv(images.IMAGES["vllm-engine-cpu"], "b", [], torch_index="")
    assert "--build-arg=TORCH_INDEX=" in engine
    assert f"--build-arg=VLLM_VERSION={VLLM_VERSION}" in engine
    gpu = images.build_argv(images.IMAGES["vllm-engine"], "b", [])
    assert "--pull=missing" in gpu  # FROM vLLM's image, pulled where the machine can
    assert not any(a.startswith("--build-arg=BASE") for a in gpu)


def test_the_images_it_knows_are_the_repositorys_dockerfiles() -> None:
    assert images.VLLM_VERSION == VLLM_VERSION
    for image in images.IMAGES.values():
        assert (images.ROOT / image.dockerfile).is_file()
        assert re.fullmatch(r"localhost/kvbridge/[a-z-]+:[0-9.]+(-cpu)?", image.name)
    assert [i.key for i in images.IMAGES.values() if i.default] == ["operator", "vllm-engine-cpu"]
    assert images.base_name().startswith("localhost/kvbridge/base:bookworm-")


def test_containers_run_with_runc_and_limits_this_machine_allows() -> None:
    argv = images.run_argv(
        "img", ["plan", "-f", "-"], entrypoint=["python3", "-c"], volumes={"/m": "/models"}, name="n", cpus=(0, 1)
    )
    assert argv[:3] == ["podman", "run", "--rm"]
    assert "--runtime=runc" in argv
    assert argv[-4:] == ["img", "plan", "-f", "-"]
    assert '--entrypoint=["python3", "-c"]' in argv
    assert {"--volume=/m:/models:ro", "--detach", "--name=n", "--cpuset-cpus=0,1", "--network=host"} <= set(argv)
    limits = {m[1]: int(m[2]) for a in argv if (m := re.fullmatch(r"--ulimit=(\w+)=(\d+):\2", a))}
    assert set(limits) == {"nofile", "nproc"}
    assert limits["nofile"] <= resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert limits["nproc"] <= min(resource.getrlimit(resource.RLIMIT_NPROC)[1], images._pid_max())


def test_the_cache_folder_is_the_makefiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_IMAGES_CACHE", "/somewhere")
    assert images.cache_dir() == Path("/somewhere")
    monkeypatch.delenv("KVBRIDGE_IMAGES_CACHE")
    assert images.cache_dir() == Path.home() / ".cache/kvbridge/images"
    assert "IMAGES_CACHE ?= $(HOME)/.cache/kvbridge/images" in (images.ROOT / "Makefile").read_text()
