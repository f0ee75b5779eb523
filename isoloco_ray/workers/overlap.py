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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class Background:
    """A one-thread executor for outer syncs, ordered with the training thread's CUDA work."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-sync")
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
