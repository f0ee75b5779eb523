"""Files the project writes into directories a user names, written so that whatever is planted
at their names is never followed (issue 47): each file is written whole into a temporary file
beside it, created exclusively and never through a link, then renamed over the name, so a
symbolic link planted there is replaced, not written through, and a reader never sees half a
file. And a file the project did not write is never replaced (`foreign_files`): what it wrote
into a directory is listed, with each file's sha256, in the directory's `OWN_LIST`.

On object storage (a remote UPath) there are no links and one upload is all or nothing: the
file is written directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

OWN_LIST = ".isoloco_ray_files.json"  # name -> sha256 of what the project wrote there


class LinkRefused(OSError):
    """A directory the project writes into is a symbolic link: never written through."""


def replace_file(path: Any, data: bytes | str) -> None:
    """Write `data` (text is UTF-8) to `path` atomically, replacing whatever is at the name,
    a symbolic link included, without following it (the module's docstring)."""
    raw = data.encode() if isinstance(data, str) else data
    if not isinstance(path, Path):
        path.write_bytes(raw)
        return
    _replace_with(path, lambda out: out.write(raw))


def copy_into(source: Path, directory: Path) -> None:
    """Copy the files under local directory `source` into local `directory` (created), each
    written as `replace_file` writes one, streamed: a link planted at a file's name is
    replaced, never written through. Raises LinkRefused, naming it, when `directory` or a
    folder under it is a symbolic link (its files would land wherever it points)."""
    for folder, _, names in os.walk(source):
        target = directory / Path(folder).relative_to(source)
        if target.is_symlink():
            raise LinkRefused(f"{target} is a symbolic link, not a directory this run wrote; "
                              "remove it, then run the same command again")
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            with open(Path(folder) / name, "rb") as data:
                _replace_with(target / name, lambda out, data=data: shutil.copyfileobj(data, out))


def _replace_with(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write` into a temporary file beside `path`, created exclusively and never through a
    link, then renamed over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def links_under(directory: Path, shown: int = 5) -> list[str]:
    """The symbolic links anywhere under local `directory` (relative paths, sorted, at most
    `shown`; none followed): the project never makes one, so each was planted."""
    found = []
    for folder, folders, names in os.walk(directory):
        for name in [*folders, *names]:
            if os.path.islink(os.path.join(folder, name)):
                found.append(os.path.relpath(os.path.join(folder, name), directory))
    return sorted(found)[:shown]


def foreign_files(directory: Any, names: Iterable[str]) -> list[str]:
    """Those of `names` in `directory` that the project did not write there (or that were
    changed since): anything at the name that is not the regular file it listed in OWN_LIST
    with that content. A name with nothing at it is not foreign."""
    own = _own_list(directory)
    foreign = []
    for name in names:
        path = directory / name
        if isinstance(path, Path):
            if not os.path.lexists(path):
                continue
            if path.is_symlink() or not path.is_file():
                foreign.append(name)
                continue
        elif not path.exists():
            continue
        if own.get(name) != hashlib.sha256(path.read_bytes()).hexdigest():
            foreign.append(name)
    return foreign


def write_own(directory: Any, files: Mapping[str, bytes | str]) -> None:
    """Write `files` (name -> content) into `directory` with `replace_file` and list them in
    its OWN_LIST; ask `foreign_files` first where files there must not be replaced."""
    own = _own_list(directory)
    for name, data in files.items():
        raw = data.encode() if isinstance(data, str) else data
        replace_file(directory / name, raw)
        own[name] = hashlib.sha256(raw).hexdigest()
    replace_file(directory / OWN_LIST, json.dumps(own, indent=1, sort_keys=True) + "\n")


def _own_list(directory: Any) -> dict[str, str]:
    """The directory's OWN_LIST ({} when it has none, or one that is not the project's)."""
    path = directory / OWN_LIST
    try:
        if isinstance(path, Path) and path.is_symlink():
            return {}
        listed = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(listed, dict):
        return {}
    return {str(k): v for k, v in listed.items() if isinstance(v, str)}


def append_line(path: Any, line: str) -> None:
    """Append `line` and a newline to `path` (created if missing), never through a symbolic
    link planted at the name (OSError: the caller says it could not record)."""
    if not isinstance(path, Path):
        with path.open("a") as out:
            out.write(line + "\n")
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "a") as out:
        out.write(line + "\n")
