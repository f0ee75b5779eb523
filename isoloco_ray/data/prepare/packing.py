"""Token streams into a split's shards: cut into blocks of ``block_len`` (the tail that does not
fill a block is dropped and counted), written ``shard_blocks`` blocks to a parquet shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from isoloco_ray.data.format import ShardInfo, SplitInfo, shard_name, write_blocks
from isoloco_ray.data.prepare.encoding import encode_documents

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class BlockPacker:
    """Concatenates token streams and cuts them into rows of ``block_len``."""

    def __init__(self, block_len: int) -> None:
        if block_len <= 0:
            raise ValueError(f"block_len must be positive, got {block_len}")
        self.block_len = block_len
        self._pending = np.zeros(0, dtype=np.int32)

    def add(self, tokens: np.ndarray) -> np.ndarray:
        """Append tokens; return the blocks now complete, shape (k, block_len)."""
        buf = np.concatenate([self._pending, np.asarray(tokens, dtype=np.int32)])
        full = len(buf) // self.block_len * self.block_len
        self._pending = buf[full:]
        return buf[:full].reshape(-1, self.block_len)

    @property
    def dropped(self) -> int:
        """Tokens held back because they do not (yet) fill a block: the tail, at the end."""
        return len(self._pending)


class ShardWriter:
    """Writes blocks into ``split_dir/part-NNNNN.parquet`` files of ``shard_blocks`` rows."""

    def __init__(self, split_dir: Path, shard_blocks: int) -> None:
        if shard_blocks <= 0:
            raise ValueError(f"shard_blocks must be positive, got {shard_blocks}")
        split_dir.mkdir(parents=True, exist_ok=True)
        self.split_dir = split_dir
        self.shard_blocks = shard_blocks
        self.shards: list[ShardInfo] = []
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, blocks: np.ndarray) -> None:
        """Queue blocks; write every shard that is full."""
        if len(blocks):
            self._buffer.append(blocks)
            self._buffered += len(blocks)
        while self._buffered >= self.shard_blocks:
            self._write(self.shard_blocks)

    def pending(self) -> np.ndarray:
        """The queued blocks not yet written, flattened (part of a resumable state)."""
        if not self._buffer:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(self._buffer).reshape(-1)

    def close(self) -> list[ShardInfo]:
        """Write the last, partial shard (if any) and return all shards in order."""
        if self._buffered:
            self._write(self._buffered)
        return self.shards

    def _write(self, rows: int) -> None:
        data = np.concatenate(self._buffer)
        path = self.split_dir / shard_name(len(self.shards))
        self.shards.append(write_blocks(path, data[:rows]))
        rest = data[rows:]
        self._buffer = [rest] if len(rest) else []
        self._buffered = len(rest)


def write_split(out_dir: Path, name: str, documents: Sequence[str],
                tokenizer: PreTrainedTokenizerBase, eos_id: int, block_len: int,
                shard_blocks: int) -> SplitInfo:
    """Tokenize, pack and shard one split's documents (in the given order) under
    ``out_dir/name``; return its SplitInfo."""
    packer = BlockPacker(block_len)
    writer = ShardWriter(out_dir / name, shard_blocks)
    for stream in encode_documents(tokenizer, documents, eos_id):
        writer.add(packer.add(stream))
    shards = writer.close()
    blocks = sum(s.rows for s in shards)
    return SplitInfo(documents=len(documents), tokens=blocks * block_len,
                     dropped_tokens=packer.dropped, blocks=blocks, shards=shards)
