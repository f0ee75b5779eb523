"""Replica streams: disjoint, deterministic, layout-independent, epoch roll-over, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isoloco_ray.data.format import read_blocks, split_files
from isoloco_ray.data.stream import (ReplicaStream, StreamPosition, dataset_name,
                                     pyarrow_reader, ray_data_reader, replica_data_config,
                                     replica_datasets, replica_files)


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


@pytest.mark.ray
def test_ray_data_streams_read_each_replicas_shards_like_pyarrow(ray_cluster, small_dataset):
    """What each replica reads through Ray Data (V1's reader, handed out by Train's DataConfig
    as the workers get it) is its shards' rows in order, each with its file, as the Ray-free
    reader gives them; the driver's DataContext flag is restored afterwards."""
    import ray.data

    context = ray.data.DataContext.get_current()
    flag = context.use_datasource_v2
    files = split_files(small_dataset, "train")
    datasets = replica_datasets(files, 3)
    assert context.use_datasource_v2 == flag
    (iterators,) = replica_data_config().configure(datasets, world_size=1, worker_handles=None,
                                                   worker_node_ids=None)
    for r in range(3):
        ray_rows = list(ray_data_reader(iterators[dataset_name(r)], rows_per_read=7)())
        local = list(pyarrow_reader(replica_files(files, r, 3))())
        np.testing.assert_array_equal(np.concatenate([b.tokens for b in ray_rows]),
                                      np.concatenate([b.tokens for b in local]))
        assert [b.file_of(i) for b in ray_rows for i in range(len(b.tokens))] == \
            [b.file_of(i) for b in local for i in range(len(b.tokens))]
        stream = ReplicaStream(ray_data_reader(iterators[dataset_name(r)]), seq_len=32,
                               batch_size=5)
        expected = blocks_of(replica_files(files, r, 3)).reshape(-1, 32)
        np.testing.assert_array_equal(
            torch.cat([stream.next_batch() for _ in range(6)]).numpy(), expected[:30])
