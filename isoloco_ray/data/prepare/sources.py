"""Where documents come from: local text files, a Hugging Face dataset, or ready token arrays.

A *text source* is anything ``open_source`` understands, turned into a ``TextSource``: a name for
meta.json and a function that yields the documents, always in the same order (prepare relies on
that order to split deterministically and to resume). Kinds:

- a local file or folder (searched recursively, files sorted by path) of
  ``.txt`` (one UTF-8 document per file), ``.jsonl`` (one UTF-8 JSON object per line; the text
  field, default ``text``) or ``.parquet`` (the text column, default ``text``, of a string type,
  read a row group at a time so a large file never sits in memory). Text that is not UTF-8 is
  an error naming the file and line; a ``.txt`` file that looks binary (NUL bytes in its first
  8 KiB) is skipped with a warning on stderr;
- anything else is a Hugging Face dataset name, streamed with ``datasets.load_dataset(...,
  streaming=True)`` (the optional ``hf`` extra: ``pip install -e ".[hf]"``), e.g.
  ``mlfoundations/dclm-baseline-1.0-parquet``; ``NAME:CONFIG`` selects a config.

``npy_token_files`` lists the research code's ready token arrays (``{split}_NNNNNN.npy``, flat
uint16 streams) for ``prepare --from-npy``.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from isoloco_ray.data.format import SPLITS, DataError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
BINARY_SNIFF_BYTES = 8192  # a .txt file with a NUL byte in its first 8 KiB is taken as binary
_NPY_NAME = re.compile(r"^(train|valid|test)_(\d{6})\.npy$")


@dataclass(frozen=True)
class TextSource:
    """A re-iterable source of documents: ``documents()`` starts over from the first one. A local
    source also lists its ``files`` (read in that order, ``text_field`` of each record), so its
    documents can be read file by file: by Ray Data's read tasks, or from a file on resume."""

    name: str
    documents: Callable[[], Iterator[str]]
    files: tuple[Path, ...] = ()
    text_field: str = "text"

    @functools.cached_property
    def file_bytes(self) -> tuple[int, ...]:
        """The size of each of ``files``, read once (progress, read-task planning)."""
        return tuple(f.stat().st_size for f in self.files)

    def documents_from(self, file: int, skip: int) -> Iterator[tuple[int, str]]:
        """(file index, document) for every document from the ``skip``-th of file ``file`` on
        (the count runs on into later files); a source without files is one file, index 0."""
        if not self.files:
            return ((0, text) for text in itertools.islice(self.documents(), skip, None))
        indexed = ((index, text) for index in range(file, len(self.files))
                   for text in file_documents(self.files[index], self.text_field))
        return itertools.islice(indexed, skip, None)


def open_source(spec: str, text_field: str = "text", hf_split: str = "train") -> TextSource:
    """The source named by ``spec``: a local path if it exists, else a Hugging Face dataset."""
    path = Path(spec).expanduser()
    if path.exists():
        files = local_files(path)
        for f in files:
            if f.suffix == ".parquet":
                _parquet_text_column(f, text_field)  # a wrong column fails now, not mid-run
        return TextSource(f"local: {path.absolute()} ({len(files)} files, field {text_field!r})",
                          lambda: iter_local_documents(files, text_field), tuple(files),
                          text_field)
    if spec.startswith((".", "/", "~")) or spec.endswith(TEXT_SUFFIXES):
        raise DataError(f"--source {spec}: no such file or folder")
    name, _, config = spec.partition(":")
    return TextSource(f"huggingface: {spec} (split {hf_split}, field {text_field!r})",
                      lambda: iter_hf_documents(name, config or None, hf_split, text_field))


def local_files(path: Path) -> list[Path]:
    """The text files under ``path`` (itself if a file), sorted, so the order never varies.
    ``.txt`` files that look binary (``looks_binary``) are left out, each with a warning on
    stderr."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    for f in files:
        if f.suffix not in TEXT_SUFFIXES:
            raise DataError(f"{f}: unsupported file type; expected one of {TEXT_SUFFIXES}")
    binary = [f for f in files if f.suffix == ".txt" and looks_binary(f)]
    for f in binary:
        print(f"warning: {f}: skipped: looks like binary data (NUL bytes in its first "
              f"{BINARY_SNIFF_BYTES // 1024} KiB), not UTF-8 text", file=sys.stderr)
    files = [f for f in files if f not in binary]
    if not files:
        raise DataError(f"{path} holds no {', '.join(TEXT_SUFFIXES)} files")
    return files


def iter_local_documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    """Yield the documents of ``files`` in order; empty documents are skipped."""
    for f in files:
        yield from file_documents(f, text_field)


def file_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one local text file (.txt, .jsonl or .parquet), in order."""
    readers = {".txt": _iter_txt, ".jsonl": _iter_jsonl, ".parquet": _iter_parquet}
    for text in readers[path.suffix](path, text_field):
        if text:
            yield text


def looks_binary(path: Path) -> bool:
    """Whether ``path`` holds a NUL byte in its first ``BINARY_SNIFF_BYTES`` (text never does;
    UTF-16 text does, and is not supported either)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def decode_utf8(raw: bytes, path: Path, first_line: int = 1) -> str:
    """``raw`` (a file's bytes from line ``first_line`` on) as text, a UTF-8 BOM dropped;
    DataError naming the file, line and byte when it is not UTF-8."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        raise DataError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); convert the file to "
            "UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out of --source") from None


def normalize_newlines(text: str) -> str:
    """Windows (CRLF) and old Mac (CR) line ends as ``\\n``."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _iter_txt(path: Path, text_field: str) -> Iterator[str]:
    yield normalize_newlines(decode_utf8(path.read_bytes(), path))


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e})") from e
            yield _text_of(record, text_field, f"{path}:{number}")


def _parquet_text_column(path: Path, text_field: str) -> pq.ParquetFile:
    """Open a parquet source file; DataError unless it has a string column ``text_field``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {schema.names}); "
                        "choose it with --text-field")
    kind = schema.field(text_field).type
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    is_string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(values) or pa.types.is_large_string(values)
            or is_string_view(values) or pa.types.is_null(values)):
        raise DataError(f"{path}: column {text_field!r} has type {kind}, not text (string); "
                        "choose the text column with --text-field")
    return pf


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    pf = _parquet_text_column(path, text_field)
    for batch in pf.iter_batches(batch_size=4096, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield text or ""


def iter_hf_documents(name: str, config: str | None = None, split: str = "train",
                      text_field: str = "text") -> Iterator[str]:
    """Stream the documents of a Hugging Face dataset (never downloads it whole)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"--source {name} is not a local path, so it is read as a Hugging Face dataset, which "
            'needs the `datasets` package: pip install -e ".[hf]"') from None
    rows = datasets.load_dataset(name, config, split=split, streaming=True)
    for number, row in enumerate(rows):
        text = _text_of(row, text_field, f"{name} row {number}")
        if text:
            yield text


def _text_of(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = list(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no field {field!r} (has {keys}); choose it with --text-field")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not text")
    return text or ""


def npy_token_files(directory: str | os.PathLike[str]) -> dict[str, list[Path]]:
    """``{split: [files]}`` of a folder of ``{train,valid,test}_NNNNNN.npy`` token arrays,
    each split's files in number order; test may have none (an empty list), train and valid
    (which training evaluates on) may not."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"--from-npy {directory}: not a folder")
    found: dict[str, list[tuple[int, Path]]] = {s: [] for s in SPLITS}
    for p in directory.iterdir():
        m = _NPY_NAME.match(p.name)
        if m:
            found[m.group(1)].append((int(m.group(2)), p))
    for split in ("train", "valid"):
        if not found[split]:
            raise DataError(f"--from-npy {directory}: no {split}_NNNNNN.npy files; training "
                            f"needs a {split} split")
    return {s: [p for _, p in sorted(v)] for s, v in found.items()}
