"""Writing a dataset safely: work happens in a hidden sibling of the output directory, which is
renamed into place at the end (an interrupted run never leaves a directory that looks
complete); an existing output is replaced only when it provably is a prepared dataset; a lock
file makes concurrent preparers of one directory prepare it once.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from isoloco_ray.data.format import META_FILE, DataError, DatasetMeta, unexpected_entries
from isoloco_ray.file_lock import LockRefused, exclusive

# What a failed or interrupted preparation left behind, added to its exception as a note (main
# prints it after "error: ..." or "interrupted: "). prepare_corpus may keep resumable work
# instead (_keep_if_resumable).
NOTHING_KEPT = "nothing was kept: the same command starts over"
NOTHING_KEPT_NPY = "nothing was kept (--from-npy is not resumable): the same command starts over"


def check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """Allow writing ``out_dir`` only when it is missing, empty, or (with ``overwrite``) provably
    a prepared dataset (``_not_a_dataset``); raise DataError naming the reason otherwise.
    Anything that is not provably ours is never replaced, even with ``overwrite``."""
    if out_dir.is_symlink():
        raise DataError(f"{out_dir} is a symbolic link; pass the directory it points to "
                        f"({out_dir.resolve()}) as the output directory")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"{out_dir} exists and is not a directory; choose another output "
                        "directory")
    if not any(out_dir.iterdir()):
        return
    reason = _not_a_dataset(out_dir)
    if reason:
        raise DataError(f"{out_dir} is not a prepared dataset ({reason}), so it is never "
                        "replaced, not even with --overwrite; choose another output directory "
                        "(or empty this one yourself)")
    if not overwrite:
        raise DataError(f"{out_dir} already holds a prepared dataset; pass --overwrite "
                        "(overwrite=True) to replace it")


def _not_a_dataset(out_dir: Path, shown: int = 10) -> str | None:
    """Why the non-empty ``out_dir`` is not provably a dataset we prepared, or None when it is:
    a ``meta.json`` that validates as DatasetMeta, and only our files besides
    (``format.unexpected_entries``)."""
    reasons = []
    if not (out_dir / META_FILE).is_file():
        reasons.append(f"no {META_FILE}")
    else:
        try:
            DatasetMeta.load(out_dir)
        except DataError:
            reasons.append(f"its {META_FILE} is not a dataset meta.json")
    extra = unexpected_entries(out_dir)
    if extra:
        more = f" and {len(extra) - shown} more" if len(extra) > shown else ""
        reasons.append("it holds files a dataset never has: " + ", ".join(extra[:shown]) + more)
    return "; ".join(reasons) or None


def publish(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished staging directory to ``out_dir``, replacing an old dataset if allowed."""
    check_replaceable(out_dir, overwrite)
    if out_dir.exists() and any(out_dir.iterdir()):
        # Rename the old one aside first: out_dir is at every moment either old or new, complete.
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
        os.rename(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(staging, out_dir)


@contextmanager
def staged(out_dir: Path, overwrite: bool, nothing_kept: str) -> Iterator[Path]:
    """A fresh staging directory beside ``out_dir`` to build a dataset in (the caller holds
    ``locked(out_dir)``); published to ``out_dir`` when the block ends, or deleted when it
    raises, with ``nothing_kept`` added to the exception as a note. ``out_dir`` is checked
    first (``check_replaceable``), so nothing expensive runs for an output that is refused."""
    check_replaceable(out_dir, overwrite)
    remove_stale_staging(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        yield staging
        publish(staging, out_dir, overwrite)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        e.add_note(nothing_kept)
        raise


def remove_stale_staging(out_dir: Path) -> None:
    """Delete staging/old siblings left by a killed run (safe: we hold out_dir's lock)."""
    for pattern in (f".{out_dir.name}.staging-*", f".{out_dir.name}.old-*"):
        for path in out_dir.parent.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` (a ``.NAME.lock`` file next to it), waiting for
    it: concurrent processes (e.g. several Ray workers calling ensure_demo_data) prepare it
    once."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        try:
            stack.enter_context(exclusive(out_dir.with_name(f".{out_dir.name}.lock")))
        except LockRefused as refused:
            raise DataError(str(refused)) from None
        yield
