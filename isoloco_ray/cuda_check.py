"""Before a GPU run trains: is CUDA usable on every GPU node, with this torch build?

The torch that `pip install -e .` gets on Linux x86_64 is PyTorch's CUDA 13.0 build, which
needs an NVIDIA driver of branch 580 or newer. On a node with an older driver every worker
would fail at its first CUDA call and Ray Train would restart them all, run.max_failures
times, for nothing. So the driver probes each GPU node once (a Ray task holding one GPU there)
and refuses the run with the node, the driver's and torch's versions and the fix. The same
probe reports each GPU's memory, against which the run's bytes per worker are checked
(gpu_memory.py).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence

from isoloco_ray.config import ConfigError
from isoloco_ray.gpu_memory import GpuMemory

# How long the probes may wait for a GPU (another job may hold them all).
PROBE_TIMEOUT_SECONDS = 120.0
# What to do about a driver older than the torch build needs.
OLDER_DRIVER_FIX = ("update the NVIDIA driver (CUDA 13 builds need branch 580 or newer), or "
                    "install PyTorch's CUDA 12 build of the same torch on every node (CUDA 12 "
                    "builds run on drivers 525 and newer; PyTorch's install page gives the "
                    "pip --index-url, e.g. .../whl/cu128)")


def driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it, or why it is unknown."""
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi on this node)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown (nvidia-smi: {exc})"
    versions = sorted(set(out.stdout.split()))
    return ", ".join(versions) if out.returncode == 0 and versions else \
        f"unknown (nvidia-smi: {(out.stderr or out.stdout).strip()[:200]})"


def cuda_problem() -> str | None:
    """Why CUDA is not usable in this process (one line: node, error, torch build, driver,
    fix), or None. Initialises CUDA on the first visible device."""
    import torch

    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is usable (torch.cuda.is_available() is False)")
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the CUDA runtime's errors vary by cause
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return (f"CUDA is not usable on {socket.gethostname()}: {reason}; torch "
                f"{torch.__version__} is built for CUDA {torch.version.cuda}, the NVIDIA "
                f"driver is {driver_version()}: {OLDER_DRIVER_FIX}; or set "
                "scaling.use_gpu=false")
    return None


def probe_gpu() -> tuple[str | None, int | None]:
    """`cuda_problem()`, and when CUDA works the memory of the GPU this process sees (bytes)."""
    import torch

    problem = cuda_problem()
    if problem is not None:
        return problem, None
    return None, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def refuse_unusable(problems: Sequence[str | None], unreached: int) -> None:
    """ConfigError with the first GPU node's problem (and how many more have one); a warning
    when `unreached` nodes could not be probed in time (training goes on: their workers will
    tell)."""
    found = [problem for problem in problems if problem]
    if found:
        more = f" (and {len(found) - 1} more GPU nodes)" if len(found) > 1 else ""
        raise ConfigError(f"scaling.use_gpu: {found[0]}{more}")
    if unreached:
        print(f"warning: CUDA not checked on {unreached} GPU node(s): no GPU there became free "
              f"within {PROBE_TIMEOUT_SECONDS:g} s", file=sys.stderr, flush=True)


def check_memory(memory: GpuMemory, gpu_bytes: Sequence[int]) -> None:
    """Refuse a run whose training state exceeds the smallest of the probed GPUs, warn when
    its estimated peak comes close (`GpuMemory.check`); print what it needs against what it
    has. Nothing when no GPU was probed."""
    if not gpu_bytes:
        return
    smallest = min(gpu_bytes)
    warning = memory.check(smallest)
    print(memory.summary(smallest), flush=True)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def check_cuda_on_gpu_nodes(timeout: float = PROBE_TIMEOUT_SECONDS,
                            memory: GpuMemory | None = None) -> None:
    """Probe every live GPU node of the connected Ray cluster (`probe_gpu` in a task
    holding one of its GPUs) and refuse the run if CUDA is unusable on any
    (`refuse_unusable`) or, given the run's `memory`, if it cannot fit (`check_memory`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_gpus=1, num_cpus=0, max_retries=0)(probe_gpu)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["NodeID"], soft=False)).remote()
        for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU", 0) >= 1]
    if not refs:
        return
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for ref in pending:
        ray.cancel(ref, force=True)
    results = ray.get(ready)
    refuse_unusable([problem for problem, _ in results], len(pending))
    if memory is not None:
        check_memory(memory, [total for _, total in results if total])
