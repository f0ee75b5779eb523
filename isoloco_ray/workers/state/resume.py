"""Which checkpoint a (re)started worker group resumes from, opened as a local directory.

Ray Train gives its latest checkpoint; if that one is damaged the newest intact one before it
is used instead (`checkpoint.checkpoint_problems`), and with none intact the run stops with a
message naming the bad files. Ray Train finds the latest through its record of the run's
checkpoints, which the driver repairs first if a crash left it unreadable (`repair_record`).

Checkpoints on a local or mounted `run.storage_path` are read in place; on object storage
(s3://...) each is copied to a local directory first, once per node (Ray's
`Checkpoint.as_directory`), and the messages name the stored files, not the copies.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray import strict_json
from isoloco_ray.own_files import replace_file
from isoloco_ray.workers.state import checkpoint

# Ray Train's record of a run's checkpoints, in the run directory, rewritten in place after
# each checkpoint.
RAY_RECORD = "checkpoint_manager_snapshot.json"


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


def repair_record(run_dir: Any) -> str | None:
    """Rebuild Ray Train's record of the checkpoints in `run_dir` (a path, local or remote)
    when it cannot be read back: a write that failed (a full disk) leaves it empty or cut
    short, a checkpoint deleted by hand leaves it naming one that is gone, and Ray Train then
    refuses to start the run at all. Returns a note saying what was done, or None (no record,
    or a good one).

    The rebuilt record lists every checkpoint directory of the run, oldest first (their names
    are timestamps), the newest as the latest; a damaged one among them is skipped at resume
    like any other (`open_resume_point`), and Ray Train deletes the oldest beyond
    run.keep_checkpoints as new ones come. The unreadable record is kept beside it as
    `<name>.damaged`. Written in Ray's own format (its pydantic model, pinned Ray version)."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    record = run_dir / RAY_RECORD
    if not record.exists():
        return None
    text = record.read_bytes()
    directories = sorted(path.name for path in run_dir.iterdir()
                         if Path(path.name).match(checkpoint.RAY_CHECKPOINT_GLOB)
                         and path.is_dir())
    try:
        state = _CheckpointManagerState.model_validate_json(text)
        missing = [result.checkpoint_dir_name for result in state.checkpoint_results
                   if result.checkpoint_dir_name not in directories]
        why = f"it names checkpoints that are gone ({', '.join(missing)})" if missing else None
    except Exception as exc:  # noqa: BLE001 - pydantic's or json's error: unreadable either way
        why = ("it is empty" if not text.strip() else
               f"it cannot be read ({type(exc).__name__})")
    if why is None:
        return None
    results = [_TrainingResultState(checkpoint_dir_name=name, metrics={}) for name in directories]
    rebuilt = _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(results))),
        latest_checkpoint_result=results[-1] if results else None,
        pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(results), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])
    backup = run_dir / f"{RAY_RECORD}.damaged"
    replace_file(backup, text)
    strict_json.write(record, json.loads(rebuilt.model_dump_json()))
    return (f"note: Ray Train's record of this run's checkpoints ({record}) was unusable: {why} "
            f"(e.g. a disk that filled up); rebuilt from the {len(results)} checkpoint "
            f"director{'y' if len(results) == 1 else 'ies'} in {run_dir}, the old one kept as "
            f"{backup.name}")
