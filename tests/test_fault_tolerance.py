"""scaling.fault_tolerance: replica on Ray Train: a lost worker costs its own round, not the
run's (docs/fault_tolerance.md)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from isoloco_ray import train
from isoloco_ray.config import load_config
from isoloco_ray.workers import plain_loop
from isoloco_ray.workers.quorum.replica_mode import EndWatch
from isoloco_ray.workers.state import checkpoint

pytest.importorskip("torchft")


def test_a_killed_worker_is_replaced_alone_and_the_run_is_the_plain_loop_over_its_quorums(
        ray_cluster, small_dataset, tmp_path, monkeypatch, capsys):
    """3 workers (2 replicas each); worker 1 is SIGKILLed mid-round 3. The other two sync round
    3 without it (after its heartbeat stops) and go on; Ray Train replaces worker 1 alone, the
    replacement is healed by its peers in a later sync and contributes again before the end.
    Metrics name every round's contributors once; the final model is the plain loop's over
    those contributors, bit for bit; the result comes from the file the workers leave (rank 0
    may be the lost one). (A resume from the run's stored checkpoints: test_quorum's
    threads-over-a-lighthouse test of the same functions.)"""
    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=6", "--scaling.replicas_per_worker=2",
            "--scaling.fault_tolerance=replica", "--scaling.cpus_per_worker=1",
            "--inner.steps=2", "--run.rounds=31", "--run.checkpoint_every=10",
            "--run.eval_every=31", "--run.eval_tokens=512", "--run.max_failures=2",
            "--run.keep_checkpoints=4", f"--run.storage_path={tmp_path}", "--run.name=ft"]
    # Each round lasts at least 0.6 s (0.15 per inner step): with the survivors' 1 s wait
    # for its heartbeat, the 28 rounds after the loss must outlast the replacement's start
    # (10-15 s on 2 busy cores).
    monkeypatch.setenv("ISOLOCO_RAY_KILL_AT", f"floor=0.15,2:2:{tmp_path / 'killed'}")
    monkeypatch.setenv("ISOLOCO_RAY_FT_QUORUM_TIMEOUT_S", "60")
    assert train.main(args) == 0
    assert (tmp_path / "killed").exists()
    assert "round    3/31 | loss" in capsys.readouterr().out.split("without workers [1]")[0]
    run_dir = tmp_path / "ft"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [m["round"] for m in metrics] == list(range(32))
    contributors = [m["contributors"] for m in metrics[1:]]
    assert contributors[:2] == [[0, 1, 2]] * 2 and contributors[2] == [0, 2]
    # Round 3's quorum holds worker 1's replacement too when it came up in time (healed there,
    # bringing no Δ): a matter of timing, not of the outcome.
    assert metrics[3]["missing_workers"] == [1] and metrics[3]["quorum"] in ([0, 2], [0, 1, 2])
    assert contributors[-1] == [0, 1, 2]  # the replacement took part again
    assert all(m["sync_attempts"] == 1 for m in metrics)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [m["replica_steps"] for m in metrics[1:]]
    expected = plain_loop.run_over_quorums(load_config(args), small_dataset, contributors, steps)
    assert summary["model_sha256"] == checkpoint.parameters_sha256(expected)
    assert summary["worker_losses"] == 1
    assert summary["rounds_with_missing_workers"] == sum(c != [0, 1, 2] for c in contributors)
    # The survivors waited for worker 1's heartbeats to lapse (1 s unless set).
    assert summary["max_quorum_wait_seconds"] >= metrics[3]["quorum_wait_seconds"] > 0.5
    assert (run_dir / "model" / "model.safetensors").is_file()


def test_the_injected_pause_stops_the_whole_process_once_and_lets_it_go_on(tmp_path):
    """benchmarks/soak.py's SIGSTOP fault (ray_entry.fault_once_hook): the process is stopped
    (state T: its heartbeat threads too) for the given seconds, then continues; the marker
    disarms it, so the same round and replica in a later worker pass; a SIGKILL fault kills."""
    import subprocess
    import sys

    marker, killed = tmp_path / "paused", tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from isoloco_ray.workers.ray_entry import fault_once_hook\n"
            f"hook = fault_once_hook('3:1:stop=1.5:{marker},4:0:{killed}')\n"
            "hook(3, 0); hook(2, 1)\n"  # not armed: nothing happens
            "print('ready', flush=True)\n"
            "started = time.monotonic(); hook(3, 1); paused = time.monotonic() - started\n"
            "started = time.monotonic(); hook(3, 1); again = time.monotonic() - started\n"
            "print(f'{paused:.2f} {again:.2f}', flush=True)\n"
            "hook(4, 0); print('not killed', flush=True)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        states = set()
        for _ in range(100):
            with open(f"/proc/{child.pid}/stat") as stat:
                states.add(stat.read().rsplit(")", 1)[1].split()[0])
            if "T" in states:
                break
            time.sleep(0.02)
        assert "T" in states  # stopped, not sleeping
        paused, again = map(float, child.stdout.readline().split())
        assert 1.4 <= paused < 10 and again < 0.5 and marker.exists()
        assert child.stdout.read() == "" and child.wait(30) == -9 and killed.exists()
    finally:
        child.kill()


def test_the_node_fault_names_its_node_whole_then_stops_like_a_pause(tmp_path, monkeypatch):
    """benchmarks/soak.py --nodes: a "node=SECONDS" fault writes the id of the worker's Ray node
    and its process id to MARKER.node (renamed into place whole: the soak removes that node as
    soon as it reads it), then stops the process as a stop= fault does, its SIGCONT SECONDS
    later in case the node is never removed; once."""
    import os
    import signal

    import ray

    from isoloco_ray.workers import ray_entry

    node_id = "ab" * 28

    class Context:
        def get_node_id(self) -> str:
            return node_id

    signals, helpers = [], []
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    monkeypatch.setattr(ray_entry.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    monkeypatch.setattr(ray_entry.subprocess, "Popen", lambda args, **_: helpers.append(args))
    marker = tmp_path / "lost"
    hooks = ray_entry.fault_once_hook(f"2:1:node=30:{marker}")
    assert hooks is not None
    hooks(2, 0)  # not armed
    assert not marker.exists()
    hooks(2, 1)
    hooks(2, 1)  # disarmed by its marker
    assert marker.exists()
    assert (tmp_path / "lost.node").read_text() == f"{node_id} {os.getpid()}"
    assert not (tmp_path / "lost.partial").exists()
    assert signals == [(os.getpid(), signal.SIGSTOP)]
    assert helpers == [["sh", "-c", f"sleep 30; kill -CONT {os.getpid()}"]]


def test_the_step_floor_pads_each_step_and_a_slowed_worker_takes_f_times_as_long(tmp_path):
    """benchmarks/soak.py's "floor=S" item: each inner step (`after_step`) lasts no less than S
    from the previous one's end (a replica's first, whose start the hook does not see: S more);
    work that takes longer is not padded. The "slow=F/SECONDS" fault, armed after a replica's
    steps, then makes each step F times as long, for SECONDS."""
    from isoloco_ray.workers.ray_entry import fault_once_hook

    hooks = fault_once_hook(f"floor=0.2,1:0:slow=3/30:{tmp_path / 'slowed'}")
    assert hooks is not None

    def timed(call) -> float:
        started = time.monotonic()
        call()
        return time.monotonic() - started

    first = timed(lambda: hooks.after_step(0, 0))
    padded = timed(lambda: hooks.after_step(0, 0))
    time.sleep(0.3)  # a step longer than the floor: nothing is added
    unpadded = timed(lambda: hooks.after_step(0, 0))
    assert 0.2 <= first < 0.3 and 0.2 <= padded < 0.3 and unpadded < 0.05
    hooks(1, 0)  # arms the slowdown
    assert (tmp_path / "slowed").exists()
    hooks.after_step(1, 1)  # the replica's first step
    slowed = timed(lambda: hooks.after_step(1, 1))  # 0.2 padded, then 2 x 0.2 more
    assert 0.6 <= slowed < 0.8


def test_a_checkpoint_folder_planted_as_a_link_during_a_run_stops_it_with_one_line(tmp_path):
    """Replica mode's checkpoint folders are made while the run is live: one planted as a link
    by then is never written through; the worker stops the run (TrainingStopped: one line in
    the run's result) instead of failing into Ray Train's restarts."""
    from isoloco_ray.workers.agreement import TrainingStopped
    from isoloco_ray.workers.quorum.replica_mode import QuorumReports

    files, elsewhere, run_dir = tmp_path / "files", tmp_path / "elsewhere", tmp_path / "run"
    for folder in (files, elsewhere, run_dir):
        folder.mkdir()
    (files / "replica_0000.pt").write_bytes(b"weights")
    linked = run_dir / "ftcheckpoint_000010"
    linked.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(TrainingStopped, match=f"^{linked} is a symbolic link"):
        QuorumReports(run_dir, None, keep=2)({"round": 10}, files, False)
    assert list(elsewhere.iterdir()) == []


def test_a_worker_that_outlives_the_runs_result_is_made_to_exit(tmp_path):
    """A worker that hangs alive would keep Ray Train from ending the run: once any worker has
    written the result, one still running after the grace exits; one that ends in time is
    left alone."""
    exited = threading.Event()
    with EndWatch(tmp_path, grace=0.2, poll=0.05, exit=exited.set):
        assert not exited.wait(0.5)  # no result yet: training goes on
        (tmp_path / "ft_end.json").write_text('{"status": "done"}')
        assert exited.wait(10)
    exited.clear()
    with EndWatch(tmp_path, grace=10, poll=0.05, exit=exited.set):
        time.sleep(0.2)  # the result is there; this worker ends within the grace
    assert not exited.is_set()


def test_the_summary_counts_worker_losses_once_per_loss_and_a_resume_does_not_double_them():
    """summary.json's replica-mode figures from metrics.jsonl: a worker missing after taking
    part is one loss (its healing round, also without it, is not another); rounds repeated
    by a resume count once, from their last record; the round-0 join is not a round."""
    from isoloco_ray.fault_tolerance import absence_note, quorum_summary
    from isoloco_ray.metrics import format_progress

    def line(round_index, contributors, wait=0.1, steps=None):
        return json.dumps({"round": round_index, "tokens": 96 * round_index,
                           "contributors": contributors,
                           "missing_workers": [w for w in range(3) if w not in contributors],
                           "quorum_wait_seconds": wait,
                           "replica_steps": steps or [4 * (w in contributors) for w in range(3)]})

    every = [0, 1, 2]
    lines = [line(0, []), line(1, every), line(2, [0, 2], wait=5.0), line(3, [0, 2]),
             line(4, every, steps=[4, 1, 4]), line(5, [0, 1]),
             line(4, every), line(5, [0, 1]),  # resumed: round 4 again, no partial replica
             line(6, every, steps=[4, 4, 3])]
    summary = quorum_summary(lines)
    assert summary == {"worker_losses": 2, "rounds_with_missing_workers": 3,
                       "rounds_missed_by_worker": [0, 2, 1], "rounds_with_partial_replicas": 1,
                       "max_quorum_wait_seconds": 5.0}
    # The run's last line names each worker that missed rounds, and the straggler's partial
    # rounds; none when all took part in full.
    assert absence_note({**summary, "rounds": 6}) == (
        "note: worker 1 missed 2 of 6 round(s), worker 2 missed 1 of 6 round(s) (lost, "
        "replaced or behind the others; worker_losses 2): see missing_workers in metrics.jsonl; "
        "1 of 6 round(s) merged a straggler's partial round (scaling.straggler_deadline): see "
        "replica_steps in metrics.jsonl")
    assert "partial replica 2 3 steps" in format_progress(json.loads(lines[-1]), 6)
    assert absence_note(quorum_summary([line(1, every), line(2, every)])) is None
    assert absence_note({"rounds": 6}) is None  # restart mode
    assert absence_note({"rounds": 6, "rounds_missed_by_worker": [0, 0], "group_restarts": 1}) \
        == ("note: every worker started again from a checkpoint 1 time(s) (several workers "
            "lost at once)")
    assert "without workers [1]" in format_progress(json.loads(lines[2]), 6)
    assert "without workers" not in format_progress(json.loads(lines[1]), 6)
    # A round in which every replica was cut short is partial too: against H (round_steps),
    # not against the round's most steps (which records of an earlier version fall back to).
    all_cut = {**json.loads(line(1, every, steps=[3, 3, 2])), "round_steps": 4}
    assert quorum_summary([json.dumps(all_cut)])["rounds_with_partial_replicas"] == 1
    assert "partial replica 0 3 steps, replica 1 3 steps, replica 2 2 steps" in format_progress(
        all_cut, 6)


def test_a_resume_records_the_checkpoints_round_once_if_the_stopped_run_never_did(
        tmp_path, small_dataset):
    """A run stopped after its writer put round 2 on the driver's queue but before the driver
    wrote it down (SIGTERM), with round 2's checkpoint stored: the checkpoint keeps the round's
    metrics line (Trainer.save), and the resumed run's writer reports it, once; a round that
    metrics.jsonl already holds is not reported again."""
    from isoloco_ray import run_files
    from isoloco_ray.data.stream import read_with_pyarrow
    from isoloco_ray.workers.loop import Trainer
    from isoloco_ray.workers.quorum.replica_mode import record_restored_round
    from isoloco_ray.workers.worker_env import WorkerEnv

    cfg = load_config(["--model.preset=tiny", "--inner.steps=1", "--run.rounds=2",
                       "--scaling.replicas_per_worker=4",
                       "--data.seq_len=64", "--data.batch_size=2", "--run.eval_tokens=128"])
    trainer = Trainer(cfg, small_dataset, WorkerEnv(0, 1, torch.device("cpu"),
                                                    read_with_pyarrow, lambda *_: None))
    trainer.round = 2
    saved = tmp_path / "ftcheckpoint_0002"
    saved.mkdir()
    record = {"round": 2, "tokens": 512, "loss": 8.5, "contributors": [1, 2],
              "missing_workers": [0]}
    trainer.save(saved, record)
    assert checkpoint.checkpoint_problems(saved) == []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / run_files.METRICS).write_text(
        json.dumps({"round": 0, "tokens": 0}) + "\n" + json.dumps({"round": 1, "tokens": 256})
        + "\nnot json\n")
    reported: list[tuple] = []
    record_restored_round(saved, run_dir, lambda *args: reported.append(args))
    assert reported == [(record, None, True)]
    with (run_dir / run_files.METRICS).open("a") as log:
        log.write(json.dumps(record) + "\n")
    record_restored_round(saved, run_dir, lambda *args: reported.append(args))
    assert len(reported) == 1


def test_a_worker_that_gets_no_quorum_stops_the_run_with_one_reason(tmp_path, small_dataset,
                                                                    monkeypatch):
    """A worker alone (1 of 3: a quorum needs 2) waits the quorum timeout, then leaves the
    run's result as an error naming itself, the quorum it needed and the setting that bounds
    the wait, and returns: Ray Train does not replace it to wait again (forever with
    run.max_failures -1)."""
    from torchft._torchft import LighthouseServer

    from isoloco_ray.data.format import Dataset
    from isoloco_ray.data.stream import read_with_pyarrow
    from isoloco_ray.workers.quorum.replica_mode import read_end, train_replica_worker
    from isoloco_ray.workers.worker_env import WorkerEnv

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE",
                       "http://127.0.0.1:" + server.address().rsplit(":", 1)[1])
    cfg = load_config(["--model.preset=tiny", "--inner.steps=1", "--run.rounds=2",
                       "--data.seq_len=64", "--data.batch_size=4", "--run.eval_tokens=128",
                       "--scaling.replicas=3", "--scaling.replicas_per_worker=1",
                       "--scaling.fault_tolerance=replica"])
    env = WorkerEnv(rank=1, world=3, device=torch.device("cpu"), read_rows=read_with_pyarrow,
                    report=lambda *_: None)
    started = time.monotonic()
    try:
        train_replica_worker(cfg, Dataset.open(small_dataset), tmp_path, env, None, True,
                             {"collective": 5.0, "quorum": 2.0})
    finally:
        server.shutdown()
    assert time.monotonic() - started < 30
    assert read_end(tmp_path) == {
        "error": "worker 1 saw no quorum of at least 2 of the 3 workers for 2 s "
                 "(ISOLOCO_RAY_FT_QUORUM_TIMEOUT_S); it was never in a quorum. Fewer workers "
                 "than that are alive and reach the lighthouse: start the run again (the same "
                 "command resumes from its newest checkpoint) when they can",
        "rounds": 0}


def test_checkpoint_retention_keeps_the_newest_complete_one_and_a_resume_drops_newer_ones(
        tmp_path):
    """A checkpoint needs no files of the replicas of workers missing from its round (round
    15: worker 2, named in the round's record), but does need those of every worker that took
    it: rounds 20 and 25 lack one (copies cut short). The writer keeps the newest `keep` and
    the newest complete one (round 15), so cut copies never leave nothing to resume from. A
    restart that resumes from round 15 deletes the newer ones: an earlier attempt's files must
    never mix with the rounds run again into what looks like a complete checkpoint."""
    from isoloco_ray import run_files
    from isoloco_ray.workers.quorum.replica_mode import (
        QuorumReports,
        drop_newer_checkpoints,
        stored_checkpoints,
    )

    def stored(round_index: int, replicas: range, missing_workers: list[int]) -> None:
        directory = tmp_path / run_files.FT_CHECKPOINT.format(round=round_index)
        directory.mkdir()
        (directory / checkpoint.STATE_FILE).write_text(json.dumps({
            "config": {"scaling": {"replicas": 3, "replicas_per_worker": 1},
                       "outer": {"strategy": "diloco"}},
            "record": {"round": round_index, "missing_workers": missing_workers}}))
        for name in [checkpoint.GLOBAL_FILE, *(checkpoint.replica_file(r) for r in replicas)]:
            (directory / name).write_bytes(b"")

    def rounds() -> list[str]:
        return sorted(path.name for path in tmp_path.iterdir())

    for round_index in (5, 10):
        stored(round_index, range(3), [])
    stored(15, range(2), [2])  # worker 2 missed the round: complete without replica 2
    for round_index in (20, 25):
        stored(round_index, range(2), [])  # worker 2 took the round: its file is needed
    QuorumReports(tmp_path, None, keep=2)._prune()
    assert rounds() == ["ftcheckpoint_000015", "ftcheckpoint_000020", "ftcheckpoint_000025"]
    drop_newer_checkpoints(tmp_path, str(tmp_path / "ftcheckpoint_000015"))
    assert rounds() == ["ftcheckpoint_000015"]
    assert len(stored_checkpoints(tmp_path)) == 1


def test_a_replica_run_says_once_that_torchfts_manager_listens_on_every_interface():
    """torchft (0.2.0, and the nightly of 2026-10-26) binds its manager server to [::] with no
    option for the address: the run says so at its start, in replica mode only."""
    from isoloco_ray.fault_tolerance import exposure_note

    note = exposure_note(load_config(["--scaling.fault_tolerance=replica"]))
    assert note is not None and "listens on every interface" in note and "Kill" in note
    assert exposure_note(load_config([])) is None
