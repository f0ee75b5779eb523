"""A replica's train rows read with Ray Data (`read_with_ray_data`, a `RowReader` of stream.py):
a datasource of row ranges of train shards, read in order by one task.

Ray Data's own parquet readers plan a read with Ray tasks or actors of their own before it
starts (V1 samples files' footers in tasks of one CPU each; V2 starts a pool of 32 footer
reader actors), which a worker opening its replica's stream on a cluster whose CPUs all hold
training workers would wait for forever, and which cost seconds per open. The ranges here
carry their row counts (meta.json's), so nothing needs planning: one read task streams the
ranges' rows, shard after shard, in blocks of `rows_per_block` rows with each row's shard
file (the `path` column), and reads nothing outside them. Shards at a URI (s3://...) are
opened through pyarrow's filesystems inside the task (format.open_shard), on the node that
reads them, with its credentials.

Imported by workers only (it imports Ray); stream.py, which it builds on, knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from isoloco_ray.data.format import DataError, read_tokens
from isoloco_ray.data.stream import ShardBlocks, ShardRange, closing

# The column with each row's shard file, added by the read task (`read_ranges`).
PATH_COLUMN = "path"
BLOCK_BYTES = 4 << 20  # Ray Data's block size in a replica's reader
ROWS_PER_BLOCK = 256  # rows in each table the read task yields


def read_with_ray_data(ranges: Sequence[ShardRange], rows_per_batch: int = 256
                       ) -> Iterator[ShardBlocks]:
    """The rows of `ranges`, streamed by Ray Data from this process (a Ray Train worker).

    One dataset over the ranges, made here when a stream opens (at its start or at a resumed
    position: reading begins at the position's shard and row, whatever came before it), read
    by one task (`ShardRangesSource`, below) that streams the rows in order in small
    blocks, each row with its shard file (the `path` column) for error messages. Nothing is
    planned with other tasks, so opening a stream costs the same anywhere in a share of any
    size, and needs no free CPU (`reader_task_options`).

    One task, not one per shard: Ray Data's executor polls without pause once all of a
    dataset's read tasks have finished while the consumer has not taken their output yet (Ray
    2.60, `process_completed_tasks` waits only on running tasks). With a task per shard of
    small data that is at once, and it took half a core from every worker's training for the
    whole run (2.3x slower rounds of the demo); a single streaming task stays running, held
    back by the consumer, to the end of its ranges. One sequential reader per replica is far
    faster than training consumes tokens."""
    import ray.data

    if not ranges:
        return
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.execution_options.preserve_order = True
    # Blocks as the task yields them: at Ray's default (128 MiB) its output buffer would hold
    # the first rows back until 128 MiB of shards (8 of a 178M run's) had been read.
    context.target_max_block_size = BLOCK_BYTES
    dataset = ray.data.read_datasource(
        ShardRangesSource(ranges, rows_per_block=ROWS_PER_BLOCK), override_num_blocks=1,
        ray_remote_args=reader_task_options())
    with closing(iter(dataset.iter_batches(batch_size=rows_per_batch, batch_format="numpy",
                                           prefetch_batches=2))) as batches:
        try:
            for batch in batches:
                yield ShardBlocks(np.stack(batch["tokens"]), batch[PATH_COLUMN])
        except Exception as exc:  # noqa: BLE001 - re-raised unless the read task's DataError
            cause = data_error_in(exc)
            if cause is None:
                raise
            # Its one-line message (read_tokens), without the read task's traceback that Ray's
            # wrapper prints or the retry advice Ray Data appends on lines of its own.
            raise DataError(str(cause).split("\n", 1)[0]) from None


def data_error_in(exc: BaseException) -> DataError | None:
    """The DataError a Ray task raised, from the exception it reached this process as (Ray's
    RayTaskError subclasses it and keeps the original as `cause`; Ray Data may wrap that in
    turn), or None."""
    for _ in range(8):  # a few wrappers deep at most
        wrapped = getattr(exc, "cause", None)
        if isinstance(exc, DataError) and not isinstance(wrapped, BaseException):
            return exc
        inner = wrapped if isinstance(wrapped, BaseException) else exc.__cause__
        if inner is None:
            return None
        exc = inner
    return None


def reader_task_options() -> dict[str, Any]:
    """Ray options of a replica's read task: no CPU reservation, on this worker's node if it
    can. The task is one sequential parquet reader held back by the training it feeds; were
    it to wait for a free CPU it could wait forever on a cluster whose CPUs all hold training
    workers (as after an elastic restart on the nodes left), and its worker with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=True)}


class ShardRangesSource(Datasource):
    """The rows of `ranges`, in order, as one read task."""

    def __init__(self, ranges: Sequence[ShardRange], rows_per_block: int) -> None:
        super().__init__()
        self._ranges = list(ranges)
        self._rows_per_block = rows_per_block

    def estimate_inmemory_data_size(self) -> None:
        """Unknown here (block_len is in meta.json); one task reads it all anyway."""
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """One task: the ranges are read in order by a single sequential reader."""
        ranges, rows_per_block = self._ranges, self._rows_per_block
        metadata = BlockMetadata(num_rows=sum(part.rows for part in ranges),
                                 size_bytes=None,
                                 exec_stats=None,
                                 input_files=[str(part.path) for part in ranges])
        return [ReadTask(lambda: read_ranges(ranges, rows_per_block), metadata)]


def read_ranges(ranges: Sequence[ShardRange], rows_per_block: int) -> Iterator[pa.Table]:
    """Tables of at most `rows_per_block` rows of `ranges`, in order, with a `path` column."""
    for part in ranges:
        if part.rows == 0:
            continue
        table = read_tokens(part.path).slice(part.start, part.rows)
        for first in range(0, table.num_rows, rows_per_block):
            rows = table.slice(first, rows_per_block)
            yield rows.append_column(PATH_COLUMN, pa.array([str(part.path)] * rows.num_rows))
