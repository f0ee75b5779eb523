"""Where runs and prepared data live: a local directory or a filesystem URI (s3://, gs://, ...).

`location` turns a config value into a path object with pathlib's interface: a local path is
a plain `pathlib.Path` (universal_pathlib's local flavour subclasses it), a URI goes through
fsspec (s3fs for s3://, gcsfs for gs://, adlfs for abfs://). Bulk reads (parquet shards) and
Ray Train's checkpoints go through pyarrow's filesystems instead (`arrow_location`), as Ray
does. Both take credentials and the endpoint from the environment of every node
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL for an
S3-compatible server), so one set of variables configures them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from upath import UPath

from isoloco_ray import own_files, run_files
from isoloco_ray.config import ConfigError
from isoloco_ray.file_lock import LockHeld, LockRefused, exclusive

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# fsspec protocol -> the package that implements it, for the error when it is missing.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs",
             "az": "adlfs"}


def is_uri(spec: str | os.PathLike[str]) -> bool:
    """Whether `spec` names a filesystem URI (scheme://...) rather than a local path."""
    return bool(_URI.match(os.fspath(spec)))


def location(spec: str | os.PathLike[str] | UPath, field: str = "run.storage_path") -> UPath:
    """The path `spec` names: a URI as it is, a local path with ~ expanded, made absolute.
    Raises ConfigError naming `field` for a URI whose filesystem is not installed or known."""
    if isinstance(spec, UPath) and not isinstance(spec, Path):
        return spec
    text = os.fspath(spec)
    if not is_uri(text):
        return UPath(Path(text).expanduser().resolve())
    if text.startswith("file://"):
        return UPath(Path(text[len("file://"):]).expanduser().resolve())
    protocol = text.split("://", 1)[0].lower()
    try:
        return UPath(text)
    except (ImportError, ValueError) as exc:
        package = _PACKAGES.get(protocol)
        fix = (f"pip install {package}" if package else
               "use s3://, gs://, abfs:// or a local path")
        raise ConfigError(f"{field}: cannot open {text} ({exc}); {fix}") from None


def arrow_location(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """(pyarrow filesystem, path on it) of `path`, for pyarrow and Ray's readers."""
    import pyarrow.fs

    path = location(path)
    if isinstance(path, Path):
        return pyarrow.fs.LocalFileSystem(), str(path)
    return pyarrow.fs.FileSystem.from_uri(str(path))


def local_copy(directory: UPath, version: str | None = None, kind: str = "files") -> Path:
    """A local copy of the remote `directory`'s files (a tokenizer, a model), for readers
    that take only local paths. Made once per node under the temporary directory, in
    ``isoloco_ray-{kind}/<sha256 of the URI and version>`` (`version`: whatever changes when
    the files do; by default every file's name, size and ETag or modification time), and
    shared by the node's processes: copied into a temporary sibling and renamed into place,
    so concurrent copiers never see each other's part copies."""
    if version is None:
        listing = directory.fs.find(directory.path.rstrip("/"), detail=True)
        version = repr(sorted((name, info.get("size"),
                               str(info.get("ETag") or info.get("LastModified")))
                              for name, info in listing.items()))
    key = hashlib.sha256(f"{directory}\n{version}".encode()).hexdigest()
    target = Path(tempfile.gettempdir()) / f"isoloco_ray-{kind}" / key
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=target.parent))
    try:
        _copy_tree(directory, tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        # Another process renamed its copy into place first: use that one.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _copy_tree(source: UPath, dest: Path) -> None:
    """Copy the files under `source` into the existing local directory `dest`."""
    root = source.path.rstrip("/")
    # find() lists files at any depth; iterdir() would also list an S3 "directory marker" (an
    # empty object named like the directory, as many tools make them) as a child of itself.
    for name in source.fs.find(root):
        relative = name[len(root) + 1:]
        if not relative or relative.endswith("/"):
            continue  # a directory marker
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        source.fs.get_file(name, str(target))  # streamed: a model's weights are gigabytes


def check_durable(spec: str | os.PathLike[str], field: str = "run.storage_path") -> None:
    """ConfigError for a relative local output path inside a Ray job started with
    `ray job submit --working-dir`: the job runs in Ray's unpacked copy of that directory
    (under /tmp/ray/session_*/runtime_resources/), which Ray deletes, so what the run writes
    there would be lost without a word."""
    if isinstance(spec, UPath) and not isinstance(spec, Path):  # on object storage
        return
    text = os.fspath(spec)
    if is_uri(text) or Path(text).expanduser().is_absolute():
        return
    cwd = Path.cwd()
    if "runtime_resources" in cwd.parts:
        raise ConfigError(f"{field}: {text} is relative, and this is a Ray job running in Ray's "
                          f"temporary copy of its working directory ({cwd}), which Ray deletes; "
                          "give an absolute path on storage every node shares, or an s3:// URI")


def check_writable(storage: str | os.PathLike[str], field: str = "run.storage_path") -> UPath:
    """Create `storage` if needed and check a file can be written there (and removed), so an
    unwritable or unreachable place fails before any Ray process starts; a relative path in a
    Ray job's temporary working directory is refused (`check_durable`). Returns its path."""
    check_durable(storage, field)
    path = location(storage, field)
    probe = path / f".write-check-{uuid.uuid4().hex}"
    try:
        if isinstance(path, Path):  # object stores have no directories (and s3fs's mkdir
            path.mkdir(parents=True, exist_ok=True)  # would create a missing bucket)
        probe.write_bytes(b"")
        probe.unlink()
    except Exception as exc:  # noqa: BLE001 - OSError locally; botocore/aiohttp errors remotely
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ConfigError(f"{field}: cannot write to {path} ({reason}); choose a writable "
                          "directory (or a bucket these credentials may write)") from None
    return path


def check_could_write(storage: str | os.PathLike[str], field: str = "run.storage_path") -> None:
    """check_writable for a dry run, which writes nothing: the nearest existing place on the
    way to `storage` must be a directory this process may write into (object storage is
    checked only by the real run)."""
    check_durable(storage, field)
    path = location(storage, field)
    if not isinstance(path, Path):
        return
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    why = (f"{existing} is not a directory" if not existing.is_dir() else
           f"{existing}: permission denied" if not os.access(existing, os.W_OK | os.X_OK)
           else None)
    if why is not None:
        raise ConfigError(f"{field}: cannot write to {path} ({why}); choose a writable "
                          "directory (or a bucket these credentials may write)")


def run_directory(storage_path: str | os.PathLike[str], name: str) -> UPath:
    """A run's directory: `name` under `run.storage_path`."""
    return location(storage_path) / name


def upload_directory(local: Path, destination: str | os.PathLike[str]) -> None:
    """Copy the files of local directory `local` into `destination` (any filesystem); on a
    local one never through a symbolic link planted there (own_files.copy_into: LinkRefused
    for a linked directory)."""
    import pyarrow.fs

    if isinstance(destination, Path) or (not isinstance(destination, UPath)
                                         and not is_uri(os.fspath(destination))):
        # Not resolved: the last name may be a link, which copy_into refuses.
        own_files.copy_into(local, Path(os.fspath(destination)).expanduser().absolute())
        return
    filesystem, path = arrow_location(destination)
    filesystem.create_dir(path, recursive=True)
    pyarrow.fs.copy_files(str(local), path, source_filesystem=pyarrow.fs.LocalFileSystem(),
                          destination_filesystem=filesystem)


# Room a checkpoint leaves beside its own files: Ray Train's record of the run's checkpoints,
# rewritten after each one, and the filesystem's rounding of every file to whole blocks.
CHECKPOINT_HEADROOM = 1 << 20


def checkpoint_room(directory: str | os.PathLike[str] | UPath, needed: int) -> str | None:
    """Why a checkpoint of `needed` bytes will not fit under `directory`, or None (it fits,
    or `directory` is on object storage, which does not fill up). Checked before a checkpoint
    is written: a disk that fills up during one leaves half a checkpoint, and Ray Train's
    restarts would only fill it again."""
    path = location(directory)
    if not isinstance(path, Path):
        return None
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free >= needed + CHECKPOINT_HEADROOM:
        return None
    mib = 1 << 20
    return (f"{path} has {free / mib:,.1f} MiB free and the checkpoint needs "
            f"{(needed + CHECKPOINT_HEADROOM) / mib:,.1f} MiB: free space there (earlier "
            "checkpoints are kept) and run the same command again to resume from the latest")


def hold_run(run_dir: UPath, field: str = "run.name") -> contextlib.ExitStack:
    """Take the lock of `run_dir` (a `.run.lock` file in it, naming this process), creating the
    directory, for as long as a run of it is live: released when the returned stack closes
    (`with hold_run(run_dir): ...`), the directory removed again if the run left it empty.

    A second run of the same directory is refused here with a ConfigError naming the holder,
    instead of both writing the same rounds and checkpoints. The lock goes with its process,
    however that ends (file_lock.py). On object storage no lock is taken: there, one run per
    name at a time is the user's to keep (docs/running.md)."""
    stack = contextlib.ExitStack()
    if not isinstance(run_dir, Path):
        return stack
    existed = run_dir.is_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not existed:
        stack.callback(_remove_if_empty, run_dir)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    holder = f"pid {os.getpid()} on {socket.gethostname()}, started {started}"
    try:
        stack.enter_context(exclusive(run_dir / run_files.LOCK, wait=False, holder=holder))
    except LockRefused as refused:
        stack.close()
        raise ConfigError(f"{field}: {refused}") from None
    except LockHeld as held:
        stack.close()
        raise ConfigError(
            f"{field}: {run_dir} is in use by another run ({held.who}); wait for it to end or "
            "choose another run.name. Its lock goes with that process: if it hangs, stop it "
            "(kill the pid on that host) and run this again") from None
    planted = own_files.links_under(run_dir)
    if planted:
        stack.close()
        raise ConfigError(
            f"{field}: {run_dir} holds symbolic links, which a run never makes and would "
            f"write through ({', '.join(planted)}): remove them, then run the same command "
            "again")
    return stack


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):
        directory.rmdir()
