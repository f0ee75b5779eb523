"""A Ray Data datasource of row ranges of train shards, read in order by one task.

Ray Data's own parquet readers plan a read with Ray tasks or actors of their own before it
starts (V1 samples files' footers in tasks of one CPU each; V2 starts a pool of 32 footer
reader actors), which a worker opening its replica's stream on a cluster whose CPUs all hold
training workers would wait for forever, and which cost seconds per open. The ranges here
carry their row counts (meta.json's), so nothing needs planning: one read task streams the
ranges' rows, shard after shard, in blocks of `rows_per_block` rows with each row's shard
file (the `path` column), and reads nothing outside them. Shards at a URI (s3://...) are
opened through pyarrow's filesystems inside the task (format.open_shard), on the node that
reads them, with its credentials.

Imported by workers only (it imports Ray).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from isoloco_ray.data.format import read_tokens
from isoloco_ray.data.stream import PATH_COLUMN, ShardRange


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
