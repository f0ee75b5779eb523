"""Checkpoints: exact resume, what a checkpoint holds, hashes, and replicas that diverge."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_RUN, truncate

from isoloco_ray.config import load_config
from isoloco_ray.data.format import DatasetMeta, read_blocks, shard_name, write_blocks
from isoloco_ray.workers.local import StopAfterRound, run_local
from isoloco_ray.workers.outer.step import UPDATE_RESIDUAL, OuterSync
from isoloco_ray.workers.replica import Replica
from isoloco_ray.workers.state import checkpoint, resume
from isoloco_ray.workers.state.checkpoint_manager import Roles

RUN = TINY_RUN + ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--inner.steps=2",
                  "--run.rounds=4", "--run.checkpoint_every=2", "--run.eval_tokens=512",
                  "--run.eval_every=2"]


COMPRESSED = ["--outer.comm_dtype=int8", "--outer.error_feedback=true"]
# SparseLoCo's wire with owners (tsv): payloads and updates packed, the owners' update
# residuals part of the checkpoint with the replicas' own.
PACKED_OWNERS = ["--outer.strategy=tsv", "--outer.comm_dtype=int2", "--outer.topk=0.25",
                 "--outer.error_feedback=true"]


@pytest.mark.parametrize("flags", [
    ["--outer.strategy=diloco"], ["--outer.strategy=dare"], ["--outer.strategy=tsv"],
    ["--outer.strategy=adamw_ddp"],
    # Error feedback: each replica's residual is part of the checkpoint.
    ["--outer.strategy=tsv", *COMPRESSED],
    ["--outer.strategy=dare", "--outer.comm_dtype=float8", "--outer.error_feedback=true"],
    ["--outer.strategy=diloco", "--outer.topk=0.1", "--outer.error_feedback=true"],
    # SparseLoCo: each replica's decayed accumulator under 2-bit chunk top-k codes.
    ["--outer.strategy=sparseloco"], PACKED_OWNERS,
    # Muon inside (its momentum and AdamW's moments), for a replica and for adamw_ddp's one.
    ["--outer.strategy=diloco", "--inner.optimizer=muon"],
    ["--outer.strategy=adamw_ddp", "--inner.optimizer=muon"],
], ids=["diloco", "dare", "tsv", "adamw_ddp", "tsv-int8-feedback", "dare-float8-feedback",
        "diloco-topk-feedback", "sparseloco", "tsv-int2-owners", "diloco-muon",
        "adamw_ddp-muon"])
def test_interrupted_and_resumed_run_is_bit_identical(small_dataset, tmp_path, flags):
    cfg = load_config(RUN + flags)
    whole, whole_params = run_local(cfg, small_dataset)

    with pytest.raises(StopAfterRound):  # dies after round 3: round 3's work is lost
        run_local(cfg, small_dataset, checkpoints=tmp_path, stop_after=3)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["round_000002"]
    resumed, resumed_params = run_local(cfg, small_dataset,
                                        restore_from=tmp_path / "round_000002")

    for name in whole_params:
        assert torch.equal(resumed_params[name], whole_params[name]), name
    assert resumed["model_sha256"] == whole["model_sha256"]
    assert resumed["initial_eval_loss"] == whole["initial_eval_loss"]
    assert resumed["final_eval_loss"] == whole["final_eval_loss"]


# Each replica on G = 2 workers (4 gloo ranks): two outer groups, each stepping half the tensors.
SPREAD = ["--scaling.replicas_per_worker=1", "--scaling.workers_per_replica=2",
          "--data.micro_batch_size=2"]


@pytest.mark.parametrize("flags, outer_files", [
    # Every rank of an outer group merges: its rank 0 saves, one file per position.
    (["--outer.strategy=diloco"], [0, 1]),
    # Owners merge (int8 payloads): every rank saves its own, in a file of its own.
    (["--outer.strategy=tsv", "--outer.placement=sharded", *COMPRESSED], [0, 1, 2, 3]),
    # ... and with packed updates, each owner's update residuals in its file too.
    (PACKED_OWNERS, [0, 1, 2, 3]),
], ids=["diloco", "tsv-int8-feedback", "tsv-int2-owners"])
def test_a_run_with_replicas_spread_over_two_workers_resumes_bit_identical(
        small_dataset, tmp_path, flags, outer_files):
    """Each position's outer group saves the momentum of its share of the tensors, and the
    replica's first worker its residuals, shared by the others: the resumed run is the run
    that never stopped, bit for bit."""
    cfg = load_config(RUN + SPREAD + flags)
    whole, whole_params = run_local(cfg, small_dataset, checkpoints=tmp_path)
    directory = tmp_path / "round_000002"
    assert sorted(p.name for p in directory.iterdir()) == [
        "global.safetensors", *(checkpoint.outer_file(k) for k in outer_files),
        "replica_0000.pt", "replica_0001.pt", "state.json"]
    params, outer_state, _ = checkpoint.load_shared(directory)
    momentum = {name for name in outer_state["buffers"] if not name.startswith(UPDATE_RESIDUAL)}
    if cfg.outer.momentum:
        assert momentum == set(params)
    residuals = set(outer_state["buffers"]) - momentum
    assert residuals == ({UPDATE_RESIDUAL + name for name in params}
                         if cfg.outer.comm_dtype == "int2" else set())
    if cfg.outer.error_feedback:
        assert set(checkpoint.load_replica(directory, 1)["feedback"]) == set(params)
    resumed, resumed_params = run_local(cfg, small_dataset, restore_from=directory)
    for name in whole_params:
        assert torch.equal(resumed_params[name], whole_params[name]), name
    assert resumed["final_eval_loss"] == whole["final_eval_loss"]


def test_checkpoint_holds_every_replica_and_loads_without_pickle(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2"])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    directory = tmp_path / "round_000002"
    assert sorted(p.name for p in directory.iterdir()) == [
        "global.safetensors", "outer_0000.safetensors", "replica_0000.pt", "replica_0001.pt",
        "state.json"]
    params, outer_state, state = checkpoint.load_shared(directory)
    assert state["round"] == 2 and outer_state["step"] == 2
    assert set(outer_state["buffers"]) == set(params)  # diloco keeps a momentum buffer each
    replica = checkpoint.load_replica(directory, 1)  # torch.load(weights_only=True)
    # 16 sequences of 64 tokens: the 16 rows of the replica's first shard (1::2) are read.
    assert replica["stream"] == {"epoch": 0, "sequences": 2 * 2 * 4,
                                 "shard": "part-00003.parquet", "row": 0}
    assert replica["schedule"]["last_epoch"] == 4


def test_error_feedback_residuals_are_saved_with_their_replica(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2", "--outer.strategy=tsv", *COMPRESSED])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    params, _, _ = checkpoint.load_shared(tmp_path / "round_000002")
    for r in range(2):
        feedback = checkpoint.load_replica(tmp_path / "round_000002", r)["feedback"]
        assert set(feedback) == set(params)
        assert all(torch.isfinite(e).all() for e in feedback.values())
        assert sum(float(e.abs().sum()) for e in feedback.values()) > 0
    plain = load_config(RUN + ["--run.rounds=2"])
    run_local(plain, small_dataset, checkpoints=tmp_path / "plain")
    assert "feedback" not in checkpoint.load_replica(tmp_path / "plain" / "round_000002", 0)


def test_resume_with_other_settings_is_refused(small_dataset, saved_run):
    other = load_config(TWO_ROUNDS + ["--inner.lr=1e-2"])
    with pytest.raises(ValueError, match=r"different settings: inner.lr"):
        run_local(other, small_dataset, restore_from=saved_run / "round_000002")


def test_resume_on_resharded_data_is_refused(small_dataset, tmp_path):
    """The same tokens cut into other shards put a checkpoint's position elsewhere: the resume
    names the replica, the shard and row it stood at, and refuses."""
    cfg = load_config(RUN + ["--run.rounds=2"])
    run_local(cfg, small_dataset, checkpoints=tmp_path / "checkpoints")
    data = tmp_path / "data"
    shutil.copytree(small_dataset, data)
    meta = DatasetMeta.load(data)
    train = meta.split("train")
    blocks = np.concatenate([read_blocks(data / shard.file) for shard in train.shards])
    for shard in train.shards:
        (data / shard.file).unlink()
    shards = [write_blocks(data / "train" / shard_name(i), part)
              for i, part in enumerate(np.split(blocks, range(10, len(blocks), 10)))]
    splits = {**meta.splits, "train": train.model_copy(update={"shards": shards})}
    meta.model_copy(update={"splits": splits}).save(data)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"replica 0's checkpoint stands at row 0 of train shard "
                             r"part-00002.parquet, but the data's shards now put its position "
                             r"\(16 sequences into epoch 0\) at row 6 of part-00002.parquet: "
                             r"the data changed"):
        run_local(cfg, data, restore_from=tmp_path / "checkpoints" / "round_000002")


def test_incomplete_checkpoint_is_reported(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2"])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    (tmp_path / "round_000002" / "replica_0001.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="replica_0001.pt: missing"):
        run_local(cfg, small_dataset, restore_from=tmp_path / "round_000002")


def test_parameters_hash_is_order_independent_and_sensitive():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    b = {"b": torch.ones(3), "w": torch.arange(6.0).reshape(2, 3)}
    assert checkpoint.parameters_sha256(a) == checkpoint.parameters_sha256(b)
    b["w"][0, 0] = 1e-30
    assert checkpoint.parameters_sha256(a) != checkpoint.parameters_sha256(b)
    reshaped = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.ones(3)}
    assert checkpoint.parameters_sha256(a) != checkpoint.parameters_sha256(reshaped)


def test_parameters_checksum_sees_every_bit_and_position():
    """The on-device fingerprint: equal for equal bits (any name order, any memory layout),
    different after one ulp of one value, a swap of two values (across rows, within a row, in
    a 1-D tensor), a sign flip of a zero, a reshape."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 9, generator=g)
    params = {"w": w, "b": torch.zeros(4), "e": torch.randn(23, generator=g)}
    base = checkpoint.parameters_checksum(params)
    assert checkpoint.parameters_checksum(
        {"e": params["e"].clone(), "b": torch.zeros(4), "w": w.T.contiguous().T}) == base
    def swap(t: torch.Tensor, i: int, j: int) -> None:
        flat = t.view(-1)
        flat[[i, j]] = flat[[j, i]]

    def one_ulp_up(t: torch.Tensor, i: int) -> None:
        flat = t.view(-1)
        flat[i] = torch.nextafter(flat[i], torch.tensor(math.inf))

    changed = [("w", lambda t: one_ulp_up(t, 17)), ("w", lambda t: swap(t, 3, 40)),
               ("w", lambda t: swap(t, 3, 5)), ("e", lambda t: swap(t, 0, 22)),
               ("b", lambda t: t.__setitem__(2, -0.0))]
    for name, change in changed:
        other = {key: value.clone() for key, value in params.items()}
        change(other[name])
        assert not torch.equal(other[name].view(torch.int32), params[name].view(torch.int32))
        assert checkpoint.parameters_checksum(other) != base, name
    assert checkpoint.parameters_checksum({**params, "w": w.reshape(9, 7)}) != base
    assert checkpoint.parameters_checksum({**params, "w": w.double()}) == base  # float32 bits


@pytest.mark.parametrize("strategy", ["diloco", "tsv"])
def test_a_nan_replica_is_left_out_of_the_merge(strategy):
    cfg = load_config(["--scaling.replicas=3", "--scaling.replicas_per_worker=3",
                       f"--outer.strategy={strategy}"])
    deltas = {r: {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(r)),
                  "b": torch.full((3,), float(r))} for r in range(3)}
    poisoned = {**deltas, 1: {"w": deltas[1]["w"].clone(), "b": deltas[1]["b"]}}
    poisoned[1]["w"][2, 1] = math.nan
    clean = {0: deltas[0], 2: deltas[2]}

    expected = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    reference = OuterSync(cfg.outer.model_copy(), replicas=2, seed=0)
    reference.step(expected, {0: clean[0], 1: clean[2]}, round_index=0)

    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    stats = OuterSync(cfg.outer, replicas=3, seed=0).step(params, poisoned, round_index=0)
    assert stats.dropped == [1] and not stats.skipped
    torch.testing.assert_close(params["w"], expected["w"])
    torch.testing.assert_close(params["b"], expected["b"])


def test_all_replicas_bad_skips_the_round():
    cfg = load_config([])
    sync = OuterSync(cfg.outer, replicas=2, seed=0)
    params = {"w": torch.ones(2, 2)}
    stats = sync.step(params, {0: {"w": torch.ones(2, 2)}, 1: {"w": torch.ones(2, 2)}},
                      round_index=0, diverged=[0, 1])
    assert stats.skipped and stats.dropped == [0, 1]
    assert torch.equal(params["w"], torch.ones(2, 2)) and sync.optimizer.steps == 0


def poison_replicas(monkeypatch, bad: set[int]):
    """Make the given replicas' inner steps end in NaN parameters and a NaN loss."""
    original = Replica.run_inner_steps

    def run_inner_steps(self, *args, **kwargs):
        losses = original(self, *args, **kwargs)
        if self.index in bad:
            with torch.no_grad():
                for p in self.params.values():
                    p.fill_(math.nan)
            self.losses_finite = False
            losses = [torch.full_like(loss, math.nan) for loss in losses]
        return losses

    monkeypatch.setattr(Replica, "run_inner_steps", run_inner_steps)


def test_training_goes_on_without_a_diverged_replica(small_dataset, monkeypatch):
    poison_replicas(monkeypatch, {1})
    reports = []
    summary, params = run_local(load_config(RUN), small_dataset, reports=reports)
    assert "error" not in summary
    assert all(torch.isfinite(p).all() for p in params.values())
    assert [m["dropped_replicas"] for m in reports if m["round"] > 0] == [[1]] * 4
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_run_stops_after_max_bad_rounds_with_last_good_checkpoint(small_dataset, tmp_path,
                                                                  monkeypatch):
    cfg = load_config(RUN + ["--run.max_bad_rounds=2", "--run.checkpoint_every=1"])
    poison_replicas(monkeypatch, {0, 1})
    summary, params = run_local(cfg, small_dataset, checkpoints=tmp_path)
    assert summary["rounds"] == 2
    assert "every replica diverged" in summary["error"]
    assert "2 consecutive rounds" in summary["error"]
    # Round 1 was skipped and checkpointed unchanged; round 2 stopped the run before saving.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000001"]
    saved, _, _ = checkpoint.load_shared(tmp_path / "round_000001")
    for name, value in saved.items():  # the initial parameters: skipped rounds change nothing
        assert torch.equal(value, params[name]) and torch.isfinite(value).all()


# -- damaged checkpoints: found before use, the newest intact one used, never unpickled ----------

TWO_ROUNDS = RUN + ["--run.rounds=2", "--run.checkpoint_every=1"]


@pytest.fixture(scope="module")
def saved_run(small_dataset, tmp_path_factory):
    """A local run's checkpoints after rounds 1 and 2 (round_000001, round_000002)."""
    directory = tmp_path_factory.mktemp("saved_run")
    run_local(load_config(TWO_ROUNDS), small_dataset, checkpoints=directory)
    return directory


@pytest.fixture
def checkpoints(saved_run, tmp_path):
    """A fresh copy of `saved_run`'s checkpoints, free to damage."""
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    return tmp_path


class Payload:
    """Unpickled, it creates `marker`: what a malicious .pt file could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def drop_a_momentum_buffer(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    buffers = load_file(path)
    save_file(dict(sorted(buffers.items())[1:]), path)


def test_intact_checkpoints_have_no_problems(checkpoints):
    for directory in checkpoints.iterdir():
        assert checkpoint.checkpoint_problems(directory) == []


@pytest.mark.parametrize("damage, bad_file, what", [
    (lambda d: truncate(d / "global.safetensors"), "global.safetensors",
     "not a complete safetensors file (Error while deserializing header: incomplete metadata, "
     "file not fully covered)"),
    (lambda d: (d / "state.json").write_text("{\"format\": 2, \"round\": 2,"), "state.json",
     "not valid JSON (Expecting property name enclosed in double quotes"),
    (lambda d: (d / "state.json").write_text('{"format": 2, "round": "two"}'), "state.json",
     "lacks or garbles round, initial_eval_loss, last_eval_loss, train_seconds, "
     "first_round_seconds, bytes_total, bad_rounds, config.scaling.replicas, outer.step, "
     "outer.momentum"),
    (lambda d: (d / "state.json").write_text('{"format": 1, "round": 2}'), "state.json",
     "has format 1, this version reads 2"),
    (lambda d: (d / "replica_0001.pt").write_bytes(b"not a torch file" * 64), "replica_0001.pt",
     "not a complete torch.save file"),
    (lambda d: truncate(d / "replica_0000.pt"), "replica_0000.pt",
     "not a complete torch.save file"),
    (lambda d: (d / "replica_0001.pt").unlink(), "replica_0001.pt", "missing"),
    (lambda d: (d / "outer_0000.safetensors").unlink(), "outer_0000.safetensors", "missing"),
    (lambda d: drop_a_momentum_buffer(d / "outer_0000.safetensors"), "",
     "no outer*.safetensors file holds the outer momentum of 1 parameters"),
], ids=["truncated-global", "junk-state", "state-without-keys", "older-format", "garbage-pt",
        "truncated-pt", "missing-replica", "missing-outer", "momentum-missing"])
def test_damaged_checkpoint_is_reported_by_file(checkpoints, damage, bad_file, what):
    directory = checkpoints / "round_000002"
    damage(directory)
    problems = checkpoint.checkpoint_problems(directory)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{directory / bad_file if bad_file else directory}: {what}")


def test_pickled_code_in_a_replica_file_is_refused_without_running(small_dataset, checkpoints):
    directory = checkpoints / "round_000002"
    marker = checkpoints / "payload-ran"
    state = torch.load(directory / "replica_0001.pt", weights_only=True)
    torch.save({**state, "schedule": Payload(marker)}, directory / "replica_0001.pt")

    (problem,) = checkpoint.checkpoint_problems(directory)
    assert problem.startswith(f"{directory / 'replica_0001.pt'}: holds objects other than "
                              "tensors and plain values, refused without running them")
    assert "weights_only` set to `False`" not in problem  # torch's advice is not passed on
    with pytest.raises(checkpoint.CheckpointError, match="replica_0001.pt: holds objects"):
        run_local(load_config(TWO_ROUNDS), small_dataset, restore_from=directory)
    assert not marker.exists()
    torch.load(directory / "replica_0001.pt", weights_only=False)  # the payload is real
    assert marker.exists()


def ray_checkpoints(*directories: Path) -> list:
    import ray.train

    return [ray.train.Checkpoint.from_directory(directory) for directory in directories]


def test_resume_falls_back_to_the_newest_intact_checkpoint(checkpoints):
    newest, older = checkpoints / "round_000002", checkpoints / "round_000001"
    truncate(newest / "global.safetensors")
    with resume.open_resume_point(ray_checkpoints(newest, older)) as start:
        assert start.directory == older and start.error is None
        assert start.warning.startswith(
            f"warning: checkpoint {newest} is damaged: {newest / 'global.safetensors'}: not a "
            "complete safetensors")
        assert start.warning.endswith(f"resuming from the older checkpoint {older} (round 1) "
                                      "instead; the rounds after it are trained again")

    (older / "state.json").write_text("junk")
    with resume.open_resume_point(ray_checkpoints(newest, older)) as start:
        assert start.directory is None and start.warning is None
        message = start.error
    assert message.startswith(f"no intact checkpoint to resume from: checkpoint {newest} is "
                              f"damaged: {newest / 'global.safetensors'}: not a complete")
    assert f"checkpoint {older} is damaged: {older / 'state.json'}: not valid JSON" in message
    assert f"delete {checkpoints} (Ray Train refuses" in message

    with resume.open_resume_point([]) as start:  # a run without checkpoints starts afresh
        assert (start.directory, start.warning, start.error) == (None, None, None)


def test_run_checkpoints_are_ray_trains_newest_first(tmp_path):
    names = ["checkpoint_2025-01-02_10-00-00.000001", "checkpoint_2025-01-02_09-59-59.999999",
             "checkpoint_2025-01-01_23-00-00.500000"]
    for name in names + ["checkpoint_2025-01-02_10-00-01.000000"]:  # the last: unregistered
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")
    (tmp_path / "checkpoint_2024-12-31_00-00-00.000000.json").write_text("{}")  # not a dir
    found = resume.run_checkpoints(*ray_checkpoints(tmp_path / names[0]))
    assert [Path(saved.path) for saved in found] == [tmp_path / n for n in names]


def ray_record_latest(run_dir: Path) -> str:
    """The latest checkpoint of `run_dir` as Ray Train's own checkpoint manager reads it."""
    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext

    manager = CheckpointManager(CheckpointConfig(num_to_keep=2), StorageContext(
        storage_path=str(run_dir.parent), experiment_dir_name=run_dir.name))
    return Path(manager.latest_checkpoint_result.checkpoint.path).name


@pytest.mark.parametrize("damage, why", [
    (lambda record: record.write_text(""), "it is empty"),
    (lambda record: record.write_text(record.read_text()[:40]),
     "it cannot be read (ValidationError)"),
    (lambda record: shutil.rmtree(record.parent / "checkpoint_2025-01-02_10-00-00.000000"),
     "it names checkpoints that are gone (checkpoint_2025-01-02_10-00-00.000000)"),
], ids=["empty", "cut-short", "names-a-deleted-checkpoint"])
def test_an_unusable_ray_record_is_rebuilt_from_the_checkpoint_directories(tmp_path, damage,
                                                                           why):
    run_dir = tmp_path / "run"
    names = ["checkpoint_2025-01-01_09-00-00.000000", "checkpoint_2025-01-02_10-00-00.000000",
             "checkpoint_2025-01-02_11-00-00.000000"]
    for name in names:
        (run_dir / name).mkdir(parents=True)
    (run_dir / "checkpoint_2025-01-03.json").write_text("{}")  # not a checkpoint directory
    record = run_dir / resume.RAY_RECORD
    assert resume.repair_record(run_dir) is None  # no record: nothing to repair
    record.write_text("")
    resume.repair_record(run_dir)
    good = record.read_text()
    assert resume.repair_record(run_dir) is None and record.read_text() == good  # left alone
    assert ray_record_latest(run_dir) == names[-1]

    damage(record)
    damaged = record.read_bytes()
    note = resume.repair_record(run_dir)
    kept = [name for name in names if (run_dir / name).is_dir()]
    assert note == (f"note: Ray Train's record of this run's checkpoints ({record}) was "
                    f"unusable: {why} (e.g. a disk that filled up); rebuilt from the {len(kept)} "
                    f"checkpoint directories in {run_dir}, the old one kept as "
                    f"{resume.RAY_RECORD}.damaged")
    assert (run_dir / f"{resume.RAY_RECORD}.damaged").read_bytes() == damaged
    assert [result["checkpoint_dir_name"] for result in
            json.loads(record.read_text())["checkpoint_results"]] == kept
    assert ray_record_latest(run_dir) == names[-1]


def test_a_checkpoint_that_would_not_fit_is_refused_before_it_is_written(tmp_path):
    from isoloco_ray import storage

    free = shutil.disk_usage(tmp_path).free
    assert storage.checkpoint_room(tmp_path / "run", 1000) is None
    needed = free + 1
    assert storage.checkpoint_room(tmp_path / "run", needed) == (
        f"{tmp_path / 'run'} has {free / 2**20:,.1f} MiB free and the checkpoint needs "
        f"{(needed + storage.CHECKPOINT_HEADROOM) / 2**20:,.1f} MiB: free space there "
        "(earlier checkpoints are kept) and run the same command again to resume from the "
        "latest")


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of its own, small and resizable (a tmpfs; mounting needs root):
    (its mount point, resize(bytes))."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()

    def mount(size: int, *options: str) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([*options, f"size={size}"]),
                        "tmpfs", str(disk)], check=True, capture_output=True, timeout=30)

    try:
        mount(4 << 20)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc}): run the suite as root for this test")
    try:
        yield disk, lambda size: mount(size, "remount")
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False, timeout=30)


def test_a_full_disk_stops_the_run_before_a_checkpoint_and_the_same_command_resumes(
        ray_cluster, small_dataset, saved_run, small_disk, capsys):
    """Checkpoints on a disk with room for two and a half: the third is refused before any
    byte of it is written, every rank stopping together (no restarts that would fill the disk
    again); the checkpoints and Ray Train's record stay intact, and once there is room the
    same command resumes and ends bit-identical to an uninterrupted run."""
    from isoloco_ray import train

    disk, resize = small_disk
    args = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64",
            "--data.batch_size=4", "--scaling.replicas=2", "--scaling.replicas_per_worker=1",
            "--inner.steps=2", "--run.rounds=4", "--run.checkpoint_every=1",
            "--run.eval_every=4", "--run.eval_tokens=512", f"--run.storage_path={disk}",
            "--run.name=full"]
    whole = run_local(load_config(args), small_dataset)[0]["model_sha256"]
    one = sum(path.stat().st_size for path in (saved_run / "round_000001").iterdir())
    resize(int(2.6 * one))
    run_dir = disk / "full"

    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert f"error: the run stopped after round 3: the checkpoint of round 3 was not written: " \
        f"{run_dir} has " in err
    assert "free space there (earlier checkpoints are kept) and run the same command again " \
        "to resume from the latest" in err and "Traceback" not in err
    saved = sorted(path for path in run_dir.glob("checkpoint_*") if path.is_dir())
    assert [checkpoint.saved_round(path) for path in saved] == [1, 2]
    assert all(checkpoint.checkpoint_problems(path) == [] for path in saved)
    assert resume.repair_record(run_dir) is None  # Ray Train's record is intact

    resize(5 * one)
    assert train.main(args) == 0
    assert "resuming" in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["model_sha256"] == whole


def test_restore_sets_only_the_typed_counters(tmp_path):
    state = {"round": 3, "initial_eval_loss": 6, "last_eval_loss": None, "train_seconds": 1.5,
             "first_round_seconds": 0.5, "bytes_total": 10, "bad_rounds": 0,
             "config": {}, "injected": "__class__"}
    counters = checkpoint.read_counters(state, tmp_path / "state.json")
    assert counters == {"round": 3, "initial_eval_loss": 6.0, "last_eval_loss": None,
                        "train_seconds": 1.5, "first_round_seconds": 0.5, "bytes_total": 10,
                        "bad_rounds": 0}
    assert type(counters["initial_eval_loss"]) is float
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"state.json: lacks or garbles round, bytes_total$"):
        checkpoint.read_counters({**state, "round": 2.5, "bytes_total": -1},
                                 tmp_path / "state.json")


def test_adamw_ddp_checkpoints_its_one_optimizer_and_needs_it(small_dataset, tmp_path):
    cfg = load_config(RUN + ["--run.rounds=2", "--outer.strategy=adamw_ddp"])
    run_local(cfg, small_dataset, checkpoints=tmp_path)
    directory = tmp_path / "round_000002"
    saved = checkpoint.load_data_parallel(directory)
    assert saved["schedule"]["last_epoch"] == 2 * 2 and saved["optimizer"]["state"]
    assert checkpoint.checkpoint_problems(directory) == []
    (directory / "data_parallel.pt").unlink()
    assert checkpoint.checkpoint_problems(directory) == [
        f"{directory / 'data_parallel.pt'}: missing"]


def test_replicas_of_a_worker_missing_from_the_round_are_not_needed_and_rejoin_at_restore(
        small_dataset, checkpoints):
    """Replica mode: a worker missing from a checkpoint round's sync (lost, or paused) writes no
    files. Its replicas' are not needed (checkpoint.absent_replicas, from the round's record):
    the checkpoint is intact, and restored they start again from θ at its round, exactly as
    Replica.rejoin puts a healed or replaced worker's; a contributor's missing file is still
    damage."""
    from isoloco_ray.workers.local import local_env
    from isoloco_ray.workers.loop import Trainer

    cfg = load_config(TWO_ROUNDS)
    intact, directory = checkpoints / "round_000002", checkpoints / "absent"
    shutil.copytree(intact, directory)
    state_path = directory / checkpoint.STATE_FILE
    state = json.loads(state_path.read_text())
    hosted = cfg.scaling.replicas_per_worker
    state["record"] = {**(state.get("record") or {}), "round": 2, "contributors": [],
                       "missing_workers": [0]}
    state_path.write_text(json.dumps(state))
    assert checkpoint.absent_replicas(state) == set(range(hosted))
    for replica in range(1, hosted):
        (directory / checkpoint.replica_file(replica)).unlink()
    assert checkpoint.checkpoint_problems(directory) == []
    assert checkpoint.needed_files(state) <= {p.name for p in directory.iterdir()}
    assert checkpoint.replica_file(1) not in checkpoint.needed_files(state)

    restored = Trainer(cfg, small_dataset, local_env(restore_from=directory))
    rejoined = Trainer(cfg, small_dataset, local_env(restore_from=intact))
    for replica in rejoined.replicas[1:]:
        replica.rejoin(2 * cfg.inner.steps, rejoined.global_params)
    for mine, expected in zip(restored.replicas[1:], rejoined.replicas[1:]):
        assert mine.stream.position == expected.stream.position
        # _step_count: how often step() ran in this process (a call-order warning's), not
        # where the schedule stands
        assert ({k: v for k, v in mine.schedule.state_dict().items() if k != "_step_count"}
                == {k: v for k, v in expected.schedule.state_dict().items()
                    if k != "_step_count"})
        assert mine.optimizer.state_dict() == expected.optimizer.state_dict()
    assert restored.replicas[1].optimizer.state_dict()["state"] == {}  # moments forgotten
    assert restored.replicas[0].optimizer.state_dict()["state"] != {}  # its file was there

    state["record"]["missing_workers"] = []  # the replicas' worker took the round: damage
    state_path.write_text(json.dumps(state))
    assert [line.split(": ", 1)[1] for line in checkpoint.checkpoint_problems(directory)] == [
        "missing"] * (hosted - 1)


@pytest.mark.parametrize("replicas, per_worker, per_replica", [
    (1, 1, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (2, 1, 2), (4, 1, 2), (3, 1, 4)])
@pytest.mark.parametrize("everyone_merges", [True, False])
def test_every_file_of_a_checkpoint_is_written_by_exactly_one_worker(
        replicas, per_worker, per_replica, everyone_merges):
    """Over every worker of a run (V replicas per worker, or each replica on G workers; every
    rank merging all tensors, or each owner its share) the files the workers' Roles name are
    the files a complete checkpoint needs, and no two workers write the same file."""
    from isoloco_ray.workers.parallel.layout import WorkerLayout

    cfg = load_config([f"--scaling.replicas={replicas}",
                       f"--scaling.replicas_per_worker={per_worker}",
                       f"--scaling.workers_per_replica={per_replica}"])
    world = cfg.scaling.num_workers
    written: list[str] = []
    momentum_files: list[int] = []
    for rank in range(world):
        layout = WorkerLayout(rank, world, per_worker, per_replica, None, None, None)
        roles = Roles.in_group(layout, everyone_merges)
        written += [checkpoint.replica_file(r) for r in roles.replicas]
        if roles.shared:
            written += [checkpoint.STATE_FILE, checkpoint.GLOBAL_FILE]
        if roles.momentum_file is not None:
            momentum_files.append(roles.momentum_file)
    assert sorted(written) == sorted(set(written))  # none twice
    state = {"config": cfg.model_dump(mode="json"), "record": None}
    assert set(written) == checkpoint.needed_files(state)
    # One momentum file per outer group's writer: each position's when every rank holds all of
    # it, every rank's own share when owners merge.
    assert sorted(momentum_files) == (list(range(per_replica)) if everyone_merges
                                      else list(range(world)))


def test_over_a_quorum_the_writer_writes_the_shared_files_and_every_worker_its_replicas():
    writer, other = Roles.over_quorum(True, range(0, 2)), Roles.over_quorum(False, range(2, 4))
    assert (writer.shared, writer.momentum_file, writer.replicas) == (True, 0, (0, 1))
    assert (other.shared, other.momentum_file, other.replicas) == (False, None, (2, 3))
