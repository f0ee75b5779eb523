"""Real Ray Train runs end to end: workers, Ray Data streams, summary, metrics, export, crashes
and resume, each equal to the Ray-free run of its layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from isoloco_ray import train
from isoloco_ray.config import load_config
from isoloco_ray.data.format import split_files
from isoloco_ray.workers.evaluate import eval_sequences, evaluate
from isoloco_ray.workers.model import Runtime


def test_a_replica_spread_over_ray_workers_trains_like_the_local_run_and_writes_its_files(
        ray_cluster, small_dataset, tmp_path, capsys):
    """2 replicas x 2 workers on Ray Train (replica and outer process groups inside Ray's gloo
    group, Ray Data streams read by both workers of a replica) end where the same layout run
    without Ray does, bit for bit, and write the summary, metrics and an exported model that
    evaluates to the run's final loss; the same command again is refused."""
    from isoloco_ray.workers.local import run_local

    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=2", "--scaling.replicas_per_worker=1",
            "--scaling.workers_per_replica=2", "--scaling.cpus_per_worker=0.5",
            "--outer.strategy=tsv", "--inner.steps=3", "--run.rounds=2", "--run.eval_every=1",
            "--run.eval_tokens=2048", f"--run.storage_path={tmp_path}", "--run.name=tiny"]
    assert train.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"summary: {tmp_path / 'tiny' / 'summary.json'}"
    assert f"isoloco_ray: tsv, R=2 on 4 workers x 1 thread, model tiny, 2 rounds x H=3, " \
        f"data {small_dataset}" in out
    assert sum(line.startswith("round ") for line in out) == 3  # initial eval + 2 rounds

    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    local_summary, _ = run_local(load_config(args), small_dataset)
    assert summary["model_sha256"] == local_summary["model_sha256"]
    assert summary["torch_threads"] == 1 and summary["ray_start_seconds"] >= 0
    cfg = load_config(args)
    assert summary["strategy"] == "tsv" and summary["replicas"] == 2
    assert summary["rounds"] == 2 and summary["tokens"] == 2 * cfg.tokens_per_round
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # The bytes Ray's gloo group carried are the local run's (test_outer_sync: their count).
    assert summary["outer_bytes_per_round"] == local_summary["outer_bytes_per_round"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").open()]
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert metrics[-1]["eval_loss"] == summary["final_eval_loss"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(summary["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir)("to be or not").input_ids
    assert sum(p.numel() for p in model.parameters()) == summary["num_parameters"]
    sequences = eval_sequences(split_files(small_dataset, "valid"), 64, 2048)
    runtime = Runtime(device=torch.device("cpu"), bf16=False, forward=model)
    loss = evaluate(runtime, sequences, rank=0, world=1, batch_size=4)
    assert loss == pytest.approx(summary["final_eval_loss"], abs=1e-4)

    # The same name again is refused rather than overwriting a finished run.
    assert train.main(args) == 2
    assert "already holds a finished run" in capsys.readouterr().err


def test_crashes_lose_nothing(ray_cluster, small_dataset, tmp_path, capsys, monkeypatch):
    """Workers SIGKILLed mid-round, twice, with run.max_failures=1: Ray restarts the workers
    from the latest checkpoint by itself after the first loss; the second fails the run, and
    running the same command again resumes it. It ends bit-identical to an uninterrupted run
    (the Ray-free one of the same layout, which Ray runs match bit for bit: the tests below)."""
    from isoloco_ray.workers.local import run_local

    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=2", "--scaling.replicas_per_worker=1",
            "--inner.steps=2", "--run.rounds=4", "--run.checkpoint_every=1",
            "--run.eval_every=4", "--run.eval_tokens=512", f"--run.storage_path={tmp_path}",
            "--run.name=crashes", "--run.max_failures=1"]
    whole = run_local(load_config(args), small_dataset)[0]["model_sha256"]

    # Replica 1 (rank 1) dies after its inner steps of round 2, then replica 0 (rank 0) after
    # its inner steps of round 3 (the spec's rounds are 0-based); each once.
    killed = [tmp_path / "killed-first", tmp_path / "killed-second"]
    monkeypatch.setenv("ISOLOCO_RAY_KILL_AT", f"1:1:{killed[0]},2:0:{killed[1]}")
    assert train.main(args) == 1
    assert all(marker.exists() for marker in killed)
    assert "run the same command again to resume" in capsys.readouterr().err
    run_dir = tmp_path / "crashes"
    assert not (run_dir / "summary.json").exists()
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").open()]
    assert rounds[-1] == 2  # rounds 2 (after the restart) and 3 (lost: the run failed)
    # A file stands where its model goes: refused before Ray starts (it could not be put in
    # place after the training), the file kept; the same command again once it is moved.
    (run_dir / "model").write_text("not the model")
    assert train.main(args) == 2
    assert f"error: {run_dir / 'model'} is a file, not the model directory this " \
        "run writes; move it away" in capsys.readouterr().err
    assert (run_dir / "model").read_text() == "not the model"
    assert not (run_dir / "summary.json").exists()
    (run_dir / "model").unlink()
    assert train.main(args) == 0
    assert "resuming" in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["model_sha256"] == whole
    assert (run_dir / "model" / "model.safetensors").is_file()
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").open()]
    assert rounds[-1] == 4 and set(rounds) == set(range(5))


def test_one_worker_takes_the_cores_and_trains_a_one_shard_corpus_like_the_local_run(
        ray_cluster, tmp_path, capsys):
    """A small corpus prepared with default shard sizes (one train shard) trains R = 3
    replicas, each on its own row range, for more than one epoch, on one worker with
    scaling.cpus_per_worker left unset: the worker gets the machine's cores (as far as the
    cluster's logical CPUs leave one for Ray Data), torch runs on that many threads in it, and
    the run ends where the Ray-free run on as many threads does, bit for bit (Ray Data's row
    ranges and epoch restarts read what pyarrow reads)."""
    import os

    from isoloco_ray.data.prepare.documents import prepare_dataset
    from isoloco_ray.testing import synthetic_documents
    from isoloco_ray.workers.local import run_local

    data = tmp_path / "one-shard"
    prepare_dataset(synthetic_documents(150), data, vocab_size=384, block_len=64,
                    valid_fraction=0.1, test_fraction=0.0, seed=0, source_name="synthetic")
    assert len(split_files(data, "train")) == 1
    args = ["--model.preset=tiny", f"--data.path={data}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=3", "--scaling.replicas_per_worker=3",
            "--inner.steps=8", "--run.rounds=3",
            "--run.eval_every=3", "--run.eval_tokens=512", f"--run.storage_path={tmp_path}",
            "--run.name=epochs"]
    assert train.main(args) == 0
    assert "note: the run reads each replica's share of the train data" in \
        capsys.readouterr().out
    threads = min(os.cpu_count() or 1, 3)  # the session's cluster: 4 logical CPUs
    config = json.loads((tmp_path / "epochs" / "config.json").read_text())
    assert config["scaling"]["cpus_per_worker"] == threads  # recorded resolved
    summary = json.loads((tmp_path / "epochs" / "summary.json").read_text())
    assert summary["torch_threads"] == threads
    local_summary, _ = run_local(load_config(args), data, threads_per_worker=threads)
    assert summary["model_sha256"] == local_summary["model_sha256"]
