"""The project's container images built and run on this machine without a Docker engine (``make images``).

Debian's own tools stand in for Docker. ``mmdebstrap`` makes the base image: Debian bookworm, minbase, with python3,
its venv module and the CA certificates, a tarball made once per machine under :func:`cache_dir` and imported into
podman's storage. ``buildah`` builds each Dockerfile on it (``--build-arg BASE=``; chroot isolation, the host's
network, ``--pull=never``: nothing comes from a registry; ``--layers``: an unchanged step is not run again) with the
machine's pip configuration mounted read-only: what ``pip config list`` shows (files and ``PIP_*`` variables) merged
into one ``/etc/pip.conf``, and the files and folders it names (the CA bundle that package traffic needs here,
constraints, local indexes and wheel folders) at their own paths; nothing mounted stays in the image. ``podman``
runs the images with runc and ulimits at this machine's hard limits (:func:`run_argv`): crun, and podman's default
limits, which are above them, fail here.

The standard library only: ``make images`` runs it (``python3 -m kvbridge_sim.images build``) before any virtual
environment exists. tests/charts/test_image_runs.py runs what it builds.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the project's version (every image's tag) and the vLLM release (the engine images'), each written once elsewhere
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
VLLM_VERSION = re.findall(
    r'^VLLM_VERSION = "(.+)"$', (ROOT / "operator/kvbridge_operator/config.py").read_text(), re.MULTILINE
)[0]

#: what builds and runs the images: Debian's packages of the same names
TOOLS = ("mmdebstrap", "buildah", "podman", "runc")
#: the OCI runtime podman runs containers with (crun fails here; runc does not)
RUNTIME = "runc"
#: the base image: Debian's release (the one python:3.11-slim-bookworm is made of), its packages and mirrors
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
#: pip's options that may name files or folders of this machine (a value may list several, space-separated)
PATH_OPTIONS = ("cert", "client-cert", "constraint", "requirement", "find-links", "index-url", "extra-index-url")
#: where the merged pip configuration is mounted in every build step (pip reads it as its global file)
PIP_CONF_IN_BUILD = "/etc/pip.conf"
#: the longest one build (or the base) may take, in seconds: the CPU engine image downloads about 1 GB
BUILD_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Image:
    """One of the project's images: its Dockerfile, its local name, and whether ``make images`` builds it here."""

    key: str
    dockerfile: str
    repository: str
    tag: str
    #: built here on the Debian base (``--build-arg BASE``); otherwise FROM a registry's image, which this machine
    #: cannot pull: built only where asked for (``build vllm-engine`` on a machine that can pull vLLM's image)
    on_base: bool = True
    #: built by ``make images`` (the others on request)
    default: bool = True
    build_args: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return f"localhost/{self.repository}:{self.tag}"


IMAGES = {
    image.key: image
    for image in (
        # the operator and the router (kvbridge operator run, kvbridge-router)
        Image("operator", "operator/Dockerfile", "kvbridge/kvbridge-operator", VERSION),
        # vLLM's CPU build with kvbridge's connector: engine.device CPU, connector KVBridge
        Image(
            "vllm-engine-cpu",
            "images/vllm-engine-cpu/Dockerfile",
            "kvbridge/vllm-engine",
            f"{VERSION}-cpu",
            build_args=(("VLLM_VERSION", VLLM_VERSION),),
        ),
        # vLLM's GPU image with kvbridge's connector: FROM vllm/vllm-openai, which this machine cannot pull
        Image(
            "vllm-engine",
            "images/vllm-engine/Dockerfile",
            "kvbridge/vllm-engine",
            VERSION,
            on_base=False,
            default=False,
        ),
        # the synthetic engine (engine kind Agent): torch and NIXL, no vLLM
        Image("agent", "agent/Dockerfile", "kvbridge/kvbridge-agent", VERSION, default=False),
    )
}


def cache_dir() -> Path:
    """Where the base image's tarball is kept between builds: ``$KVBRIDGE_IMAGES_CACHE``, else
    ``~/.cache/kvbridge/images`` (the Makefile's ``IMAGES_CACHE``)."""
    configured = os.environ.get("KVBRIDGE_IMAGES_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "kvbridge" / "images"


def missing_tools() -> list[str]:
    """The tools of :data:`TOOLS` this machine lacks (``make image-tools`` installs them as root with apt-get)."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def base_name() -> str:
    """The base image's local name: its recipe's digest in the tag, so that a changed recipe makes a new base."""
    recipe = json.dumps([SUITE, BASE_PACKAGES, MIRRORS])
    return f"localhost/kvbridge/base:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def _run(argv: Sequence[str], *, capture: bool = True, timeout: float = BUILD_TIMEOUT) -> str:
    """Run a tool; its output (what it printed, stdout and stderr together, when ``capture``; else shown as it
    goes). RuntimeError with the output's end when it fails."""
    output = subprocess.PIPE if capture else None
    done = subprocess.run(list(argv), stdout=output, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:2])} failed with exit code {done.returncode}\n{(done.stdout or '')[-4000:]}"
        )
    return done.stdout or ""


def image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], timeout=60, check=False).returncode == 0


def image_size(name: str) -> int:
    """The image's size in bytes, as ``podman images`` shows it (every layer, uncompressed)."""
    return int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", name], timeout=60).strip())


def ensure_base(*, refresh: bool = False) -> str:
    """The base image in podman's storage, made from the cached tarball (made first where missing, or when
    ``refresh``: a new tarball picks up Debian's updates); its name."""
    name = base_name()
    tarball = cache_dir() / f"{name.rpartition(':')[2]}.tar"
    if refresh or not tarball.exists():
        tarball.parent.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial.tar")
        _run(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--format=tar",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                str(partial),
                *MIRRORS,
            ]
        )
        partial.replace(tarball)  # whole or not at all: an interrupted run leaves no tarball to trust
        refresh = True
    if refresh or not image_exists(name):
        path = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        _run(["podman", "import", "--quiet", "--change", path, str(tarball), name])
    return name


def parse_pip_config(text: str) -> dict[str, dict[str, str]]:
    """``pip config list``'s lines (``section.option='value'``) by section; the ``PIP_*`` variables' (``:env:``)
    win over every file's, as they do in pip, and go to ``global``."""
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, equals, raw = line.partition("=")
        section, dot, option = key.strip().partition(".")
        if not equals or not section or not dot or not option:
            continue
        raw = raw.strip()
        try:
            value = ast.literal_eval(raw) if raw[:1] in ("'", '"') else raw
        except (ValueError, SyntaxError):
            value = raw
        (env if section == ":env:" else sections.setdefault(section, {}))[option] = str(value)
    sections.setdefault("global", {}).update(env)
    for options in sections.values():
        options.update({option: value for option, value in env.items() if option in options})
    return {section: options for section, options in sections.items() if options}


def pip_config(python: str = sys.executable) -> dict[str, dict[str, str]]:
    """This machine's pip configuration, as ``python -m pip config list`` shows it (empty without pip)."""
    try:
        done = subprocess.run(
            [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError:
        return {}
    return parse_pip_config(done.stdout) if done.returncode == 0 else {}


def local_paths(config: Mapping[str, Mapping[str, str]]) -> list[Path]:
    """The files and folders of this machine that the configuration names and that exist: a ``file://`` index's
    root (its ``simple`` folder's parent: the pages link to files beside it), wheel folders, certificates,
    constraints."""
    found: list[Path] = []
    for options in config.values():
        for option in PATH_OPTIONS:
            for item in options.get(option, "").split():
                if not item.startswith(("file://", "/")):
                    continue
                path = Path(item.removeprefix("file://"))
                path = path.parent if path.name == "simple" else path
                if path.exists() and path not in found:
                    found.append(path)
    return found


def pip_mounts(config: Mapping[str, Mapping[str, str]], folder: Path) -> list[str]:
    """buildah's ``--volume`` flags that give every build step this machine's pip configuration: the merged file
    (written to ``folder``) and what it names, read-only, at their own paths."""
    if not config:
        return []
    merged = configparser.ConfigParser(interpolation=None)
    merged.read_dict(config)
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "pip.conf"
    with conf.open("w") as out:
        merged.write(out)
    return [f"--volume={conf}:{PIP_CONF_IN_BUILD}:ro", *(f"--volume={p}:{p}:ro" for p in local_paths(config))]


@dataclass(frozen=True)
class Built:
    """What one build took and made."""

    name: str
    wall_seconds: float
    cpu_seconds: float
    size_bytes: int


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def build_argv(image: Image, base: str, mounts: Sequence[str], torch_index: str | None = None) -> list[str]:
    """``buildah bud`` of one image from the repository root; ``torch_index``: the Dockerfile's TORCH_INDEX (empty:
    pip's own configuration; None: the Dockerfile's default)."""
    args = dict(image.build_args)
    if image.on_base:
        args["BASE"] = base
    if torch_index is not None and "ARG TORCH_INDEX" in (ROOT / image.dockerfile).read_text():
        args["TORCH_INDEX"] = torch_index
    return [
        "buildah",
        "bud",
        "--isolation=chroot",
        "--network=host",
        "--pull=never" if image.on_base else "--pull=missing",
        "--layers",
        *(f"--build-arg={name}={value}" for name, value in args.items()),
        *mounts,
        f"--file={ROOT / image.dockerfile}",
        f"--tag={image.name}",
        str(ROOT),
    ]


def build(image: Image, *, torch_index: str | None = None, quiet: bool = True) -> Built:
    """Build ``image`` (the base first where it is missing); what it took."""
    base = ensure_base() if image.on_base else ""
    mounts = pip_mounts(pip_config(), cache_dir())
    started, cpu = time.monotonic(), _cpu_of_children()
    _run(build_argv(image, base, mounts, torch_index), capture=quiet)
    wall, cpu = time.monotonic() - started, _cpu_of_children() - cpu
    return Built(image.name, round(wall, 1), round(cpu, 1), image_size(image.name))


def ulimits() -> list[str]:
    """podman's ``--ulimit`` flags at this process's hard limits of open files and processes: podman's default
    (1048576 open files) is above this machine's, and runc then starts no container ("error setting rlimits": root
    here lacks CAP_SYS_RESOURCE). Processes: at most the kernel's ``pid_max`` too, to which podman lowers its own
    limit, and so conmon's and runc's, before it starts anything."""
    flags = []
    for name, kind in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(kind)[1]
        if name == "nproc":
            hard = min(hard if hard != resource.RLIM_INFINITY else PID_MAX_DEFAULT, _pid_max())
        value = "-1" if hard == resource.RLIM_INFINITY else str(hard)
        flags.append(f"--ulimit={name}={value}:{value}")
    return flags


#: Linux's ``pid_max`` where /proc does not say
PID_MAX_DEFAULT = 32768


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return PID_MAX_DEFAULT


def run_argv(
    image: str,
    args: Sequence[str] = (),
    *,
    entrypoint: Sequence[str] | None = None,
    volumes: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    cpus: Sequence[int] = (),
    stdin: bool = False,
    remove: bool = True,
) -> list[str]:
    """``podman run`` of ``image`` on the host's network (a pod's address is one of this machine's loopback
    addresses, as the local runner gives pods), removed when it ends: runc, this machine's ulimits, the image's own
    user. ``volumes``: host path -> container path, read-only; ``name``: detached under that name; ``cpus``: the
    cores it may use (a kubelet's cpuset); ``stdin``: kept open for input; ``remove``: false to keep an ended
    container (and its log) until ``podman rm``."""
    argv = [
        "podman",
        "run",
        *(["--rm"] if remove else []),
        f"--runtime={RUNTIME}",
        *ulimits(),
        "--network=host",
        "--shm-size=2g",
    ]
    argv += [f"--volume={host}:{inside}:ro" for host, inside in (volumes or {}).items()]
    argv += [f"--env={key}={value}" for key, value in (env or {}).items()]
    if name is not None:
        argv += ["--detach", f"--name={name}"]
    if cpus:
        argv.append(f"--cpuset-cpus={','.join(str(cpu) for cpu in cpus)}")
    if stdin:
        argv.append("--interactive")
    if entrypoint is not None:
        argv.append(f"--entrypoint={json.dumps(list(entrypoint))}")
    return [*argv, image, *args]


def _report(built: Sequence[Built]) -> str:
    lines = [f"{'image':48} {'wall s':>7} {'CPU s':>7} {'size MB':>8}"]
    lines += [f"{b.name:48} {b.wall_seconds:7.1f} {b.cpu_seconds:7.1f} {b.size_bytes / 1e6:8.0f}" for b in built]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge_sim.images", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_command = commands.add_parser("build", help="build images (default: those `make images` builds)")
    build_command.add_argument("images", nargs="*", metavar="IMAGE", help=f"any of {', '.join(IMAGES)}")
    build_command.add_argument("--torch-index", default=None, help="TORCH_INDEX for the Dockerfiles; empty: pip's")
    build_command.add_argument("--refresh-base", action="store_true", help="make the base tarball again")
    commands.add_parser("base", help="make the base image (once per machine: cached)")
    options = parser.parse_args(argv)
    unknown = [key for key in getattr(options, "images", []) if key not in IMAGES]
    if unknown:
        parser.error(f"no image {', '.join(unknown)}: choose from {', '.join(IMAGES)}")
    missing = missing_tools()
    if missing:
        print(f"missing {', '.join(missing)}: make image-tools (apt-get install {' '.join(missing)})")
        return 2
    started, cpu = time.monotonic(), _cpu_of_children()
    base = ensure_base(refresh=getattr(options, "refresh_base", False))
    wall, cpu = time.monotonic() - started, _cpu_of_children() - cpu
    base_built = Built(base, round(wall, 1), round(cpu, 1), image_size(base))
    if options.command == "base":
        print(_report([base_built]))
        return 0
    wanted = [IMAGES[key] for key in options.images] or [image for image in IMAGES.values() if image.default]
    built = [base_built]
    for image in wanted:
        print(f"building {image.name} from {image.dockerfile}", flush=True)
        built.append(build(image, torch_index=options.torch_index, quiet=False))
    print(_report(built))
    return 0


if __name__ == "__main__":
    sys.exit(main())
