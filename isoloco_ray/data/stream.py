"""Each replica's training data: a disjoint, deterministic, resumable sequence of token batches.

Replica r of R owns the train shards `files[r::R]` (whole parquet files, in order) or, when there
are fewer shards than replicas, the r-th of R contiguous, near-equal row ranges of all shards
(`format.share_of_rows`), whatever the worker layout, so moving replicas between workers never
changes what they train on: its `ReplicaShare`. A run longer than a share reads it again, in
the same order (epochs). On Ray the worker hosting a replica streams its rows with Ray Data
(`ray_reader.read_with_ray_data`, in a module of its own that imports Ray and this one);
without Ray (tests, single-process loops) the same rows are read with pyarrow
(`read_with_pyarrow`). Both feed `ReplicaStream`, which cuts blocks into sequences,
groups them into batches and counts what it consumed (epoch, sequences); the shard and row of
a count follow from the shards' row counts, so a resumed stream opens its reader at that
shard and row, at the same cost anywhere in the data. One open reads on past the epoch's end
through whole epochs of the share (`EpochRows`), so a new epoch costs nothing: on Ray each
open starts a read task, in a process Ray may have to start again by then (seconds on a busy
node, every epoch of a small dataset).
Readers yield `ShardBlocks`: the rows and the shard file of each row (Ray Data's `path` column),
so that a token id outside the model's vocabulary, checked as every batch is read, is reported
with its file instead of failing as an index error inside the embedding.
A dataset at a URI (s3://...) is read in place, shards through pyarrow's filesystems
(format.open_shard): a `ShardRange`'s path is then a `UPath`, whose str is the shard's URI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from isoloco_ray.data.format import (
    DataDir,
    DataError,
    DataPath,
    Dataset,
    read_blocks,
    share_of_rows,
)

if TYPE_CHECKING:  # torch only where a batch becomes a tensor (next_batch)
    import torch


@dataclass(frozen=True)
class ShardBlocks:
    """Consecutive rows of a replica's train shards and the shard file they were read from."""

    tokens: np.ndarray  # (rows, block_len) integer token ids
    files: str | np.ndarray  # the shard of every row: one path, or one path per row

    def file_of(self, row: int) -> str:
        """The shard file that row ``row`` of ``tokens`` came from."""
        return self.files if isinstance(self.files, str) else str(self.files[row])

    def split(self, rows: int) -> tuple[ShardBlocks, ShardBlocks]:
        """The first `rows` rows, and the rest."""
        files = self.files
        head, tail = ((files, files) if isinstance(files, str)
                      else (files[:rows], files[rows:]))
        return ShardBlocks(self.tokens[:rows], head), ShardBlocks(self.tokens[rows:], tail)


T = TypeVar("T")



@dataclass(frozen=True)
class ShardRange:
    """Rows [start, stop) of one train shard of `shard_rows` rows."""

    path: DataDir  # a local shard, or one at a URI (str(path) is the URI)
    start: int
    stop: int
    shard_rows: int

    @classmethod
    def whole_shard(cls, path: DataDir, rows: int) -> ShardRange:
        """All `rows` rows of the shard at `path`."""
        return cls(path, 0, rows, rows)

    @property
    def rows(self) -> int:
        """Rows in the range."""
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        """Whether the range is the whole shard."""
        return self.start == 0 and self.stop == self.shard_rows


# Reads exactly the given row ranges, in order.
RowReader = Callable[[Sequence[ShardRange]], Iterable[ShardBlocks]]

# One open of a reader covers the rest of an epoch and then whole epochs of the share, up to
# this many ranges in all (a share of one shard: 256 epochs per open).
RANGES_PER_OPEN = 256


@dataclass(frozen=True)
class ReplicaShare:
    """The train rows one replica reads each epoch (`share_of_rows`), in order, and their
    block length: enough to find the shard and row of any position without reading."""

    ranges: tuple[ShardRange, ...]
    block_len: int

    @property
    def rows(self) -> int:
        """Rows in one epoch of the share."""
        return sum(part.rows for part in self.ranges)

    def after(self, rows: int) -> list[ShardRange]:
        """The ranges left after the share's first `rows` rows: the shard holding row `rows`
        from that row on, then the shards after it."""
        for index, part in enumerate(self.ranges):
            if rows < part.rows:
                first = ShardRange(part.path, part.start + rows, part.stop, part.shard_rows)
                return [first, *self.ranges[index + 1:]]
            rows -= part.rows
        return []


def replica_share(data: DataPath | Dataset, replica: int, replicas: int) -> ReplicaShare:
    """The train rows replica `replica` of `replicas` reads (`share_of_rows`), in order, of
    the dataset at `data` (a local path, a URI, or the Dataset opened already)."""
    dataset = Dataset.open(data)
    meta, root = dataset.meta, dataset.root
    shards = meta.split("train").shards
    return ReplicaShare(
        tuple(ShardRange(root / shards[index].file, start,
                         shards[index].rows if stop is None else stop, shards[index].rows)
              for index, start, stop in share_of_rows([s.rows for s in shards], replica,
                                                      replicas)),
        meta.block_len)


def read_with_pyarrow(ranges: Sequence[ShardRange]) -> Iterator[ShardBlocks]:
    """The rows of `ranges` (local shards or at a URI), read with pyarrow (no Ray)."""
    for part in ranges:
        yield ShardBlocks(read_blocks(part.path)[part.start:part.stop], str(part.path))


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


class EpochRows:
    """One open reader over `share`: the rest of an epoch from row `start`, then as many whole
    epochs as `RANGES_PER_OPEN` allows (`epochs_left`). `take` hands out the rows of one
    epoch exactly, splitting a block that runs past its end."""

    def __init__(self, share: ReplicaShare, read_rows: RowReader, start: int) -> None:
        self.epochs_left = max(1, RANGES_PER_OPEN // max(1, len(share.ranges)))
        self._blocks = iter(read_rows([*share.after(start),
                                       *share.ranges * self.epochs_left]))
        self._rest: ShardBlocks | None = None  # read past the end of the last epoch taken

    def take(self, rows: int) -> Iterator[ShardBlocks]:
        """The next `rows` rows (fewer if the reader ends first)."""
        while rows > 0:
            part, self._rest = self._rest, None
            part = part if part is not None else next(self._blocks, None)
            if part is None:
                return
            if len(part.tokens) > rows:
                part, self._rest = part.split(rows)
            rows -= len(part.tokens)
            yield part

    def close(self) -> None:
        """Stop the reader (see ReplicaStream.close)."""
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()


class ReplicaStream:
    """Batches of `batch_size` sequences of `seq_len` tokens from one replica's share, in order.

    Rows (blocks of `block_len` tokens) are cut into `block_len // seq_len` sequences (the
    remainder of a row, if any, is not used). When the share is exhausted a new epoch starts
    over it, in the same order, from the reader already open (`EpochRows`). A stream opened at
    a position reads from the shard and row holding it (`ReplicaShare.after`), so resuming
    costs the same at any position. With `vocab_size` (the model's), every block read is
    checked to hold ids below it (`check_token_ids`: DataError naming the shard); None skips
    the check.
    """

    position: StreamPosition
    _rows: EpochRows | None = None  # the open reader
    _sequences: Generator[np.ndarray, None, None] | None = None  # this epoch's sequences

    def __init__(self, share: ReplicaShare, read_rows: RowReader, seq_len: int,
                 batch_size: int, position: StreamPosition | None = None, *,
                 vocab_size: int | None = None) -> None:
        if share.block_len < seq_len:
            raise ValueError(f"data.seq_len ({seq_len}) is longer than the data's blocks "
                             f"({share.block_len} tokens); lower data.seq_len")
        self._share = share
        self._read_rows = read_rows
        self._seq_len = seq_len
        self._per_row = share.block_len // seq_len
        self._batch_size = batch_size
        self._vocab_size = vocab_size
        self.seek(position or StreamPosition())

    def seek(self, position: StreamPosition) -> None:
        """Continue from `position`, reading from the shard and row that hold it."""
        self.close()
        self.position = StreamPosition(position.epoch, position.sequences)
        rows, to_skip = divmod(position.sequences, self._per_row)
        self._rows = EpochRows(self._share, self._read_rows, rows)
        self._sequences = self._epoch(self._share.rows - rows, to_skip)

    def position_after(self, batches: int) -> StreamPosition:
        """Where a stream opened at the start stands after `batches` batches: a function of
        the count alone (a batch never straddles two epochs; an epoch's last batch leaves the
        position at its end, and the next batch starts the next epoch)."""
        per_epoch = self._share.rows * self._per_row // self._batch_size
        if batches == 0:
            return StreamPosition()
        epoch, within = divmod(batches - 1, per_epoch)
        return StreamPosition(epoch, (within + 1) * self._batch_size)

    def close(self) -> None:
        """Stop the reader now (Ray Data's executor and its threads with it), not when it is
        garbage collected: an open one left at exit can keep the process from ending."""
        if self._sequences is not None:
            self._sequences.close()
        if self._rows is not None:
            self._rows.close()

    def where(self) -> tuple[str, int]:
        """The shard file and row (within the file) of the next unread sequence; ("", 0) past
        the end of the epoch."""
        ranges = self._share.after(self.position.sequences // self._per_row)
        return (str(ranges[0].path), ranges[0].start) if ranges else ("", 0)

    def _epoch(self, rows: int, skip: int) -> Generator[np.ndarray, None, None]:
        """The sequences of the open reader's next `rows` rows (the rest of an epoch), the
        first `skip` left out."""
        assert self._rows is not None
        for part in self._rows.take(rows):
            if self._vocab_size is not None:
                check_token_ids(part, self._vocab_size)
            seqs = part.tokens[:, : self._per_row * self._seq_len]
            seqs = seqs.reshape(-1, self._seq_len)
            yield from seqs[skip:]
            skip = max(0, skip - len(seqs))

    def _next_epoch(self) -> None:
        """Start the next epoch: from the open reader while it has whole epochs left."""
        assert self._rows is not None
        if self._rows.epochs_left == 0:
            self.seek(StreamPosition(epoch=self.position.epoch + 1, sequences=0))
            return
        self._rows.epochs_left -= 1
        self.position = StreamPosition(epoch=self.position.epoch + 1, sequences=0)
        self._sequences = self._epoch(self._share.rows, 0)

    def next_batch(self) -> torch.Tensor:
        """The next (batch_size, seq_len) int64 batch; rolls over to a new epoch when needed."""
        assert self._sequences is not None
        rows: list[np.ndarray] = []
        started_epoch_here = False
        while len(rows) < self._batch_size:
            row = next(self._sequences, None)
            if row is None:
                if started_epoch_here:
                    raise ValueError("a replica's shards hold fewer sequences than one batch")
                self._next_epoch()
                started_epoch_here = True
                rows.clear()  # a batch never straddles two epochs
                continue
            rows.append(row)
        self.position.sequences += self._batch_size
        import torch  # here: Ray Data's read tasks import this module and need no torch

        return torch.from_numpy(np.stack(rows).astype(np.int64))


@contextlib.contextmanager
def closing(iterable: Iterable[T]) -> Iterator[Iterator[T]]:
    """An iterator over `iterable`, closed on leaving (if it can be: generators)."""
    iterator = iter(iterable)
    try:
        yield iterator
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
