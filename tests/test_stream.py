"""Replica streams: disjoint, deterministic, layout-independent, epoch roll-over, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isoloco_ray.data.format import read_blocks, split_files
from isoloco_ray.data.stream import (ReplicaStream, StreamPosition, pyarrow_reader,
                                     replica_files)


def blocks_of(files):
    return np.concatenate([read_blocks(f) for f in files])


def test_replicas_own_disjoint_shards_covering_the_split(small_dataset):
    files = split_files(small_dataset, "train")
    owned = [replica_files(files, r, 4) for r in range(4)]
    assert sorted(f for part in owned for f in part) == sorted(files)
    assert all(set(a).isdisjoint(b) for i, a in enumerate(owned) for b in owned[i + 1:])
    assert owned[1] == files[1::4]


def test_too_few_shards_for_the_replicas_is_refused(small_dataset):
    files = split_files(small_dataset, "train")
    with pytest.raises(ValueError, match="each replica needs at least one shard"):
        replica_files(files, 0, len(files) + 1)


def test_stream_cuts_blocks_into_sequences_in_order(small_dataset):
    files = replica_files(split_files(small_dataset, "train"), 2, 4)
    expected = blocks_of(files).reshape(-1, 32)  # block_len 64 -> two sequences per block
    stream = ReplicaStream(pyarrow_reader(files), seq_len=32, batch_size=5)
    batches = [stream.next_batch() for _ in range(4)]
    assert all(b.dtype == torch.int64 and b.shape == (5, 32) for b in batches)
    np.testing.assert_array_equal(torch.cat(batches).numpy(), expected[:20])
    assert stream.position == StreamPosition(epoch=0, sequences=20)


def test_epoch_rolls_over_without_straddling(small_dataset):
    files = replica_files(split_files(small_dataset, "train"), 0, 4)
    sequences = blocks_of(files).reshape(-1, 64)
    batch = 7
    full_batches = len(sequences) // batch
    stream = ReplicaStream(pyarrow_reader(files), seq_len=64, batch_size=batch)
    for _ in range(full_batches):
        stream.next_batch()
    first_of_epoch_1 = stream.next_batch()
    np.testing.assert_array_equal(first_of_epoch_1.numpy(), sequences[:batch])
    assert stream.position == StreamPosition(epoch=1, sequences=batch)


def test_resumed_stream_continues_with_the_next_unseen_batch(small_dataset):
    files = replica_files(split_files(small_dataset, "train"), 1, 4)
    whole = ReplicaStream(pyarrow_reader(files), seq_len=64, batch_size=3)
    for _ in range(5):
        whole.next_batch()
    position = StreamPosition(whole.position.epoch, whole.position.sequences)
    resumed = ReplicaStream(pyarrow_reader(files), seq_len=64, batch_size=3, position=position)
    for _ in range(4):
        torch.testing.assert_close(resumed.next_batch(), whole.next_batch())
