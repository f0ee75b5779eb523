"""A run's directory: one live run of it at a time, the lock gone with its holder."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from isoloco_ray import run_files, storage, train
from isoloco_ray.config import ConfigError


def test_a_second_run_of_a_held_directory_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    with storage.hold_run(run_dir):
        lock = run_dir / run_files.LOCK
        assert lock.read_text().startswith(f"pid {os.getpid()} on {socket.gethostname()}, "
                                           "started ")
        with pytest.raises(ConfigError) as refused:
            storage.hold_run(run_dir)
        assert str(refused.value) == (
            f"run.name: {run_dir} is in use by another run ({lock.read_text().strip()}); wait "
            "for it to end or choose another run.name. Its lock goes with that process: if it "
            "hangs, stop it (kill the pid on that host) and run this again")
        assert lock.exists()  # the refused one took nothing away
    assert not run_dir.exists()  # made for the run, left empty: removed
    (run_dir / "kept").mkdir(parents=True)
    with storage.hold_run(run_dir):
        pass
    assert sorted(path.name for path in run_dir.iterdir()) == ["kept"]


def test_the_train_command_refuses_a_run_that_is_live_before_it_starts(
        small_dataset, tmp_path, capsys):
    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            f"--run.storage_path={tmp_path}", "--run.name=live"]
    with storage.hold_run(tmp_path / "live"):
        assert train.main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].startswith(
        f"error: run.name: {tmp_path / 'live'} is in use by another run (pid {os.getpid()} on ")
    assert "Traceback" not in captured.err
    assert "isoloco_ray:" not in captured.out  # the start line: printed once Ray is up


def test_a_killed_holder_leaves_no_lock_behind(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from isoloco_ray import storage\n"
         f"with storage.hold_run(storage.location({str(run_dir)!r})):\n"
         "    print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on "):
            storage.hold_run(run_dir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the lock with the process, at once
        try:
            with storage.hold_run(run_dir):
                break
        except ConfigError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert not (run_dir / run_files.LOCK).exists()


@pytest.mark.parametrize("planted", ["symlink", "directory", "fifo"])
def test_a_lock_name_taken_by_a_link_a_directory_or_a_fifo_is_refused_and_nothing_touched(
        tmp_path, planted):
    """A `.run.lock` planted as a symbolic link to another file is never followed (its target
    was truncated and written before), nor is a directory or a FIFO opened as a lock: one
    line naming it and the fix, and the planted thing and its target as they were."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / run_files.LOCK
    target = tmp_path / "precious.txt"
    target.write_text("the user's own words\n")
    if planted == "symlink":
        lock.symlink_to(target)
    elif planted == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(ConfigError) as refused:
        storage.hold_run(run_dir)
    kind = {"symlink": "is a symbolic link, which a lock file is never",
            "directory": "is a directory, where a lock file belongs",
            "fifo": "is not a regular file (a FIFO), where a lock file belongs"}[planted]
    assert str(refused.value) == f"run.name: {lock} {kind}: remove it and run again"
    assert target.read_text() == "the user's own words\n"
    assert lock.is_symlink() if planted == "symlink" else os.path.lexists(lock)
    assert (lock.is_dir() if planted == "directory"
            else planted != "fifo" or stat.S_ISFIFO(os.lstat(lock).st_mode))


def test_a_json_file_written_where_a_link_was_planted_replaces_the_link(tmp_path):
    """summary.json, config.json, grid.json, ... (strict_json.write, own_files.replace_file):
    a symbolic link planted at the name is replaced by the file, its target untouched."""
    from isoloco_ray import strict_json

    target = tmp_path / "precious.txt"
    target.write_text("the user's own words\n")
    summary = tmp_path / "summary.json"
    summary.symlink_to(target)
    strict_json.write(summary, {"rounds": 3})
    assert not summary.is_symlink() and summary.read_text() == '{"rounds": 3}\n'
    assert target.read_text() == "the user's own words\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["precious.txt", "summary.json"]


def test_metrics_lines_are_never_appended_through_a_planted_link(tmp_path):
    """metrics.jsonl is appended to a line per round (own_files.append_line): a symbolic link
    planted at its name fails the write (the driver warns that it cannot record the round)
    and its target is untouched; a regular file gets the line."""
    from isoloco_ray.own_files import append_line

    target = tmp_path / "precious.txt"
    target.write_text("the user's own words\n")
    metrics = tmp_path / run_files.METRICS
    metrics.symlink_to(target)
    with pytest.raises(OSError):
        append_line(metrics, '{"round": 1}')
    assert target.read_text() == "the user's own words\n"
    metrics.unlink()
    append_line(metrics, '{"round": 1}')
    append_line(metrics, '{"round": 2}')
    assert metrics.read_text() == '{"round": 1}\n{"round": 2}\n'


def test_a_run_directory_holding_a_planted_link_is_refused_before_anything_is_written(
        tmp_path):
    """A symbolic link anywhere in a run's directory (a checkpoint folder, Ray Train's or
    replica mode's, or a file a run rewrites) is planted: a run never makes one, and would
    write through it. The run is refused with one line naming it; nothing touched."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run_dir / "ftcheckpoint_000010").mkdir(parents=True)
    elsewhere.mkdir()
    (run_dir / "ftcheckpoint_000020").symlink_to(elsewhere, target_is_directory=True)
    (run_dir / "ftcheckpoint_000010" / "state.json").symlink_to(elsewhere / "state.json")
    with pytest.raises(ConfigError) as refused:
        storage.hold_run(run_dir)
    assert str(refused.value) == (
        f"run.name: {run_dir} holds symbolic links, which a run never makes and would write "
        "through (ftcheckpoint_000010/state.json, ftcheckpoint_000020): remove them, then run "
        "the same command again")
    assert list(elsewhere.iterdir()) == [] and not (run_dir / run_files.LOCK).exists()


def test_checkpoint_files_are_stored_over_planted_links_never_through_them(tmp_path):
    """storage.upload_directory into a local run directory (replica mode's checkpoints): a
    link planted at a file's name while the run is live is replaced by the file, its target
    untouched; a checkpoint folder that is a link is refused (own_files.LinkRefused), naming
    it, and nothing is written where it points."""
    from isoloco_ray.own_files import LinkRefused

    source = tmp_path / "source"
    (source / "nested").mkdir(parents=True)
    (source / "state.json").write_text("{}")
    (source / "nested" / "replica_0000.pt").write_bytes(b"x" * 100_000)
    target = tmp_path / "precious.txt"
    target.write_text("the user's own words\n")
    saved = tmp_path / "run" / "ftcheckpoint_000010"
    (saved / "nested").mkdir(parents=True)
    (saved / "state.json").symlink_to(target)
    (saved / "nested" / "replica_0000.pt").symlink_to(target)
    storage.upload_directory(source, saved)
    assert target.read_text() == "the user's own words\n"
    assert (saved / "state.json").read_text() == "{}" and not (saved / "state.json").is_symlink()
    assert (saved / "nested" / "replica_0000.pt").read_bytes() == b"x" * 100_000
    assert sorted(p.name for p in saved.iterdir()) == ["nested", "state.json"]  # no temp left
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "run" / "ftcheckpoint_000020"
    linked.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(LinkRefused, match=f"^{linked} is a symbolic link, not a directory"):
        storage.upload_directory(source, linked)
    assert list(elsewhere.iterdir()) == []
