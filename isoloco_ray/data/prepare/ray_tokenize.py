"""The Ray engine of ``prepare --source`` (``--engine ray``): Ray Data reads the source files
and tokenizes them on a pool of actors spread over the cluster; the driver routes, packs and
writes exactly as the local engine does (corpus.py), so both engines write the same bytes.

    read tasks (consecutive source files, in order) -> map_batches(_Tokenize): an actor pool,
    one tokenizer thread per actor, tokenizing.CORPUS_BATCH documents per call -> the driver,
    in order

Order: ``preserve_order`` hands the driver the blocks in file order whatever actor tokenized
them, and a document's tokens do not depend on the batch it is encoded in, so the document
stream the driver routes is the local engine's. Each document carries its file index, which
is what a resume needs (corpus._Run.file_documents): reading restarts at a file, skipping the
documents of it already routed.

Imported only when the Ray engine runs (it imports Ray).

On a cluster the read tasks run on any node: ``--source`` must be a path every node can read
(a shared file system mounted at the same place); ``--out`` is written by the driver alone.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from isoloco_ray.data.format import DataError
from isoloco_ray.data.prepare.encoding import encode_batch, encoder_from_json
from isoloco_ray.data.prepare.sources import TextSource, file_documents
from isoloco_ray.data.prepare import tokenizing
from isoloco_ray.data.prepare.tokenizing import TokenizedBatch

DOCUMENTS_PER_BLOCK = 2048  # a read task's output blocks (a few MB of text)
BLOCK_BYTES = 8 << 20
TASK_BYTES = 64 << 20  # source files are grouped into read tasks of about this many bytes
FILE_COLUMN, TEXT_COLUMN, TOKENS_COLUMN = "file", "text", "tokens"


def read_task_files(file_bytes: Sequence[int], first: int,
                    task_bytes: int = TASK_BYTES) -> list[list[int]]:
    """The indices of the files from ``first`` on (of ``file_bytes`` bytes each) cut into runs
    of consecutive files of about ``task_bytes`` each (one read task each): many small files
    share a task, a large one has its own."""
    tasks: list[list[int]] = []
    size = 0
    for index in range(first, len(file_bytes)):
        if not tasks or size >= task_bytes:
            tasks.append([])
            size = 0
        tasks[-1].append(index)
        size += file_bytes[index]
    return tasks


def read_documents(files: Sequence[Path], indices: Sequence[int], skip: int, text_field: str,
                   documents_per_block: int = DOCUMENTS_PER_BLOCK) -> Iterator[pa.Table]:
    """A read task: tables of (file index, text) for the documents of ``files[i]`` for i in
    ``indices``, in order, leaving out the first ``skip`` documents of the first file."""
    for n, index in enumerate(indices):
        documents = file_documents(files[index], text_field)
        if n == 0 and skip:
            documents = itertools.islice(documents, skip, None)
        while texts := list(itertools.islice(documents, documents_per_block)):
            yield pa.table({FILE_COLUMN: pa.array([index] * len(texts), pa.int64()),
                            TEXT_COLUMN: pa.array(texts, pa.large_string())})


class _Tokenize:
    """The actors' function: a table of (file, text) in, (file, the tokens of each document)
    out."""

    def __init__(self, tokenizer_json: str, eos_id: int, bos_id: int | None) -> None:
        # One tokenizer thread per actor (it reserves one CPU): set before the Rust side first
        # builds its thread pool, which this fresh actor process has not done yet.
        os.environ["RAYON_NUM_THREADS"] = "1"
        self._encoder = encoder_from_json(tokenizer_json)
        self._eos_id, self._bos_id = eos_id, bos_id

    def __call__(self, batch: pa.Table) -> pa.Table:
        stream, lengths = encode_batch(self._encoder, batch[TEXT_COLUMN].to_pylist(),
                                       self._eos_id, self._bos_id)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(stream))
        return pa.table({FILE_COLUMN: batch[FILE_COLUMN], TOKENS_COLUMN: tokens})


@contextlib.contextmanager
def ray_running(workers: int | None) -> Iterator[int]:
    """Ray for the engine: the running one, the cluster named by RAY_ADDRESS (under ``ray job
    submit``), or else a local cluster on loopback (shut down at the end). Yields the number
    of tokenizing actors: ``workers``, or by default one per CPU of the cluster."""
    from isoloco_ray.local_ray import joined_cluster, start_local_cluster

    started = not ray.is_initialized()
    if started and joined_cluster():
        ray.init(logging_level="ERROR")
    elif started:
        start_local_cluster(workers or os.cpu_count() or 1)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False  # ours shows tokens/s
        # Its notes on our own settings, and tracebacks of errors that reach the driver anyway.
        logging.getLogger("ray.data").setLevel(logging.CRITICAL)
        yield workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    finally:
        if started:
            ray.shutdown()


def ray_tokenized_batches(source: TextSource, file: int, skip: int, tokenizer_json: str,
                          eos_id: int, bos_id: int | None,
                          workers: int) -> Iterator[TokenizedBatch]:
    """The documents of ``source`` from document ``skip`` of file ``file`` on, tokenized by
    ``workers`` actors (one CPU each) and yielded in source order."""
    tasks = read_task_files(source.file_bytes, file)
    if not tasks:
        return
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    # Blocks as the read task yields them: at Ray's default (128 MiB) it would hand over a
    # whole run of files as one block, to one actor, and the driver would wait for all of it.
    context.target_max_block_size = BLOCK_BYTES
    dataset = ray.data.read_datasource(
        TextFilesSource(source.files, source.file_bytes, tasks, skip, source.text_field),
        override_num_blocks=len(tasks), num_cpus=0)  # reading is light; CPUs go to the actors
    tokenized = dataset.map_batches(
        _Tokenize, fn_constructor_args=(tokenizer_json, eos_id, bos_id),
        batch_size=tokenizing.CORPUS_BATCH, batch_format="pyarrow", zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1)
    # Re-batched to the local engine's size, which is also the driver's progress granularity.
    batches = tokenized.iter_batches(batch_size=tokenizing.CORPUS_BATCH, batch_format="pyarrow",
                                     prefetch_batches=2)
    with warnings.catch_warnings(), closing(iter(batches)) as tables:
        # A source smaller than one block per actor leaves actors idle, which is no concern.
        warnings.filterwarnings("ignore", message="The minimum number of concurrent actors")
        for table in _tables_or_data_error(tables):
            if table.num_rows == 0:
                continue
            tokens = table[TOKENS_COLUMN].combine_chunks()
            yield TokenizedBatch(tokens.flatten().to_numpy(),
                                 np.asarray(tokens.value_lengths(), dtype=np.int64),
                                 table[FILE_COLUMN].to_numpy())


def _tables_or_data_error(tables: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """``tables``; a DataError raised in a task (a source file that is not UTF-8, ...) comes
    out as that DataError alone, without the task's traceback around it."""
    try:
        yield from tables
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DataError):
            # Ray Data appends its retry advice to the message; a bad file is no transient error.
            message = str(e.cause).partition("\nFailed to apply UDF transform")[0]
            raise DataError(message) from None
        raise


class TextFilesSource(Datasource):
    """The documents of source files, one read task per run of files (``read_task_files``)."""

    def __init__(self, files: Sequence[Path], file_bytes: Sequence[int], tasks: list[list[int]],
                 skip: int, text_field: str) -> None:
        super().__init__()
        self._files, self._tasks = list(files), tasks
        self._task_bytes = [sum(file_bytes[i] for i in task) for task in tasks]
        self._skip, self._text_field = skip, text_field

    def estimate_inmemory_data_size(self) -> int:
        return sum(self._task_bytes)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """The planned tasks, whatever ``parallelism``: their order is the documents' order."""
        read_tasks = []
        for n, (indices, size) in enumerate(zip(self._tasks, self._task_bytes)):
            metadata = BlockMetadata(
                num_rows=None, exec_stats=None, input_files=[str(self._files[i]) for i in indices],
                size_bytes=size)
            read = functools.partial(read_documents, self._files, indices,
                                     self._skip if n == 0 else 0, self._text_field)
            read_tasks.append(ReadTask(read, metadata))
        return read_tasks
