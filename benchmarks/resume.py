"""Resume cost of a replica's data stream: seconds from opening a `ReplicaStream` at a saved
position to its first batch, at the start and near the end of a synthetic corpus (random token
ids written as prepared shards: 2,048-token blocks, 2,048 blocks a shard, one replica owning
them all), read with pyarrow and with Ray Data (a local Ray cluster, as a worker reads; a
warmed up by one read; each Ray Data figure is a single open).

    python benchmarks/resume.py                      # 100M tokens
    python benchmarks/resume.py --tokens 20e6 --repeat 1

"re-read from the start (before)" is what a resume cost before streams opened at their shard
and row: the epoch read from its start and the sequences before the position skipped.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from isoloco_ray.data.format import (DatasetMeta, ShardInfo, SplitInfo, shard_name,
                                     write_blocks)
from isoloco_ray.data.ray_reader import read_with_ray_data
from isoloco_ray.data.stream import (ReplicaStream, RowReader, StreamPosition, closing,
                                     read_with_pyarrow, replica_share)
from isoloco_ray.testing import exit_after

BLOCK_LEN = 2048
SHARD_BLOCKS = 2048
VOCAB = 32000
SEQ_LEN, BATCH = 2048, 8


def write_corpus(directory: Path, tokens: int) -> DatasetMeta:
    """Random token ids as a prepared dataset of `tokens` train tokens (rounded to blocks)."""
    rng = np.random.default_rng(0)
    blocks = tokens // BLOCK_LEN
    (directory / "train").mkdir(parents=True)
    shards: list[ShardInfo] = []
    for index, first in enumerate(range(0, blocks, SHARD_BLOCKS)):
        rows = min(SHARD_BLOCKS, blocks - first)
        shards.append(write_blocks(directory / "train" / shard_name(index),
                                   rng.integers(0, VOCAB, (rows, BLOCK_LEN), dtype=np.int32)))
    empty = SplitInfo(documents=0, tokens=0, dropped_tokens=0, blocks=0, shards=[])
    meta = DatasetMeta(source="synthetic random ids", tokenizer="none", vocab_size=VOCAB,
                       eos_id=0, block_len=BLOCK_LEN, seed=0,
                       splits={"train": SplitInfo(documents=blocks, tokens=blocks * BLOCK_LEN,
                                                  dropped_tokens=0, blocks=blocks,
                                                  shards=shards),
                               "valid": empty, "test": empty})
    meta.save(directory)
    return meta


def seconds_to_first_batch(open_stream: Callable[[], ReplicaStream], repeat: int) -> float:
    """The fastest of `repeat` opens of a stream and reads of its first batch."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        stream = open_stream()
        stream.next_batch()
        best = min(best, time.perf_counter() - started)
        stream.close()
    return best


def reread_seconds(data_dir: Path, sequences: int, read_rows: RowReader) -> float:
    """Reading the epoch from its start up to `sequences`: a resume before streams opened at
    their shard and row."""
    started = time.perf_counter()
    left = sequences
    with closing(read_rows(replica_share(data_dir, 0, 1).ranges)) as parts:
        for part in parts:
            left -= len(part.tokens) * (BLOCK_LEN // SEQ_LEN)
            if left <= 0:
                break
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=100e6)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-ray", action="store_true", help="pyarrow only")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the benchmark stops with its stacks (a hang)")
    args = p.parse_args()
    exit_after(args.timeout)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        started = time.perf_counter()
        meta = write_corpus(data_dir, int(args.tokens))
        share = replica_share(data_dir, 0, 1)
        print(f"corpus: {meta.split('train').tokens / 1e6:.0f}M tokens in "
              f"{len(share.ranges)} shards, written in {time.perf_counter() - started:.0f} s")
        sequences = share.rows * (BLOCK_LEN // SEQ_LEN)
        positions = {"near the end": sequences - 3 * BATCH - 5, "start": 0}
        readers = {"pyarrow": read_with_pyarrow}
        if not args.no_ray:
            from isoloco_ray.local_ray import start_local_cluster

            start_local_cluster(4)
            with closing(read_with_ray_data(share.ranges[-1:])) as parts:
                next(parts)  # Ray Data's first use in a process costs seconds: not a resume's
            readers["Ray Data"] = read_with_ray_data
        print("| reader | position | shard, row | seconds to first batch | re-read from the "
              "start (before) |")
        print("|---|---|---|--:|--:|")
        for name, read_rows in readers.items():
            for label, at in positions.items():
                def open_stream(at: int = at, read_rows=read_rows) -> ReplicaStream:
                    return ReplicaStream(share, read_rows, SEQ_LEN, BATCH,
                                         StreamPosition(0, at))
                shard, row = open_stream().where()
                # Once with Ray Data: a closed stream's read task may still be reading ahead,
                # which slows the next open (the position near the end, one shard, goes first).
                seconds = seconds_to_first_batch(
                    open_stream, 1 if read_rows is read_with_ray_data else args.repeat)
                reread = reread_seconds(data_dir, at, read_rows) if at else 0.0
                print(f"| {name} | {label} ({at:,} seqs) | {Path(shard).name}, {row} | "
                      f"{seconds:.3f} | {reread:.3f} |", flush=True)


if __name__ == "__main__":
    main()
