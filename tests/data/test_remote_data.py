"""A prepared dataset at an s3:// URI (conftest's loopback S3 server) reads as its local copy:
meta.json, shard lists and the tokenizer, the replicas' streams (pyarrow and Ray Data), the
eval set, the training checks with their stamp, and the errors of a missing dataset."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import boto3
import numpy as np
import pytest

from helpers import DATA_OK
from isoloco_ray.config import ConfigError, load_config
from isoloco_ray.data import checks
from isoloco_ray.data.format import (STAMP_FILE, DataError, DatasetMeta, load_tokenizer,
                                     split_files, verify)
from isoloco_ray.data.ray_reader import read_with_ray_data
from isoloco_ray.data.stream import ReplicaStream, read_with_pyarrow, replica_share

@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory (where remote tokenizers are cached), private to the test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def relative(paths: list, root: str | Path) -> list[str]:
    """`paths` as strings relative to the dataset directory `root`."""
    return [str(p)[len(str(root)) + 1:] for p in paths]


def rows_of(ranges) -> np.ndarray:
    return np.concatenate([b.tokens for b in read_with_pyarrow(ranges)])


def test_meta_shards_and_tokenizer_read_in_place(s3_data, small_dataset, temp_dir):
    assert DatasetMeta.load(s3_data) == DatasetMeta.load(small_dataset)
    assert verify(s3_data) == DatasetMeta.load(small_dataset)  # checksums read through pyarrow
    for split in ("train", "valid", "test"):
        remote = split_files(s3_data, split)
        assert all(str(p).startswith(f"{s3_data}/{split}/") for p in remote)
        assert relative(remote, s3_data) == relative(split_files(small_dataset, split),
                                                     small_dataset)
    text = "To be, or not to be: that is the question."
    assert load_tokenizer(s3_data).encode(text) == load_tokenizer(small_dataset).encode(text)
    # Copied once, into the node's cache, and loaded from there again.
    copies = list((temp_dir / "isoloco_ray-tokenizers").iterdir())
    assert len(copies) == 1 and (copies[0] / "tokenizer.json").is_file()
    assert DatasetMeta.load(s3_data).tokenizer_location(s3_data) == str(copies[0])
    load_tokenizer(s3_data)
    assert list((temp_dir / "isoloco_ray-tokenizers").iterdir()) == copies


@pytest.mark.parametrize("replicas", [3, 17])  # whole shards; row ranges (more than shards)
def test_replica_shares_stream_the_same_blocks(s3_data, small_dataset, replicas):
    for r in (0, replicas - 1):
        remote, local = replica_share(s3_data, r, replicas), replica_share(small_dataset, r,
                                                                             replicas)
        assert [(p.start, p.stop) for p in remote.ranges] == \
            [(p.start, p.stop) for p in local.ranges]
        assert relative([p.path for p in remote.ranges], s3_data) == \
            relative([p.path for p in local.ranges], small_dataset)
        skip = remote.rows // 2 + 1
        np.testing.assert_array_equal(rows_of(remote.after(skip)), rows_of(local.after(skip)))
        streams = [ReplicaStream(share, read_with_pyarrow, 32, 3)
                   for share in (remote, local)]
        for _ in range(3):
            np.testing.assert_array_equal(*(s.next_batch().numpy() for s in streams))
        assert streams[0].where()[0].startswith(f"{s3_data}/train/")


def test_eval_set_equals_the_local_one(s3_data, small_dataset):
    from isoloco_ray.workers.evaluate import eval_sequences

    remote, local = (eval_sequences(split_files(d, "valid"), 64, 2048)
                     for d in (s3_data, small_dataset))
    assert len(remote) and remote.equal(local)


def test_ray_data_reads_a_share_from_s3(ray_cluster, s3_data, small_dataset):
    """Through Ray Data's read task (another process, with the environment's credentials):
    the local copy's rows, each named by its s3:// file."""
    share = replica_share(s3_data, 1, 3)
    ranges = share.after(5)
    read = list(read_with_ray_data(ranges, rows_per_batch=7))
    np.testing.assert_array_equal(np.concatenate([b.tokens for b in read]),
                                  rows_of(replica_share(small_dataset, 1, 3).after(5)))
    files = [f for b in read for f in b.files]
    assert files == [str(p.path) for p in ranges for _ in range(p.rows)]
    assert files[0].startswith(f"{s3_data}/train/")


def test_checks_scan_once_and_find_bad_shards(s3_data, s3_bucket, capsys):
    cfg = load_config([f"--data.path={s3_data}", "--data.seq_len=64", "--data.batch_size=4",
                       "--scaling.replicas=2"])
    data_dir = checks.validated_dataset(cfg).root
    assert str(data_dir) == s3_data
    assert "verifying" in capsys.readouterr().err
    # The stamp is written to the bucket, keyed by each shard's size and ETag...
    stamp = json.loads((data_dir / STAMP_FILE).read_text())
    head = boto3.client("s3").head_object(Bucket=s3_bucket, Key="data/train/part-00001.parquet")
    assert stamp["shards"]["train/part-00001.parquet"] == [head["ContentLength"], head["ETag"]]
    checks.validated_dataset(cfg)
    assert "verifying" not in capsys.readouterr().err  # ...and used by the next run
    shard = split_files(data_dir, "train")[1]

    def check() -> None:
        checks.check_training_data(data_dir, DatasetMeta.load(data_dir), **DATA_OK)

    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # same size, other contents: a new ETag, so scanned again
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"^{s3_data}/train/part-00001.parquet: sha256 .* "
                                        "corrupt or truncated"):
        check()
    shard.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(DataError, match=rf"^{s3_data}: 1 bad shard.*\n  "
                                        r"train/part-00001.parquet: not a readable parquet"):
        check()
    shard.unlink()
    with pytest.raises(DataError, match=r"train/part-00001.parquet: missing"):
        check()


def test_a_missing_dataset_is_named_as_a_local_one(s3_bucket, tmp_path):
    """No meta.json at the URI: the messages of a missing local directory, with the URI."""
    uri, local = f"s3://{s3_bucket}/nowhere", tmp_path / "nowhere"

    def messages(where: str | Path) -> list[str]:
        with pytest.raises(ConfigError) as config_error:
            checks.resolve_data_dir(load_config([f"--data.path={where}"]))
        with pytest.raises(DataError) as data_error:
            DatasetMeta.load(where)
        return [str(config_error.value).replace(str(where), "DIR"),
                str(data_error.value).replace(str(where), "DIR")]

    assert messages(uri) == messages(local)
    assert messages(uri)[0].startswith("data.path: DIR is not a prepared data directory")
