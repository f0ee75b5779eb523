"""Which checkpoint a (re)started worker group resumes from, opened as a local directory.

Ray Train gives its latest checkpoint; if that one is damaged the newest intact one before it
is used instead (`checkpoint.checkpoint_problems`), and with none intact the run stops with a
message naming the bad files. Checkpoints on a local or mounted `run.storage_path` are read in
place; on object storage (s3://...) each is copied to a local directory first, once per node
(Ray's `Checkpoint.as_directory`), and the messages name the stored files, not the copies.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray.workers import checkpoint


@dataclass
class ResumePoint:
    """Where a worker group starts: `directory` (local, valid inside `open_resume_point`) or
    None to start afresh; `warning` when damaged newer checkpoints were skipped; `error` when
    the run has checkpoints but none is intact (then `directory` is None)."""

    directory: Path | None = None
    name: str = ""  # the stored checkpoint, as messages name it
    warning: str | None = None
    error: str | None = None


def stored_name(saved: Any) -> str:
    """How messages name a Ray Train checkpoint: its path, with the scheme when remote."""
    kind = saved.filesystem.type_name
    return saved.path if kind == "local" else f"{kind}://{saved.path}"


def run_checkpoints(latest: Any) -> list[Any]:
    """The checkpoints a resume may use, newest first: `latest` (the one Ray Train's
    get_checkpoint gives) and the older Ray Train checkpoints beside it in the run directory.

    Ray Train's order is the order of its directory names (timestamps); it is used rather than
    the rounds in state.json, which a damaged checkpoint may not tell. Directories newer than
    `latest` were never registered by Ray Train (e.g. a copy cut short by a crash) and are left
    out."""
    import pyarrow.fs
    import ray.train

    filesystem, name = latest.filesystem, posixpath.basename(latest.path)
    entries = filesystem.get_file_info(pyarrow.fs.FileSelector(posixpath.dirname(latest.path)))
    older = sorted((entry.path for entry in entries
                    if entry.type == pyarrow.fs.FileType.Directory
                    and Path(entry.base_name).match(checkpoint.RAY_CHECKPOINT_GLOB)
                    and entry.base_name < name),
                   key=posixpath.basename, reverse=True)
    return [latest, *(ray.train.Checkpoint(path, filesystem=filesystem) for path in older)]


@contextlib.contextmanager
def open_resume_point(candidates: list[Any]) -> Iterator[ResumePoint]:
    """The first intact checkpoint of `candidates` (Ray Train checkpoints, newest first, e.g.
    `run_checkpoints`), as a local directory while the context lasts. Every worker checks
    every file of the same stored checkpoints, so all reach the same verdict."""
    skipped: list[checkpoint.Damaged] = []
    for saved in candidates:
        with saved.as_directory() as local:
            name = stored_name(saved)
            problems = [problem.replace(local, name)
                        for problem in checkpoint.checkpoint_problems(Path(local))]
            if problems:
                skipped.append((name, problems))
                continue
            warning = (checkpoint.fallback_warning(name, checkpoint.saved_round(Path(local)),
                                                   skipped) if skipped else None)
            yield ResumePoint(Path(local), name, warning)
            return
    yield ResumePoint(error=checkpoint.no_intact_message(skipped) if skipped else None)
