"""Running an outer sync in the background (`outer.delay` > 0) while the replicas train on.

One sync at a time runs on a separate thread, and on GPU on a separate CUDA stream, in its own
process group (collectives of one group must not be issued from two threads at once). The
training thread starts a sync with `start` and takes its result with `finish`; the tensors a
sync reads and writes (its fragment's pseudo-gradients, global parameters, momentum) are not
touched by the training thread in between (fragments.py: a fragment's update lands before
the next fragment's sync starts).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

# Per-thread thread-count setters of the CPU runtimes torch's wheels use on Linux: GNU OpenMP
# (ATen's parallel loops, oneDNN) and MKL (BLAS, LAPACK), linked into libtorch_cpu.
_TORCH_LIB = Path(torch.__file__).parent / "lib"
_PER_THREAD_SETTERS = (
    (_TORCH_LIB / "libgomp.so.1", "omp_set_num_threads"),
    (Path("libgomp.so.1"), "omp_set_num_threads"),
    (_TORCH_LIB / "libtorch_cpu.so", "MKL_Set_Num_Threads_Local"),
)


def use_one_cpu_thread_here() -> None:
    """Run the calling thread's torch CPU ops on one thread, leaving the other threads'
    settings alone (torch.set_num_threads would change the training thread's too).

    Why: GNU OpenMP gives every thread that starts a parallel region a team of its own, and
    once the teams' threads outnumber the cores it stops spinning between regions in every
    team. A sync thread with a team of 2 next to the training thread's made the training
    steps 35% slower on 2 cores (benchmarks/overlap.py). Best effort: a runtime this build
    does not use is skipped.
    """
    torch.get_num_threads()  # ATen's per-thread set-up first: it would undo what follows
    done = set()
    for library, setter in _PER_THREAD_SETTERS:
        if setter in done:
            continue
        try:
            getattr(ctypes.CDLL(str(library)), setter)(1)
        except (OSError, AttributeError):
            continue
        done.add(setter)


class Background:
    """A one-thread executor for outer syncs, ordered with the training thread's CUDA work."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-sync",
                                        initializer=use_one_cpu_thread_here)
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, work: Callable[[], T]) -> Future[T]:
        """Run `work` on the sync thread once the training thread's queued device work (the
        pseudo-gradients it reads) is done."""
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self._device))

        def run() -> T:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return work()

        return self._pool.submit(run)

    def finish(self, future: Future[T]) -> T:
        """Wait for `work`'s result (re-raising its error); the training thread's later device
        work is ordered after the sync's."""
        result = future.result()
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return result

    def close(self) -> None:
        """Wait for a sync still running and stop the thread."""
        self._pool.shutdown(wait=True)
