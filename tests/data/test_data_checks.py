"""Pre-training data checks (data/checks.py), each bad input with its message, the once-per-dataset
scan stamp, and the determinism and disjointness of the replica streams."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import check
from isoloco_ray.config import ConfigError
from isoloco_ray.data import checks
from isoloco_ray.data.format import DataError, DatasetMeta, read_blocks, split_files, write_blocks
from isoloco_ray.data.stream import ReplicaStream, read_with_pyarrow, replica_share

def test_good_data_passes_and_is_scanned_once(data: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    check(data)
    assert "verifying" in capsys.readouterr().err
    stamp = json.loads((data / checks.STAMP_FILE).read_text())
    assert stamp["max_token_id"] < DatasetMeta.load(data).vocab_size
    check(data)
    assert "verifying" not in capsys.readouterr().err  # the stamp was used
    monkeypatch.setenv(checks.VERIFY_ENV, "always")
    check(data)
    assert "verifying" in capsys.readouterr().err


def test_model_vocab_too_small(data: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.vocab_size \(100\) is smaller .*meta.json"):
        check(data, model_vocab_size=100)


def test_token_id_beyond_vocab(data: Path) -> None:
    meta = DatasetMeta.load(data)
    shard = split_files(data, "train")[0]
    blocks = read_blocks(shard)
    blocks[0, 0] = meta.vocab_size + 5
    info = write_blocks(shard, blocks)  # a consistent shard with a bad id...
    raw = json.loads((data / "meta.json").read_text())
    raw["splits"]["train"]["shards"][0]["sha256"] = info.sha256  # ...and a matching checksum
    (data / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=rf"token id {meta.vocab_size + 5} >= meta.json vocab_size"):
        check(data)


def test_a_share_smaller_than_a_batch_is_refused(data: Path) -> None:
    rows = sum(s.rows for s in DatasetMeta.load(data).split("train").shards)
    check(data, replicas=rows // 4, batch_size=4)  # fewer shards than replicas: row ranges
    with pytest.raises(ConfigError, match=r"data.batch_size \(4\) is more than the 3 sequences "
                                          r"of data.seq_len 64 that the smallest of"):
        check(data, replicas=rows // 3, batch_size=4)


def test_a_run_longer_than_the_data_reads_it_again(data: Path) -> None:
    from isoloco_ray.config import load_config

    meta = DatasetMeta.load(data)
    rows = sum(s.rows for s in meta.split("train").shards)
    cfg = load_config([f"--data.path={data}", "--data.seq_len=64", "--data.batch_size=4",
                       "--scaling.replicas=2", "--inner.steps=10", "--run.rounds=30"])
    checks.check_against_data(cfg, meta, data)  # 1,200 sequences per replica: several epochs
    smallest = min(sum(s.rows for s in meta.split("train").shards[r::2]) for r in range(2))
    assert checks.epochs(cfg, meta) == 1200 / smallest > 1 and rows >= 2 * smallest


def test_missing_split(data: Path) -> None:
    raw = json.loads((data / "meta.json").read_text())
    raw["splits"]["valid"] = {"documents": 0, "tokens": 0, "dropped_tokens": 0, "blocks": 0,
                              "shards": []}
    (data / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="has no 'valid' split"):
        check(data)


def test_corrupt_and_truncated_shards(data: Path) -> None:
    shard = split_files(data, "train")[1]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train/part-00001.parquet: sha256 .* corrupt or trunc"):
        check(data)
    shard.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(DataError, match=r"train/part-00001.parquet: not a readable parquet"):
        check(data)
    shard.unlink()
    with pytest.raises(DataError, match=r"train/part-00001.parquet: missing"):
        check(data)


def test_wrong_column_type(data: Path) -> None:
    shard = split_files(data, "valid")[0]
    rows = read_blocks(shard)
    pq.write_table(pa.table({"tokens": pa.array(rows.tolist(), type=pa.list_(pa.int64()))}), shard)
    with pytest.raises(DataError, match=r"valid/part-00000.parquet: schema .*list<"):
        check(data)


def test_replica_streams_deterministic_and_disjoint(small_dataset: Path) -> None:
    files = split_files(small_dataset, "train")
    replicas = 3

    def batches(r: int, n: int) -> np.ndarray:
        stream = ReplicaStream(replica_share(small_dataset, r, replicas), read_with_pyarrow,
                               64, 4)
        return np.stack([stream.next_batch().numpy() for _ in range(n)])

    seen = [batches(r, 3) for r in range(replicas)]
    for r in range(replicas):
        np.testing.assert_array_equal(seen[r], batches(r, 3))  # deterministic
    rows = [{tuple(x) for x in s.reshape(-1, 64).tolist()} for s in seen]
    assert not (rows[0] & rows[1]) and not (rows[1] & rows[2]) and not (rows[0] & rows[2])
    shards = [{str(part.path) for part in replica_share(small_dataset, r, replicas).ranges}
              for r in range(replicas)]
    assert set.union(*shards) == set(map(str, files)) and sum(map(len, shards)) == len(files)

