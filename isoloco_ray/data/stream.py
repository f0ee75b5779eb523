"""Each replica's training data: a disjoint, deterministic, resumable sequence of token batches.

Replica r of R owns the train shards `files[r::R]` (whole parquet files, in order) or, when there
are fewer shards than replicas, the r-th of R contiguous, near-equal row ranges of all shards
(`format.share_of_rows`), whatever the worker layout, so moving replicas between workers never
changes what they train on. A run longer than a replica's share reads it again, in the same
order (epochs). On Ray the shards are read by Ray Data (`read_parquet`, order preserved, one
unsplit dataset per replica, read only by the worker that hosts it: `replica_data_config`);
without Ray (tests, single-process loops) the same files are read with pyarrow. Both feed
`ReplicaStream`, which cuts blocks into sequences, groups them into batches and counts what it
consumed, since Ray Data cannot resume mid-epoch.
Readers yield `ShardBlocks`: the rows and the shard file of each row (Ray Data's `path` column),
so that a token id outside the model's vocabulary, checked as every batch is read, is reported
with its file instead of failing as an index error inside the embedding.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from isoloco_ray.data.format import DataError, DatasetMeta, read_blocks, share_of_rows

if TYPE_CHECKING:
    import ray.data


@dataclass(frozen=True)
class ShardBlocks:
    """Consecutive rows of a replica's train shards and the shard file they were read from."""

    tokens: np.ndarray  # (rows, block_len) integer token ids
    files: str | np.ndarray  # the shard of every row: one path, or one path per row

    def file_of(self, row: int) -> str:
        """The shard file that row ``row`` of ``tokens`` came from."""
        return self.files if isinstance(self.files, str) else str(self.files[row])


# Yields the rows of one epoch, in order.
EpochReader = Callable[[], Iterable[ShardBlocks]]

# Ray Data's column with each row's file, added by read_parquet(include_paths=True).
PATH_COLUMN = "path"


@dataclass(frozen=True)
class ShardRange:
    """Rows [start, stop) of one train shard; stop None: to the shard's end."""

    path: Path
    start: int = 0
    stop: int | None = None

    @property
    def whole(self) -> bool:
        """Whether the range is the whole shard."""
        return self.start == 0 and self.stop is None


def replica_ranges(data_dir: Path, replica: int, replicas: int) -> list[ShardRange]:
    """The train rows replica `replica` of `replicas` reads (`share_of_rows`), in order."""
    shards = DatasetMeta.load(data_dir).split("train").shards
    return [ShardRange(Path(data_dir) / shards[index].file, start, stop)
            for index, start, stop in share_of_rows([s.rows for s in shards], replica, replicas)]


def dataset_name(replica: int) -> str:
    """The Ray Train dataset key of one replica's stream."""
    return f"train_{replica}"


def pyarrow_reader(ranges: Sequence[ShardRange]) -> EpochReader:
    """An epoch reader over row ranges of local parquet shards, without Ray."""
    return lambda: (ShardBlocks(read_blocks(part.path)[part.start:part.stop], str(part.path))
                    for part in ranges)


def ray_data_reader(iterator: Any, ranges: Sequence[ShardRange] = (),
                    rows_per_read: int = 256) -> EpochReader:
    """An epoch reader over a Ray Data `DataIterator` of a replica's shards (read with
    `include_paths=True`, as `replica_datasets` does, so every row names its shard).

    `ranges`: the replica's share (`replica_ranges`). Of a shard only partly in it the dataset
    reads every row, in order, and the rows outside the range are dropped here, counted per
    file (only small corpora, with fewer shards than replicas, have such shards)."""
    partial = {str(part.path): part for part in ranges if not part.whole}

    def epoch() -> Iterator[ShardBlocks]:
        rows_seen: dict[str, int] = {}  # per partial shard: its rows read so far this epoch
        for batch in iterator.iter_batches(batch_size=rows_per_read, batch_format="numpy",
                                           prefetch_batches=2):
            files = batch.get(PATH_COLUMN)
            tokens = np.stack(batch["tokens"])
            if partial and files is not None:
                keep = np.ones(len(tokens), dtype=bool)
                for name, part in partial.items():
                    where = np.flatnonzero(files == name)
                    index = rows_seen.get(name, 0) + np.arange(len(where))
                    rows_seen[name] = rows_seen.get(name, 0) + len(where)
                    stop = part.stop if part.stop is not None else np.iinfo(np.int64).max
                    keep[where] = (index >= part.start) & (index < stop)
                tokens, files = tokens[keep], files[keep]
                if not len(tokens):
                    continue
            yield ShardBlocks(tokens, "a train shard (no path column)" if files is None
                              else files)

    return epoch


def check_token_ids(blocks: ShardBlocks, vocab_size: int) -> None:
    """Raise DataError naming the shard file and the id if any token id of ``blocks`` is
    outside ``0..vocab_size - 1`` (two vectorised reductions per batch; the search for the
    offending row runs only when there is one)."""
    tokens = blocks.tokens
    if tokens.size == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
        return
    bad = (tokens < 0) | (tokens >= vocab_size)
    row = int(np.flatnonzero(bad.any(axis=1))[0])
    token = int(tokens[row][bad[row]][0])
    raise DataError(
        f"{blocks.file_of(row)}: token id {token} is outside the model's vocabulary "
        f"(0..{vocab_size - 1}): the shard was not made with this model's tokenizer, or it is "
        "corrupt; prepare the data again (with --overwrite) or set model.vocab_size to the "
        "tokenizer's")


@dataclass
class StreamPosition:
    """Where a replica's stream stands: the epoch, and sequences consumed within it."""

    epoch: int = 0
    sequences: int = 0


class ReplicaStream:
    """Batches of `batch_size` sequences of `seq_len` tokens from one replica's blocks, in order.

    Blocks of `block_len` tokens are cut into `block_len // seq_len` sequences (the remainder of
    a block, if any, is not used). When the shards are exhausted a new epoch starts over them.
    With `vocab_size` (the model's), every block read is checked to hold ids below it
    (`check_token_ids`: DataError naming the shard); None skips the check.
    """

    position: StreamPosition

    def __init__(self, read_epoch: EpochReader, seq_len: int, batch_size: int,
                 position: StreamPosition | None = None, *,
                 vocab_size: int | None = None) -> None:
        self._read_epoch = read_epoch
        self._seq_len = seq_len
        self._batch_size = batch_size
        self._vocab_size = vocab_size
        self.position = position or StreamPosition()
        self._sequences: Iterator[np.ndarray] = self._open_epoch(skip=self.position.sequences)

    def seek(self, position: StreamPosition) -> None:
        """Continue from `position` (re-reading the epoch's start: Ray Data cannot seek)."""
        self.position = StreamPosition(position.epoch, position.sequences)
        self._sequences = self._open_epoch(skip=position.sequences)

    def _open_epoch(self, skip: int) -> Iterator[np.ndarray]:
        def sequences() -> Iterator[np.ndarray]:
            to_skip = skip
            for part in self._read_epoch():
                if self._vocab_size is not None:
                    check_token_ids(part, self._vocab_size)
                blocks = part.tokens
                per_block = blocks.shape[1] // self._seq_len
                if per_block == 0:
                    raise ValueError(
                        f"data.seq_len ({self._seq_len}) is longer than the data's blocks "
                        f"({blocks.shape[1]} tokens); lower data.seq_len")
                seqs = blocks[:, : per_block * self._seq_len].reshape(-1, self._seq_len)
                if to_skip >= len(seqs):
                    to_skip -= len(seqs)
                    continue
                yield from seqs[to_skip:]
                to_skip = 0

        return sequences()

    def next_batch(self) -> torch.Tensor:
        """The next (batch_size, seq_len) int64 batch; rolls over to a new epoch when needed."""
        rows: list[np.ndarray] = []
        started_epoch_here = False
        while len(rows) < self._batch_size:
            row = next(self._sequences, None)
            if row is None:
                if started_epoch_here:
                    raise ValueError("a replica's shards hold fewer sequences than one batch")
                self.position = StreamPosition(epoch=self.position.epoch + 1, sequences=0)
                self._sequences = self._open_epoch(skip=0)
                started_epoch_here = True
                rows.clear()  # a batch never straddles two epochs
                continue
            rows.append(row)
        self.position.sequences += self._batch_size
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def replica_datasets(data_dir: Path, replicas: int) -> dict[str, ray.data.Dataset]:
    """One Ray Data dataset per replica over the shards of its share (`replica_ranges`; order
    preserved when iterated), each row with its shard's path (the `path` column) for error
    messages and for `ray_data_reader`'s row ranges.

    Each is one read task (`override_num_blocks=1`) of Ray Data's file-based parquet reader
    (`parquet_datasource_v1`): it streams the replica's shards in order, and its first batch
    arrives in about a second instead of tens of seconds. One task, not one per shard: Ray
    Data's executor in the worker polls without pause once all of a dataset's read tasks have
    finished while the worker has not consumed their output yet (Ray 2.60,
    `process_completed_tasks` waits only on running tasks). With a task per shard of small data
    that is at once, and it took half a core from every worker's training for the whole run
    (2.3x slower rounds of the demo); a single streaming task stays running, held back by the
    consumer, to the end of the epoch. One sequential reader per replica is far faster than
    training consumes tokens."""
    import ray.data

    with parquet_datasource_v1():
        return {
            dataset_name(r): ray.data.read_parquet(
                list(dict.fromkeys(str(part.path) for part in replica_ranges(data_dir, r,
                                                                             replicas))),
                include_paths=True, override_num_blocks=1)
            for r in range(replicas)
        }


@contextlib.contextmanager
def parquet_datasource_v1() -> Iterator[None]:
    """`read_parquet` calls inside use Ray Data's file-based ParquetDatasource (V1).

    Ray 2.60 routes read_parquet through its DataSourceV2 by default, whose every execution
    first provisions a pool of 32 FooterReader actors (RAY_DATA_PARQUET_FOOTER_NUM_ACTORS) to
    read the files' footers: 32 new worker processes per replica stream, each importing Ray
    Data. On a small machine that is 15-40 s before a replica's first batch, paid by every
    replica of the first round. V1 reads the footers in the driver when the dataset is made (a
    couple of sampling tasks) and its read tasks deliver the first batch in about a second.
    Both read the same rows in the same order (tests/test_stream.py). The driver's flag and
    V1's logger (it logs its estimated batch size on the console) are restored afterwards; a
    Ray without the flag reads as it always does."""
    import ray.data

    context = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data._internal.datasource.parquet_datasource")
    flag, level = getattr(context, "use_datasource_v2", None), logger.level
    if flag is not None:
        context.use_datasource_v2 = False
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        if flag is not None:
            context.use_datasource_v2 = flag


def replica_data_config() -> Any:
    """A Ray Train DataConfig that leaves each replica's dataset whole and ordered.

    Train's default would split every dataset across all workers; here no dataset is split
    (each worker may open any replica's stream and only the host of replica r reads
    `train_r`) and order is preserved, so a replica's stream does not depend on the layout.
    """
    from ray.data import ExecutionOptions
    from ray.train import DataConfig

    return DataConfig(datasets_to_split=[],
                      execution_options=ExecutionOptions(preserve_order=True))
