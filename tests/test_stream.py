"""Replica streams: disjoint, deterministic, layout-independent, epoch roll-over, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isoloco_ray.data.format import read_blocks, share_of_rows, split_files
from isoloco_ray.data.stream import (ReplicaStream, ShardRange, StreamPosition, dataset_name,
                                     pyarrow_reader, ray_data_reader, replica_data_config,
                                     replica_datasets, replica_ranges)


def blocks_of(ranges):
    return np.concatenate([read_blocks(part.path)[part.start:part.stop] for part in ranges])


def test_replicas_own_disjoint_shards_covering_the_split(small_dataset):
    files = split_files(small_dataset, "train")
    owned = [replica_ranges(small_dataset, r, 4) for r in range(4)]
    assert all(part.whole for share in owned for part in share)
    assert sorted(part.path for share in owned for part in share) == sorted(files)
    assert [part.path for part in owned[1]] == files[1::4]


@pytest.mark.parametrize(("rows", "replicas"), [([16], 2), ([16], 3), ([5, 9, 2], 4),
                                                ([5, 9, 2], 16), ([7], 7), ([3, 0, 4], 5)])
def test_fewer_shards_than_replicas_split_rows(rows, replicas):
    """Each replica gets a contiguous range of floor(N/R) or ceil(N/R) rows; together they
    read every row once, in order."""
    shares = [share_of_rows(rows, r, replicas) for r in range(replicas)]
    read = [(index, row) for share in shares for index, start, stop in share
            for row in range(start, stop)]
    assert read == [(index, row) for index, count in enumerate(rows) for row in range(count)]
    sizes = [sum(stop - start for _, start, stop in share) for share in shares]
    assert set(sizes) <= {sum(rows) // replicas, -(-sum(rows) // replicas)}


def test_enough_shards_are_shared_whole_as_before():
    assert share_of_rows([4, 4, 4, 4, 4], 1, 2) == [(1, 0, None), (3, 0, None)]


def test_one_shard_feeds_several_replicas(small_dataset):
    """A corpus with a single train shard trains 3 replicas: each streams its own rows."""
    shard = split_files(small_dataset, "train")[0]
    whole = read_blocks(shard)
    ranges = [[ShardRange(shard, start, stop) for _, start, stop in share_of_rows(
        [len(whole)], r, 3)] for r in range(3)]
    read = [ReplicaStream(pyarrow_reader(share), seq_len=64, batch_size=5).next_batch().numpy()
            for share in ranges]
    for r, batch in enumerate(read):
        start = r * len(whole) // 3
        np.testing.assert_array_equal(batch, whole[start:start + 5])


def test_stream_cuts_blocks_into_sequences_in_order(small_dataset):
    ranges = replica_ranges(small_dataset, 2, 4)
    expected = blocks_of(ranges).reshape(-1, 32)  # block_len 64 -> two sequences per block
    stream = ReplicaStream(pyarrow_reader(ranges), seq_len=32, batch_size=5)
    batches = [stream.next_batch() for _ in range(4)]
    assert all(b.dtype == torch.int64 and b.shape == (5, 32) for b in batches)
    np.testing.assert_array_equal(torch.cat(batches).numpy(), expected[:20])
    assert stream.position == StreamPosition(epoch=0, sequences=20)


def test_epoch_rolls_over_without_straddling(small_dataset):
    ranges = replica_ranges(small_dataset, 0, 4)
    sequences = blocks_of(ranges).reshape(-1, 64)
    batch = 7
    full_batches = len(sequences) // batch
    stream = ReplicaStream(pyarrow_reader(ranges), seq_len=64, batch_size=batch)
    for _ in range(full_batches):
        stream.next_batch()
    first_of_epoch_1 = stream.next_batch()
    np.testing.assert_array_equal(first_of_epoch_1.numpy(), sequences[:batch])
    assert stream.position == StreamPosition(epoch=1, sequences=batch)


def test_resumed_stream_continues_with_the_next_unseen_batch(small_dataset):
    ranges = replica_ranges(small_dataset, 1, 4)
    whole = ReplicaStream(pyarrow_reader(ranges), seq_len=64, batch_size=3)
    for _ in range(5):
        whole.next_batch()
    position = StreamPosition(whole.position.epoch, whole.position.sequences)
    resumed = ReplicaStream(pyarrow_reader(ranges), seq_len=64, batch_size=3, position=position)
    for _ in range(4):
        torch.testing.assert_close(resumed.next_batch(), whole.next_batch())


@pytest.mark.ray
@pytest.mark.parametrize("more_replicas_than_shards", [False, True])
def test_ray_data_streams_read_each_replicas_shards_like_pyarrow(ray_cluster, small_dataset,
                                                                more_replicas_than_shards):
    """What each replica reads through Ray Data (V1's reader, handed out by Train's DataConfig
    as the workers get it) is its share's rows in order, each with its file, as the Ray-free
    reader gives them, whole shards or row ranges of them; the driver's DataContext flag is
    restored afterwards."""
    import ray.data

    context = ray.data.DataContext.get_current()
    flag = context.use_datasource_v2
    shards = len(split_files(small_dataset, "train"))
    replicas = 2 * shards + 1 if more_replicas_than_shards else 3
    datasets = replica_datasets(small_dataset, replicas)
    assert context.use_datasource_v2 == flag
    (iterators,) = replica_data_config().configure(datasets, world_size=1, worker_handles=None,
                                                   worker_node_ids=None)
    for r in (0, 1, replicas - 1):
        ranges = replica_ranges(small_dataset, r, replicas)
        assert all(part.whole for part in ranges) != more_replicas_than_shards
        ray_rows = list(ray_data_reader(iterators[dataset_name(r)], ranges, rows_per_read=7)())
        local = list(pyarrow_reader(ranges)())
        np.testing.assert_array_equal(np.concatenate([b.tokens for b in ray_rows]),
                                      np.concatenate([b.tokens for b in local]))
        assert [b.file_of(i) for b in ray_rows for i in range(len(b.tokens))] == \
            [b.file_of(i) for b in local for i in range(len(b.tokens))]
        stream = ReplicaStream(ray_data_reader(iterators[dataset_name(r)], ranges), seq_len=32,
                               batch_size=5)
        expected = blocks_of(ranges).reshape(-1, 32)
        batches = min(6, len(expected) // 5)  # within the first epoch
        np.testing.assert_array_equal(
            torch.cat([stream.next_batch() for _ in range(batches)]).numpy(),
            expected[:5 * batches])
