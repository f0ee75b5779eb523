"""Documents to token ids in batches, the work both preparation engines share: a batch's
`TokenizedBatch` and the local engine's process pool (`local_tokenized_batches`). corpus.py
drives either engine; ray_tokenize.py is the Ray one. Both import this module, and neither the
other (corpus.py picks the Ray engine by importing it when asked).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import numpy as np

from isoloco_ray.data.prepare.encoding import encode_batch, encoder_from_json

CORPUS_BATCH = 512  # documents per task of the tokenizing pool (and per Ray Data batch)

T = TypeVar("T")


class TokenizedBatch(NamedTuple):
    """A batch of documents tokenized: every document as [BOS] ids EOS in one int32 ``stream``,
    the ``lengths`` of the documents in it, and the source file index of each (``files``)."""

    stream: np.ndarray
    lengths: np.ndarray
    files: np.ndarray


_WORKER_ENCODER: Any = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_ENCODER
    # Ctrl-C reaches the whole process group: the parent handles it (and terminates the pool);
    # workers would only print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker: W workers use W cores
    _WORKER_ENCODER = encoder_from_json(tokenizer_json)


def _encode_in_worker(texts: list[str], eos_id: int,
                      bos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    return encode_batch(_WORKER_ENCODER, texts, eos_id, bos_id)


def local_tokenized_batches(documents: Iterable[tuple[int, str]], tokenizer_json: str,
                            eos_id: int, bos_id: int | None,
                            workers: int) -> Iterator[TokenizedBatch]:
    """The local engine: ``encode_batch`` of every ``CORPUS_BATCH`` (file index, document)
    pairs, in order; ``workers > 1`` spreads batches over a process pool with at most 2
    batches per process in flight (Pool.imap would read the whole source)."""
    batches = ((np.array([f for f, _ in batch], dtype=np.int64), [t for _, t in batch])
               for batch in _batched(documents, CORPUS_BATCH))
    if workers <= 1:
        enc = encoder_from_json(tokenizer_json)
        for files, texts in batches:
            yield TokenizedBatch(*encode_batch(enc, texts, eos_id, bos_id), files)
        return
    # spawn, not fork: forking after the Rust tokenizer used its thread pool can deadlock.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_json,)) as pool:
        pending: deque[Any] = deque()
        for files, texts in batches:
            pending.append((files, pool.apply_async(_encode_in_worker, (texts, eos_id, bos_id))))
            if len(pending) >= 2 * workers:
                files, result = pending.popleft()
                yield TokenizedBatch(*result.get(), files)
        while pending:
            files, result = pending.popleft()
            yield TokenizedBatch(*result.get(), files)


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch
