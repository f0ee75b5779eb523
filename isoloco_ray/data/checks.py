"""Checks of a prepared dataset against a training run, made before any Ray process starts.

Cheap checks run every time (meta.json and the parquet footers only): the model's vocabulary
against meta.json, seq_len against block_len, the train and valid splits present, a train shard
per replica, enough tokens for the run's budget, every shard present with its recorded rows and
the ``tokens: list<int32>`` column type.

The full scan reads every byte: each shard's sha256 against meta.json (corrupt or truncated
files) and its largest token id (ids >= the model's vocabulary would index past the embedding).
On a 10 B-token dataset that takes minutes, so it runs once per dataset: its result is stamped in
``DIR/.verified.json``, keyed by the sha256 of meta.json and every shard's size and version
(``stamp_key``: locally its modification time, ``mtime_ns``; on object storage, which has no
mtime_ns, the object's ETag as fsspec's info() gives it, or its last-modified time where the
store has no ETag), and later runs read the stamp while that key still matches: a dataset
prepared again (a new meta.json) or a shard replaced, rewritten or edited in place (a new size or
version) is scanned again. Set ``ISOLOCO_RAY_VERIFY_DATA`` to ``always`` to scan on every run,
or ``never`` to skip the scan (footers are still checked). A read-only dataset directory (or a
bucket these credentials may not write) is scanned on every run (the stamp cannot be written).
Token ids are also checked against the model's vocabulary as the training stream reads them
(stream.py), whatever the stamp says.

A dataset at a URI (``s3://bucket/prefix``) is checked in place: meta.json and the stamp through
fsspec, the shards (footers, the scan) through pyarrow's filesystems (format.py).
"""

from __future__ import annotations

import hashlib
import json
import stat
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from isoloco_ray import strict_json
from isoloco_ray.config import ConfigError, TrainConfig
from isoloco_ray.data.format import (
    META_FILE,
    SPLITS,
    STAMP_FILE,
    TOKEN_COLUMN,
    DataDir,
    DataError,
    Dataset,
    DatasetMeta,
    shard_problems,
    share_of_rows,
)
from isoloco_ray.storage import arrow_location, location

VERIFY_ENV = "ISOLOCO_RAY_VERIFY_DATA"


def check_training_data(data_dir: DataDir, meta: DatasetMeta, *, model_vocab_size: int | None,
                        seq_len: int, replicas: int, batch_size: int) -> None:
    """Every check of the module docstring; raises ConfigError (the config does not fit the
    data) or DataError (the data itself is broken), each naming the field or file."""
    vocab = model_vocab_size if model_vocab_size is not None else meta.vocab_size
    check_vocab(data_dir, meta, model_vocab_size)
    check_layout(data_dir, meta, seq_len, replicas, batch_size)
    check_shards(data_dir, meta)
    max_id = scanned_max_token_id(data_dir, meta)
    if max_id is not None and max_id >= vocab:
        what = "model.vocab_size" if model_vocab_size is not None else "meta.json vocab_size"
        raise DataError(f"{data_dir}: token id {max_id} >= {what} ({vocab}): the data was not "
                        f"made with this vocabulary; see {data_dir / STAMP_FILE}")


def check_vocab(data_dir: DataDir, meta: DatasetMeta, model_vocab_size: int | None) -> None:
    """The model's embedding must cover the tokenizer's vocabulary."""
    if model_vocab_size is not None and model_vocab_size < meta.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model_vocab_size}) is smaller than the data's tokenizer "
            f"vocabulary ({meta.vocab_size}, {data_dir / META_FILE}); leave it unset")


def check_layout(data_dir: DataDir, meta: DatasetMeta, seq_len: int, replicas: int,
                 batch_size: int) -> None:
    """Block length, the splits training reads, a batch in every replica's share."""
    if seq_len > meta.block_len:
        raise ConfigError(
            f"data.seq_len ({seq_len}) is longer than the data's blocks "
            f"({meta.block_len} tokens); lower data.seq_len or prepare longer blocks")
    for split in ("train", "valid"):
        if split not in meta.splits or not meta.splits[split].shards:
            raise ConfigError(f"data.path: {data_dir} has no '{split}' split")
    available = sequences_per_share(meta, seq_len, replicas)
    if available < batch_size:
        raise ConfigError(
            f"data.batch_size ({batch_size}) is more than the {available} sequences of "
            f"data.seq_len {seq_len} that the smallest of {replicas} replicas' shares of "
            f"{data_dir}'s train split holds; lower data.batch_size or scaling.replicas, or "
            "use more data")


def sequences_per_share(meta: DatasetMeta, seq_len: int, replicas: int) -> int:
    """Sequences of `seq_len` tokens in the smallest replica's share of the train split
    (format.share_of_rows): what every replica reads in one epoch."""
    rows = [s.rows for s in meta.splits["train"].shards]
    per_replica_blocks = min(
        sum((rows[index] if stop is None else stop) - start
            for index, start, stop in share_of_rows(rows, replica, replicas))
        for replica in range(replicas))
    return per_replica_blocks * (meta.block_len // seq_len)


def epochs(cfg: TrainConfig, meta: DatasetMeta) -> float:
    """How many times the run reads the smallest replica's share of the train split (more
    than 1: it starts over, in the same order, when a share is used up)."""
    sequences = cfg.run.rounds * cfg.inner.steps * cfg.data.batch_size
    return sequences / sequences_per_share(meta, cfg.data.seq_len, cfg.scaling.replicas)


def check_shards(data_dir: DataDir, meta: DatasetMeta) -> None:
    """Every shard present, with its recorded rows, the tokens: list<int32> column and
    meta.json's block_len ids per row (footers only: cheap on any dataset size)."""
    problems = [p for s in SPLITS for shard in meta.split(s).shards
                for p in shard_problems(data_dir / shard.file, shard, meta.block_len,
                                        checksums=False)]
    if problems:
        raise DataError(f"{data_dir}: {len(problems)} bad shard(s); prepare it again "
                        "(with --overwrite):\n  " + "\n  ".join(problems))


def scan_shards(data_dir: DataDir, meta: DatasetMeta) -> int:
    """Read every shard: check its sha256 and return the largest token id over all splits."""
    max_id = -1
    for s in SPLITS:
        for shard in meta.split(s).shards:
            path = data_dir / shard.file
            # Read once, for both the checksum and the ids: a remote shard crosses the network
            # once.
            contents = read_file(path)
            actual = hashlib.sha256(contents).hexdigest()
            if actual != shard.sha256:
                raise DataError(
                    f"{path}: sha256 {actual} != {shard.sha256} recorded in meta.json: the file "
                    "is corrupt or truncated; prepare the dataset again (with --overwrite)")
            column = pq.ParquetFile(pa.BufferReader(contents)).read(
                columns=[TOKEN_COLUMN]).column(TOKEN_COLUMN)
            if column.length():
                # The max of the flattened values: no Python loop over rows.
                largest = pc.max(pc.list_flatten(column)).as_py()
                if largest is not None:
                    max_id = max(max_id, int(largest))
    return max_id


def read_file(path: DataDir) -> pa.Buffer:
    """The bytes of a shard, local or at a URI (through pyarrow's filesystems)."""
    filesystem, where = arrow_location(path)
    try:
        with filesystem.open_input_stream(where, compression=None) as f:
            return f.read_buffer()
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}; prepare the dataset again "
                        "(with --overwrite)") from e


def stamp_key(data_dir: DataDir, meta: DatasetMeta) -> dict[str, Any]:
    """What a scan's result is valid for: meta.json's sha256 and each shard's size and version
    (``{"meta_sha256": ..., "shards": {file: [size, version]}}``, ``file_version``)."""
    shards: dict[str, list[int | str]] = {}
    for s in SPLITS:
        for shard in meta.split(s).shards:
            path = data_dir / shard.file
            try:
                shards[shard.file] = file_version(path)
            except OSError as e:
                raise DataError(f"{path}: {e.strerror or e}; prepare the dataset again "
                                "(with --overwrite)") from e
    meta_sha256 = hashlib.sha256((data_dir / META_FILE).read_bytes()).hexdigest()
    return {"meta_sha256": meta_sha256, "shards": shards}


def file_version(path: DataDir) -> list[int | str]:
    """[size, version] of a file, which changes when the file is replaced or rewritten: locally
    its mtime_ns; at a URI the object's ETag (on S3 the MD5 of an object uploaded in one part:
    a rewrite with other contents in the same second still changes it), else its last-modified
    time, from fsspec's info() (fetched anew, not from fsspec's listing cache)."""
    if isinstance(path, Path):
        st = path.stat()
        return [st.st_size, st.st_mtime_ns]
    info = path.fs.info(path.path, refresh=True)
    version = next((info[k] for k in ("ETag", "etag", "LastModified", "last_modified", "mtime",
                                      "updated") if info.get(k) is not None), "")
    return [int(info["size"]), str(version)]


def scanned_max_token_id(data_dir: DataDir, meta: DatasetMeta) -> int | None:
    """The largest token id, from the stamp when its key (``stamp_key``) still matches the
    files, else from a full scan (which writes the stamp); None when
    ``ISOLOCO_RAY_VERIFY_DATA=never``."""
    from isoloco_ray.env_settings import read_env

    mode = read_env().verify_data
    if mode == "never":
        return None
    # Taken before the scan: a shard changed while it is being read gets a stale key.
    key = stamp_key(data_dir, meta)
    stamp = data_dir / STAMP_FILE
    if mode == "once":
        try:
            recorded = json.loads(stamp.read_text())
            if {k: recorded.get(k) for k in key} == key:
                return int(recorded["max_token_id"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no stamp (or a stale/broken one): scan
    blocks = sum(meta.split(s).tokens for s in SPLITS)
    print(f"verifying {data_dir} ({blocks:,} tokens: checksums and token ids; once per "
          f"dataset, {VERIFY_ENV}=never skips it)", file=sys.stderr)
    max_id = scan_shards(data_dir, meta)
    try:
        strict_json.write(stamp, {**key, "max_token_id": max_id})
    except Exception:  # noqa: BLE001 - OSError locally; botocore/aiohttp errors remotely
        pass  # a read-only dataset: scanned again next time
    return max_id


# -- a run's config against its data ---------------------------------------------------------


def resolve_data_dir(cfg: TrainConfig) -> DataDir:
    """The prepared data directory: `data.path` (a local path, made absolute, or a URI), or,
    for the models it is meant for, the demo corpus's. Checking prepares nothing: the CLIs
    prepare the demo first when they need it (`prepare.documents.ensure_demo_for`)."""
    if cfg.data.path is None:
        from isoloco_ray.data.prepare.documents import check_demo_fallback, default_demo_dir

        check_demo_fallback(cfg)
        path = default_demo_dir().expanduser().absolute()
        if not has_meta(path):
            raise ConfigError(f"data.path: unset, and the demo corpus is not prepared in {path}; "
                              "run `python -m isoloco_ray.data.prepare --demo`, or set data.path")
        return path
    path = location(cfg.data.path, "data.path")
    if not has_meta(path):
        raise ConfigError(
            f"data.path: {path} is not a prepared data directory (no {META_FILE}); create one "
            "with `python -m isoloco_ray.data.prepare`, or leave data.path unset for the demo")
    return path


def has_meta(path: DataDir) -> bool:
    """Whether `path` holds a meta.json file; ConfigError when it cannot be told (no access to
    the bucket, a store that does not answer), rather than calling the dataset missing."""
    try:
        return stat.S_ISREG((path / META_FILE).stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except Exception as exc:  # noqa: BLE001 - OSError locally; botocore/aiohttp errors remotely
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ConfigError(f"data.path: cannot read {path / META_FILE} ({reason}); check the "
                          "path, and for a URI the credentials and endpoint (AWS_* variables "
                          "for S3)") from None


def check_against_data(cfg: TrainConfig, meta: DatasetMeta, data_dir: DataDir) -> None:
    """Everything about the config that depends on the data (check_training_data); raises
    ConfigError, or DataError for a broken dataset."""
    check_training_data(
        data_dir, meta, model_vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len,
        replicas=cfg.scaling.replicas, batch_size=cfg.data.batch_size)


def validated_dataset(cfg: TrainConfig) -> Dataset:
    """The dataset of `cfg`, opened and checked against the config; raises
    ConfigError/DataError."""
    dataset = Dataset.open(resolve_data_dir(cfg))
    check_against_data(cfg, dataset.meta, dataset.root)
    return dataset
