"""vLLM's CPU build (``engine.device: CPU``): the launcher that binds TP ranks to cores, and CPU attention's sizes."""

from __future__ import annotations

from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec, EngineDevice

#: CPU attention (vLLM's CPU_ATTN backend) runs blocks of a multiple of this many tokens
CPU_BLOCK_MULTIPLE = 32
#: host memory a CPU vLLM pod needs besides its KV cache (API server, engine core, one worker per rank)
CPU_BASE_MEMORY_GIB = 4


#: the ``sitecustomize`` the CPU launcher gives vLLM's processes (every process vLLM spawns loads it), for two faults
#: of vLLM 0.32's CPU build:
#:
#: - Its NIXL worker on CPU pins its model thread to the last core of each NUMA node of the *machine*
#:   (``CpuPlatform.discover_numa_topology`` reads /sys and ignores the container's cpuset), so every P/D engine on a
#:   node computes on one core while the cores it was given idle — or, under a kubelet's static cpuset, the call
#:   fails. This keeps every affinity change within the cores the container started with (an empty intersection
#:   keeps them all).
#: - On CPUs with AMX, its CPU attention runs its AMX kernel (a bfloat16 model, blocks of a multiple of 32) without
#:   asking Linux for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and Linux kills a
#:   process that uses tiles unasked with SIGILL. oneDNN asks on its first AMX matrix multiply, so an engine whose first
#:   forward pass multiplies enough tokens runs by luck; a decode engine's first pass is the one-token step after a
#:   remote prefill, and its worker died (exit code -4) at its first request. This asks at start-up (first, so
#:   nothing else here can skip it; an exec'd process loses the grant, which is why every process asks), only where
#:   the CPU and kernel offer AMX tiles (ARCH_GET_XCOMP_SUPP); a failed call (a seccomp profile, say) is printed.
CPU_SITE = """\
import os
if os.uname().machine == "x86_64":
    try:
        import ctypes

        _libc, _offered = ctypes.CDLL(None, use_errno=True), ctypes.c_uint64(0)
        # arch_prctl(ARCH_GET_XCOMP_SUPP): what the CPU and kernel offer; EINVAL: a kernel before 5.16, no AMX
        if _libc.syscall(158, 0x1021, ctypes.byref(_offered)) != 0:
            _failed = ctypes.get_errno() != 22
        else:  # XFEATURE_XTILEDATA (bit 18) offered: ask for it, arch_prctl(ARCH_REQ_XCOMP_PERM, 18)
            _failed = bool(_offered.value >> 18 & 1) and _libc.syscall(158, 0x1023, 18) != 0
        if _failed:
            import sys

            print(f"kvbridge: could not ask Linux for AMX tiles: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    except (ImportError, OSError, AttributeError):
        pass
_cpus = os.environ.get("KVBRIDGE_CONTAINER_CPUS", "")
if _cpus and hasattr(os, "sched_setaffinity"):
    _allowed = frozenset(int(c) for c in _cpus.split(","))
    _set_affinity = os.sched_setaffinity

    def _confined(pid, mask):
        _set_affinity(pid, (set(mask) & _allowed) or _allowed)

    os.sched_setaffinity = _confined
"""

#: a ``python3 -c`` launcher for CPU pods: bind each TP rank to its own share of the cores the container may use
#: (the kubelet's cpuset), keep vLLM's later affinity changes within them and ask for AMX tiles (``CPU_SITE``, on
#: PYTHONPATH), then exec ``vllm serve``. vLLM's "auto" binding gives every rank all cores of a NUMA node, which on
#: a small node makes TP ranks fight over the same cores.
CPU_BIND_LAUNCHER = f"""\
import os, sys, tempfile
tp = int(sys.argv[1])
cpus = sorted(os.sched_getaffinity(0))
if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    if len(cpus) < tp:
        sys.exit(f"kvbridge: {{len(cpus)}} CPU(s) available for tensor-parallel size {{tp}}: request at least {{tp}}")
    per = len(cpus) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cpus[r * per:(r + 1) * per])) for r in range(tp))
site = tempfile.mkdtemp(prefix="kvbridge-site-")
with open(os.path.join(site, "sitecustomize.py"), "w") as f:
    f.write({CPU_SITE!r})
os.environ["KVBRIDGE_CONTAINER_CPUS"] = ",".join(map(str, cpus))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
os.execvp(sys.argv[2], sys.argv[2:])
"""


#: what ``kvbridge plan``'s text says of the launcher (``--json`` shows its whole command)
CPU_LAUNCHER_NOTE = (
    "(run through kvbridge's CPU launcher: one core set per TP rank, VLLM_CPU_OMP_THREADS_BIND; `--json` shows it)"
)


def cpu_build(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether the spec runs vLLM's CPU build (``engine.device: CPU``)."""
    return spec.engine.device is EngineDevice.CPU


def cpu_block_size(block_size: int) -> int:
    """The block size CPU attention runs nearest below ``block_size`` (itself when it is a multiple of 32)."""
    return max(CPU_BLOCK_MULTIPLE, block_size // CPU_BLOCK_MULTIPLE * CPU_BLOCK_MULTIPLE)
