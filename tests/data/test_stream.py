"""Replica streams: disjoint, deterministic, layout-independent, epoch roll-over, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isoloco_ray.data.format import read_blocks, share_of_rows, split_files
from isoloco_ray.data.ray_reader import read_with_ray_data
from isoloco_ray.data.stream import (ReplicaShare, ReplicaStream, ShardRange, StreamPosition,
                                     read_with_pyarrow, replica_share)


def blocks_of(ranges):
    return np.concatenate([read_blocks(part.path)[part.start:part.stop] for part in ranges])


def stream_of(share, seq_len, batch_size, position=None, read_rows=read_with_pyarrow):
    return ReplicaStream(share, read_rows, seq_len, batch_size, position)


def test_replicas_own_disjoint_shards_covering_the_split(small_dataset):
    files = split_files(small_dataset, "train")
    owned = [replica_share(small_dataset, r, 4).ranges for r in range(4)]
    assert all(part.whole for share in owned for part in share)
    assert sorted(part.path for share in owned for part in share) == sorted(files)
    assert [part.path for part in owned[1]] == files[1::4]
    assert all(part.rows == len(read_blocks(part.path)) for share in owned for part in share)


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
    shares = [ReplicaShare(tuple(ShardRange(shard, start, stop, len(whole))
                                 for _, start, stop in share_of_rows([len(whole)], r, 3)), 64)
              for r in range(3)]
    read = [stream_of(share, seq_len=64, batch_size=5).next_batch().numpy() for share in shares]
    for r, batch in enumerate(read):
        start = r * len(whole) // 3
        np.testing.assert_array_equal(batch, whole[start:start + 5])


def test_stream_cuts_blocks_into_sequences_in_order(small_dataset):
    share = replica_share(small_dataset, 2, 4)
    expected = blocks_of(share.ranges).reshape(-1, 32)  # block_len 64 -> two sequences a block
    stream = stream_of(share, seq_len=32, batch_size=5)
    batches = [stream.next_batch() for _ in range(4)]
    assert all(b.dtype == torch.int64 and b.shape == (5, 32) for b in batches)
    np.testing.assert_array_equal(torch.cat(batches).numpy(), expected[:20])
    assert stream.position == StreamPosition(epoch=0, sequences=20)


def test_epoch_rolls_over_without_straddling(small_dataset):
    share = replica_share(small_dataset, 0, 4)
    sequences = blocks_of(share.ranges).reshape(-1, 64)
    batch = 7
    full_batches = len(sequences) // batch
    stream = stream_of(share, seq_len=64, batch_size=batch)
    for _ in range(full_batches):
        stream.next_batch()
    first_of_epoch_1 = stream.next_batch()
    np.testing.assert_array_equal(first_of_epoch_1.numpy(), sequences[:batch])
    assert stream.position == StreamPosition(epoch=1, sequences=batch)


@pytest.mark.parametrize(("replica", "replicas", "seq_len", "batch"),
                         [(0, 4, 64, 7), (1, 2, 32, 5), (0, 40, 16, 3)])
def test_epochs_go_on_in_the_open_reader_as_a_fresh_read_of_each(small_dataset, monkeypatch,
                                                                 replica, replicas, seq_len,
                                                                 batch):
    """A stream reads epoch after epoch from one open reader (a new epoch starts no read), and
    gives what reading each epoch afresh gives: its sequences in order, batch after batch, the
    last sequences too few for a batch left out; once the open reader's epochs are used up it
    opens another."""
    from isoloco_ray.data import stream as stream_module

    share = replica_share(small_dataset, replica, replicas)
    per_open = 3
    monkeypatch.setattr(stream_module, "RANGES_PER_OPEN", per_open * len(share.ranges))
    epoch = blocks_of(share.ranges)[:, : 64 // seq_len * seq_len].reshape(-1, seq_len)
    per_epoch = len(epoch) // batch
    assert per_epoch >= 1
    reader = CountingReader()
    stream = stream_of(share, seq_len, batch, read_rows=reader)
    epochs = 2 * per_open + 1
    for e in range(epochs):
        for b in range(per_epoch):
            np.testing.assert_array_equal(stream.next_batch().numpy(),
                                          epoch[b * batch:(b + 1) * batch], err_msg=f"{e} {b}")
            assert stream.position == StreamPosition(e, (b + 1) * batch)
    # the first open reads the first epoch and per_open more; so does each after it
    assert len(reader.opened) == 2
    assert all(opened == list(share.ranges) * (per_open + 1) for opened in reader.opened)


@pytest.mark.parametrize("rows", [0, 1])
def test_a_share_too_small_for_a_batch_is_refused_by_name(small_dataset, rows):
    """A replica whose share holds no rows, or fewer sequences than one batch, fails with
    the reason at its first batch (more replicas than the corpus has rows)."""
    shard = split_files(small_dataset, "train")[0]
    share = ReplicaShare((ShardRange(shard, 0, rows, len(read_blocks(shard))),) if rows
                         else (), 64)
    with pytest.raises(ValueError, match="fewer sequences than one batch"):
        stream_of(share, seq_len=64, batch_size=2).next_batch()


@pytest.mark.parametrize(("seq_len", "batch"), [(64, 3), (32, 5), (16, 7)])
def test_resumed_stream_continues_with_the_next_unseen_batch(small_dataset, seq_len, batch):
    """At every position (mid-row, mid-shard, at a shard's end, in the next epoch) a stream
    opened there goes on exactly as the uninterrupted one."""
    share = replica_share(small_dataset, 1, 2)
    whole = stream_of(share, seq_len=seq_len, batch_size=batch)
    per_epoch = share.rows * (64 // seq_len) // batch
    for _ in range(per_epoch + 3):
        position = StreamPosition(whole.position.epoch, whole.position.sequences)
        resumed = stream_of(share, seq_len, batch, position=position)
        assert resumed.where() == whole.where()
        for _ in range(2):
            torch.testing.assert_close(resumed.next_batch(), whole.next_batch())


@pytest.mark.parametrize(("seq_len", "batch"), [(64, 4), (32, 5), (16, 7)])
def test_the_position_after_n_batches_is_where_reading_them_leaves_a_stream(small_dataset,
                                                                              seq_len, batch):
    """position_after is a function of the count alone (a replica that rejoins reads what it
    would have read), across epochs and their last, partly unread, sequences."""
    share = replica_share(small_dataset, 1, 2)
    stream = stream_of(share, seq_len=seq_len, batch_size=batch)
    per_epoch = share.rows * (64 // seq_len) // batch
    assert stream.position_after(0) == StreamPosition()
    for read in range(1, 2 * per_epoch + 3):
        stream.next_batch()
        assert stream.position_after(read) == stream.position, read


class CountingReader:
    """read_with_pyarrow, recording the ranges each open starts with."""

    def __init__(self):
        self.opened = []

    def __call__(self, ranges):
        self.opened.append(list(ranges))
        return read_with_pyarrow(ranges)


def test_resume_opens_the_reader_at_the_positions_shard_and_row(small_dataset):
    """Resuming reads nothing before the position: the reader is opened at the shard and
    row holding it (cost independent of the position)."""
    share = replica_share(small_dataset, 0, 1)
    assert len(share.ranges) >= 3
    first, second = share.ranges[0], share.ranges[1]
    sequences = (first.rows + 5) * 2 + 1  # seq_len 32: row 5 of the second shard, 2nd half
    reader = CountingReader()
    stream = stream_of(share, 32, 4, StreamPosition(0, sequences), read_rows=reader)
    assert stream.where() == (str(second.path), 5)
    batch = stream.next_batch().numpy()
    rest_of_epoch = [ShardRange(second.path, 5, second.stop, second.shard_rows),
                     *share.ranges[2:]]
    assert len(reader.opened) == 1
    assert reader.opened[0][:len(rest_of_epoch)] == rest_of_epoch
    np.testing.assert_array_equal(batch, blocks_of(share.ranges).reshape(-1, 32)[
        sequences:sequences + 4])


def test_share_after_skips_whole_and_partial_ranges():
    share = ReplicaShare((ShardRange("a", 2, 5, 5), ShardRange("b", 0, 4, 4),
                          ShardRange("c", 0, 3, 6)), 64)
    assert share.rows == 10
    assert share.after(0) == list(share.ranges)
    assert share.after(3) == [ShardRange("b", 0, 4, 4), ShardRange("c", 0, 3, 6)]
    assert share.after(8) == [ShardRange("c", 1, 3, 6)]
    assert share.after(10) == []


def test_ray_reader_reads_exactly_the_ranges_in_small_tables(small_dataset):
    """The read task's tables: the ranges' rows only, in order, each row with its file, at
    most rows_per_block rows each (what Ray Data then hands on)."""
    from isoloco_ray.data.ray_reader import read_ranges

    share = replica_share(small_dataset, 0, 3)
    ranges = share.after(share.rows // 2 + 3)
    tables = list(read_ranges(ranges, rows_per_block=5))
    assert max(t.num_rows for t in tables) == 5
    np.testing.assert_array_equal(
        np.concatenate([np.stack(t.column("tokens").to_numpy(zero_copy_only=False))
                        for t in tables]), blocks_of(ranges))
    assert [p for t in tables for p in t.column("path").to_pylist()] == \
        [str(part.path) for part in ranges for _ in range(part.rows)]


@pytest.mark.parametrize("more_replicas_than_shards", [False, True])
def test_ray_data_streams_read_each_replicas_share_like_pyarrow(ray_cluster, small_dataset,
                                                                more_replicas_than_shards):
    """What a replica reads through Ray Data is its share's rows in order, each with its file,
    as the Ray-free reader gives them, whole shards or row ranges of them, from the start or
    from a resumed position."""
    shards = len(split_files(small_dataset, "train"))
    replicas = 2 * shards + 1 if more_replicas_than_shards else 3
    for r in (0, replicas - 1):
        share = replica_share(small_dataset, r, replicas)
        assert all(part.whole for part in share.ranges) != more_replicas_than_shards
        for skip in (0, share.rows // 2 + 1):
            ranges = share.after(skip)
            ray_rows = list(read_with_ray_data(ranges, rows_per_batch=7))
            local = list(read_with_pyarrow(ranges))
            np.testing.assert_array_equal(np.concatenate([b.tokens for b in ray_rows]),
                                          np.concatenate([b.tokens for b in local]))
            assert [b.file_of(i) for b in ray_rows for i in range(len(b.tokens))] == \
                [b.file_of(i) for b in local for i in range(len(b.tokens))]
    share = replica_share(small_dataset, 1, replicas)
    expected = blocks_of(share.ranges).reshape(-1, 32)
    stream = stream_of(share, 32, 5, StreamPosition(0, 3), read_rows=read_with_ray_data)
    batches = min(4, (len(expected) - 3) // 5)  # within the first epoch
    np.testing.assert_array_equal(
        torch.cat([stream.next_batch() for _ in range(batches)]).numpy(),
        expected[3:3 + 5 * batches])


def test_a_worker_reads_meta_json_once_however_many_replicas_it_hosts(small_dataset,
                                                                      monkeypatch):
    """The Trainer opens the dataset once (format.Dataset) and hands it to every replica's
    stream and the evaluation set: one read of meta.json, one GET on object storage."""
    from isoloco_ray.config import load_config
    from isoloco_ray.data.format import DatasetMeta
    from isoloco_ray.workers.local import run_local

    load = DatasetMeta.load.__func__
    reads = []
    monkeypatch.setattr(DatasetMeta, "load",
                        classmethod(lambda cls, path: reads.append(path) or load(cls, path)))
    cfg = load_config(["--model.preset=tiny", "--scaling.replicas=4",
                       "--scaling.replicas_per_worker=4", "--inner.steps=1", "--run.rounds=1",
                       "--data.seq_len=64", "--data.batch_size=4", "--run.eval_tokens=512"])
    run_local(cfg, small_dataset)
    assert reads == [small_dataset]


def test_ray_datas_read_tasks_import_no_torch():
    """Ray Data starts a process per read task, which imports the reader's modules: torch there
    would cost every read task seconds of imports and hundreds of MB for nothing."""
    import subprocess
    import sys

    code = ("import sys, isoloco_ray.data.ray_reader\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"]
