"""Configuration: presets, overrides, and the promised error messages and exit status."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from isoloco_ray.config import ConfigError, TrainConfig, config_differences, load_config
from isoloco_ray import train


def test_defaults_are_the_demo_run():
    cfg = load_config([])
    assert (cfg.model.preset, cfg.scaling.replicas, cfg.scaling.num_workers) == ("demo", 4, 2)
    assert (cfg.outer.strategy, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (
        "diloco", 0.7, 0.9, True)
    assert cfg.inner.lr == 1.38e-3 and cfg.inner.weight_decay == 0.1
    assert cfg.data.micro_batch_size == cfg.data.batch_size


@pytest.mark.parametrize("strategy, inner_lr, outer_lr, momentum", [
    ("diloco_sgd", 1.38e-3, 1.6, 0.0), ("isoc", 3.91e-3, 2.1, 0.0),
    ("isoloco", 1.38e-3, 1.8, 0.8), ("isocts", 3.91e-3, 3.1, 0.0), ("tsv", 2.76e-3, 0.6, 0.0),
    ("ties", 2.76e-3, 0.7, 0.0), ("dare", 2.76e-3, 1.5, 0.0)])
def test_strategy_presets_follow_the_paper(strategy, inner_lr, outer_lr, momentum):
    cfg = load_config([f"--outer.strategy={strategy}", "--scaling.replicas=8"])
    assert (cfg.inner.lr, cfg.outer.lr, cfg.outer.momentum) == (inner_lr, outer_lr, momentum)
    if strategy == "tsv":
        assert cfg.outer.keep_fraction == 1 / 8


def test_the_settled_values_are_what_validation_filled_and_refused_unvalidated():
    cfg = load_config(["--outer.strategy=tsv", "--model.preset=tiny", "--run.token_budget=40960",
                       "--data.batch_size=8", "--data.seq_len=64", "--inner.steps=5"])
    assert cfg.resolved.rounds == cfg.run.rounds == 40960 // (8 * 64 * 5 * 4)
    assert cfg.resolved.micro_batch_size == cfg.data.micro_batch_size == 8
    shape = cfg.model.shape
    assert (shape.hidden_size, shape.num_layers, shape.num_kv_heads) == (64, 2, 2)
    unvalidated = TrainConfig.model_construct(run=cfg.run.model_construct(rounds=None),
                                              data=cfg.data)
    with pytest.raises(ValueError, match=r"^run\.rounds is unset: build the config with "
                       "TrainConfig.model_validate"):
        unvalidated.resolved


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny, num_layers: 3}\nouter: {lr: 0.5}\n")
    cfg = load_config([str(path), "--outer.lr=0.25", "--inner.betas", "0.8,0.9"])
    assert (cfg.model.preset, cfg.model.num_layers, cfg.model.hidden_size) == ("tiny", 3, 64)
    assert cfg.outer.lr == 0.25 and cfg.inner.betas == (0.8, 0.9)
    assert cfg.outer.momentum == 0.9  # the strategy's, not overridden


def test_token_budget_sets_rounds():
    cfg = load_config(["--run.token_budget=1000000"])
    assert cfg.run.rounds == 1_000_000 // (8 * 128 * 20 * 4)
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg  # a resolved config round-trips


@pytest.mark.parametrize("args, message", [
    (["--model.hiden_size=3"], "--model.hiden_size: unknown option; did you mean "
                               "--model.hidden_size?"),
    (["--inner.lr=fast"], "inner.lr: Input should be a valid number"),
    (["--scaling.replicas=3"], "scaling.replicas (3) must be divisible by "
                               "scaling.replicas_per_worker (2)"),
    (["--data.seq_len=512"], "data.seq_len (512) exceeds the model's context"),
    (["--outer.strategy=sgd"], "outer.strategy must be one of diloco, diloco_sgd, isoc"),
    (["--data.batch_size=8", "--data.micro_batch_size=3"], "data.batch_size (8) must be a "
                                                           "multiple of data.micro_batch_size"),
    (["--run.rounds=2", "--run.token_budget=10"], "set run.rounds or run.token_budget"),
    (["missing.yaml"], "config file missing.yaml does not exist"),
    (["--outer.keep_fraction=0.5"], "outer.keep_fraction does not apply to outer.strategy "
                                    "'diloco' (only to tsv)"),
    (["--outer.strategy=isoc", "--outer.nesterov=true"], "outer.nesterov needs "
                                                        "outer.momentum > 0"),
    (["--outer.strategy=tsv", "--outer.keep_fraction=1.5"], "outer.keep_fraction: Input should "
                                                           "be less than or equal to 1"),
    (["--scaling.workers_per_replica=2"], "scaling.workers_per_replica (2) > 1 spreads one "
                                          "replica over several workers"),
    (["--scaling.replicas_per_worker=1", "--scaling.workers_per_replica=3"],
     "data.batch_size (8) must split evenly over scaling.workers_per_replica (3)"),
    (["--outer.comm_dtype=float16"], "outer.comm_dtype: Input should be 'float32', "
                                     "'bfloat16', 'int8', 'float8', 'int2' or 'int4'"),
    (["--outer.strategy=dare", "--outer.prune=magnitude"], "outer.prune must be 'random' for "
     "outer.strategy 'dare' (got 'magnitude'): DARE drops entries at random; for magnitude "
     "pruning use outer.strategy=ties"),
    # Settings that would be accepted and change nothing (issue 35, item 8).
    (["--outer.strategy=adamw_ddp", "--outer.comm_dtype=int8", "--outer.topk=0.1"],
     "outer.comm_dtype=int8, outer.topk=0.1 have no effect with adamw_ddp (it has no outer "
     "sync: its gradients are all-reduced in float32 every inner step); remove them"),
    (["--outer.strategy=adamw_ddp", "--outer.comm_dtype=int2"],
     "outer.comm_dtype=int2 has no effect with adamw_ddp (it has no outer sync"),
    (["--outer.strategy=adamw_ddp", "--outer.placement=rank0"],
     "outer.placement=rank0 has no effect with adamw_ddp"),
    # SparseLoCo's wire with owners: for the merges of every Δ_r only (docs/outer_sync.md).
    (["--outer.comm_dtype=int2", "--outer.topk=0.03"],
     "outer.comm_dtype=int2 with outer.placement=sharded has each tensor's owner merge and "
     "send its update back packed, for the merges of every Δ_r (tsv, isocts, ties, dare); "
     "diloco merges the mean, which every worker merges for less (SparseLoCo): set "
     "outer.placement=replicated"),
    (["--outer.strategy=ties", "--outer.disjoint=false", "--outer.comm_dtype=int4",
      "--outer.topk=0.03", "--outer.placement=rank0"],
     "outer.comm_dtype=int4 with outer.placement=rank0 has each tensor's owner merge"),
    (["--outer.lr=0"], "outer.lr = 0 never moves the global model; set outer.lr > 0, or leave "
                       "it unset for the strategy's value"),
    (["--outer.comm_dtype=bfloat16", "--outer.placement=replicated"],
     "outer.comm_dtype=bfloat16 has no effect with outer.placement=replicated and "
     "outer.strategy 'diloco': every worker merges the all-reduced float32 sum of the "
     "pseudo-gradients, so nothing is cast; use placement sharded or rank0 to send bfloat16, or "
     "comm_dtype float32"),
    (["--outer.strategy=ties", "--outer.sparsity=0", "--outer.prune_dim=row"],
     "outer.prune_dim=row has no effect with outer.sparsity=0 (every entry is kept); set "
     "outer.sparsity > 0 or remove it"),
    (["--outer.strategy=dare", "--outer.sparsity=0", "--outer.rescale=false"],
     "outer.rescale=False has no effect with outer.sparsity=0"),
    (["--scaling.replicas=4", "--scaling.replicas_per_worker=1", "--scaling.min_workers=4"],
     "scaling.min_workers (4) is R/V, the only worker count it then allows, so it has no "
     "effect; lower it to one of [1, 2] for an elastic run, or remove it"),
    (["--scaling.replicas=1", "--scaling.replicas_per_worker=1", "--scaling.min_workers=1"],
     "scaling.min_workers (1) is R/V, the only worker count it then allows, so it has no "
     "effect; remove it"),
    (["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
      "--scaling.workers_per_replica=2", "--scaling.min_workers=2"],
     "scaling.min_workers (2) has no effect with scaling.workers_per_replica (2) > 1: a replica "
     "spread over several workers needs them all, so the run cannot shrink; remove it"),
    # Two NCCL communicators driven from two threads at once would hang (issue 31, item 2).
    (["--scaling.use_gpu=true", "--scaling.replicas_per_worker=1",
      "--scaling.workers_per_replica=2", "--inner.steps=4", "--outer.delay=1"],
     "outer.delay (1) > 0 with scaling.workers_per_replica (2) > 1 on GPUs: the replica's "
     "per-step gradient all-reduce and the background outer sync would drive two NCCL "
     "communicators from two threads at once, which NCCL does not order (a hang); set "
     "outer.delay=0 or scaling.workers_per_replica=1"),
    # scaling.fault_tolerance: replica, within Ray's torchft limits and what runs over a quorum.
    (["--scaling.fault_tolerance=replica", "--scaling.replicas_per_worker=1",
      "--scaling.workers_per_replica=2"],
     "scaling.fault_tolerance: replica needs scaling.workers_per_replica = 1: Ray Train's "
     "replica groups are one worker each"),
    (["--scaling.fault_tolerance=replica", "--scaling.replicas_per_worker=1",
      "--scaling.min_workers=2"],
     "scaling.fault_tolerance: replica cannot be combined with scaling.min_workers: Ray Train "
     "does not resize a run with torchft; remove scaling.min_workers"),
    (["--scaling.fault_tolerance=replica", "--scaling.replicas=2"],
     "scaling.fault_tolerance: replica needs at least 2 workers (R/V = 1)"),
    (["--scaling.fault_tolerance=replica", "--run.max_failures=0"],
     "scaling.fault_tolerance: replica replaces a lost worker as one Ray Train failure: set "
     "run.max_failures >= 1 (or -1, unlimited)"),
    (["--scaling.fault_tolerance=replica", "--outer.placement=rank0"],
     "outer.placement=rank0 has no effect with scaling.fault_tolerance: replica (every worker "
     "merges the quorum's sum: rank 0 may be gone); remove it"),
    (["--scaling.fault_tolerance=replica", "--inner.steps=4", "--outer.delay=1"],
     "replica does not run outer.fragments, outer.delay or outer.mix yet"),
    (["--scaling.fault_tolerance=replica", "--outer.strategy=adamw_ddp",
      "--outer.placement=sharded"], "replica does not run outer.strategy adamw_ddp (it "
     "all-reduces every inner step) yet"),
    (["--scaling.fault_tolerance=replica", "--scaling.use_gpu=true"],
     "scaling.fault_tolerance: replica does not run scaling.use_gpu yet (it runs every outer "
     "strategy but adamw_ddp, on every wire, on CPUs: docs/fault_tolerance.md); set "
     "--scaling.fault_tolerance=restart"),
    # Non-finite settings would train a NaN model.
    (["--inner.lr=inf"], "inner.lr: must be a finite number (got 'inf')"),
    (["--outer.lr=inf"], "outer.lr: must be a finite number (got 'inf')"),
    (["--outer.lr=nan"], "outer.lr: must be a finite number (got 'nan')"),
    (["--inner.clip=inf"], "inner.clip: must be a finite number"),
    (["--inner.weight_decay=inf"], "inner.weight_decay: must be a finite number"),
    (["--scaling.cpus_per_worker=inf"], "scaling.cpus_per_worker: must be a finite number"),
    (["--scaling.straggler_deadline=inf"], "scaling.straggler_deadline: must be a finite number"),
    (["--scaling.straggler_deadline=0.5"], "scaling.straggler_deadline: must be at least 1 "
     "(got 0.5): a straggler's steps stop at this many times the fastest worker's usual time"),
    (["--inner.betas", "0.9,1.0"], "inner.betas [0.9, 1.0]: each must be in [0, 1)"),
    (["--inner.betas=-0.1,0.9"], "inner.betas [-0.1, 0.9]: each must be in [0, 1)"),
    # run.name is one directory under run.storage_path.
    (["--run.name=../x"], "run.name '../x' must be one directory name"),
    (["--run.name=/etc"], "run.name '/etc' must be one directory name"),
    (["--run.name=."], "run.name '.' must be one directory name"),
    (["--run.name=a/b"], "run.name 'a/b' must be one directory name"),
    (["--run.name=résumé"], "must be one directory name: ASCII letters"),
    (["--run.name=" + "x" * 129], "run.name is 129 characters long; use at most 128"),
])
def test_config_errors_name_the_field(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert message in str(err.value)


def test_settings_with_an_effect_are_accepted_and_resolved_configs_round_trip():
    """The neighbours of the refusals above: each changes something, and a resolved config
    (adamw_ddp's inert outer values, ties/dare presets with sparsity 0) loads again."""
    for args in (["--outer.strategy=adamw_ddp"], ["--outer.strategy=ties", "--outer.sparsity=0"],
                 ["--outer.strategy=dare", "--outer.sparsity=0"],
                 ["--outer.comm_dtype=bfloat16", "--outer.placement=sharded"],
                 ["--outer.comm_dtype=bfloat16", "--outer.placement=replicated",
                  "--outer.strategy=tsv"],  # a merge of every Δ_r: each is sent in bfloat16
                 ["--outer.comm_dtype=bfloat16", "--outer.placement=replicated",
                  "--outer.error_feedback=true"],
                 ["--scaling.replicas=4", "--scaling.replicas_per_worker=1",
                  "--scaling.min_workers=2"],
                 ["--scaling.fault_tolerance=replica"],
                 ["--scaling.fault_tolerance=replica", "--outer.strategy=isoloco"],
                 ["--scaling.fault_tolerance=replica", "--outer.strategy=tsv"],
                 ["--scaling.fault_tolerance=replica", "--outer.strategy=ties",
                  "--outer.prune=random"],
                 ["--scaling.fault_tolerance=replica", "--outer.strategy=isoc",
                  "--outer.placement=replicated"],
                 ["--scaling.fault_tolerance=replica", "--outer.strategy=dare",
                  "--outer.placement=sharded"]):
        cfg = load_config(args)
        assert TrainConfig.model_validate(cfg.model_dump()) == cfg


def test_cli_error_exits_2_without_traceback_or_ray(capsys, no_ray):
    status = train.main(["--scaling.replicas=3"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: scaling.replicas (3) must be divisible")
    assert "Traceback" not in err


@pytest.mark.parametrize("joined", [False, True], ids=["local", "joined"])
def test_use_gpu_without_gpus_is_refused_before_training(small_dataset, tmp_path, capsys,
                                                         monkeypatch, cluster_without_gpus,
                                                         joined):
    """At once on a cluster of this machine; on a joined one (an autoscaler may add GPU nodes)
    after a bounded wait that says what it waits for."""
    monkeypatch.setattr(train, "joined_cluster", lambda: joined)
    status = train.main(["--model.preset=tiny", f"--data.path={small_dataset}",
                         "--data.seq_len=64", "--scaling.replicas=2",
                         "--scaling.replicas_per_worker=1", "--scaling.use_gpu=true",
                         f"--run.storage_path={tmp_path}"])
    out, err = capsys.readouterr()
    assert status == 2
    waited = " after 0.3 s" if joined else ""
    assert err.strip().splitlines()[-1] == (
        f"error: scaling.use_gpu: the Ray cluster has 0 GPUs{waited} and the run needs 2 (one "
        "per worker); set scaling.use_gpu=false to train on CPUs, or run on a cluster with GPUs")
    assert ("waiting up to 0.3 s for 2 GPUs" in out) == joined


def test_gpus_an_autoscaler_adds_while_waiting_are_taken(monkeypatch, cluster_without_gpus):
    import ray

    answers = iter([{"GPU": 0.0}, {"GPU": 1.0}, {"GPU": 2.0}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: next(answers))
    monkeypatch.setenv("ISOLOCO_RAY_GPU_WAIT_SECONDS", "30")
    train.check_gpus(load_config(["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
                                  "--scaling.use_gpu=true"]),
                     joined=True)
    assert next(answers, None) is None  # it asked until there were enough


def test_a_gpu_run_where_cuda_is_unusable_is_refused_before_training(
        small_dataset, tmp_path, capsys, monkeypatch, cluster_without_gpus):
    """GPUs in the cluster, but CUDA unusable on a node (a driver older than the torch build
    needs): refused with the node's probe, not left to fail in every worker run.max_failures
    times."""
    import ray

    from isoloco_ray import cuda_check

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    monkeypatch.setattr(cuda_check, "check_cuda_on_gpu_nodes", lambda memory: (
        cuda_check.refuse_unusable([None, "CUDA is not usable on gpu-node-2: <the probe's line>"],
                                   0)))
    status = train.main(["--model.preset=tiny", f"--data.path={small_dataset}",
                         "--data.seq_len=64", "--scaling.replicas=2",
                         "--scaling.replicas_per_worker=1", "--scaling.use_gpu=true",
                         f"--run.storage_path={tmp_path}"])
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: scaling.use_gpu: CUDA is not usable on gpu-node-2: <the probe's line>")


def test_the_cuda_probe_names_the_node_the_builds_and_the_fix(capsys):
    from isoloco_ray import cuda_check

    with pytest.raises(ConfigError, match=r"^scaling.use_gpu: a \(and 1 more GPU nodes\)$"):
        cuda_check.refuse_unusable([None, "a", None, "b"], unreached=0)
    cuda_check.refuse_unusable([None], unreached=1)  # a node whose GPUs stayed busy
    assert capsys.readouterr().err == (
        "warning: CUDA not checked on 1 GPU node(s): no GPU there became free within 120 s\n")
    if torch.cuda.is_available():
        assert cuda_check.cuda_problem() is None
        return
    problem = cuda_check.cuda_problem()  # this machine has no usable CUDA device
    assert problem.startswith(f"CUDA is not usable on {socket.gethostname()}: no CUDA device "
                              "is usable (torch.cuda.is_available() is False); torch "
                              f"{torch.__version__} is built for CUDA {torch.version.cuda}, "
                              "the NVIDIA driver is ")
    assert problem.endswith(f"{cuda_check.OLDER_DRIVER_FIX}; or set scaling.use_gpu=false")


def test_a_relative_storage_path_inside_a_ray_job_is_refused(small_dataset, tmp_path, capsys,
                                                             monkeypatch, no_ray):
    """Under `ray job submit --working-dir`, a relative run.storage_path would land in Ray's
    temporary copy of the working directory: refused for runs and grids, naming the field;
    an absolute path is taken."""
    from isoloco_ray import tune
    from isoloco_ray.storage import check_writable

    job_dir = tmp_path / "ray" / "session_1" / "runtime_resources" / "working_dir_files" / "pkg"
    job_dir.mkdir(parents=True)
    monkeypatch.chdir(job_dir)
    message = (f"error: run.storage_path: runs is relative, and this is a Ray job running in "
               f"Ray's temporary copy of its working directory ({job_dir}), which Ray deletes; "
               "give an absolute path on storage every node shares, or an s3:// URI")
    assert train.main(["--model.preset=tiny", f"--data.path={small_dataset}",
                       "--data.seq_len=64"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    grid = job_dir / "grid.yaml"
    grid.write_text(f"base:\n  data: {{path: {small_dataset}, seq_len: 64}}\n"
                    "  model: {preset: tiny}\n"
                    "grid:\n  outer.lr: [0.5, 0.7]\n")
    assert tune.main([str(grid), "--dry-run"]) == 2
    assert message in capsys.readouterr().err
    assert check_writable(tmp_path / "runs") == tmp_path / "runs"
    assert not (job_dir / "runs").exists()


def test_replica_mode_without_torchft_names_the_extra_before_ray(small_dataset, capsys, no_ray,
                                                                  monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "torchft" else find_spec(name, *a))
    assert train.main([f"--data.path={small_dataset}", "--data.seq_len=64",
                       "--scaling.fault_tolerance=replica"]) == 2
    assert capsys.readouterr().err == (
        "error: scaling.fault_tolerance: replica needs torchft, which is not installed: pip "
        "install 'isoloco_ray[ft]' (pip install -e '.[ft]' in a checkout), or use "
        "scaling.fault_tolerance=restart\n")


def test_missing_data_path_is_a_config_error(capsys, tmp_path, no_ray):
    status = train.main([f"--data.path={tmp_path / 'nowhere'}"])
    assert status == 2
    assert "data.path:" in capsys.readouterr().err


def test_help_lists_every_field_with_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        load_config(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--model.preset", "--data.seq_len", "--scaling.replicas_per_worker",
                 "--inner.steps", "--outer.strategy", "--run.token_budget"):
        assert flag in out
    assert "(default: 20)" in out  # inner.steps


@pytest.mark.parametrize("args, message", [
    (["--model.vocab_size=100"], "model.vocab_size (100) is smaller than the data's tokenizer "
                                 "vocabulary (384"),
    (["--data.seq_len=128"], "data.seq_len (128) is longer than the data's blocks (64 tokens)"),
    (["--scaling.replicas=128", "--scaling.replicas_per_worker=128"],
     "data.batch_size (8) is more than the 7 sequences of data.seq_len 64 that the smallest "
     "of 128 replicas' shares"),
])
def test_data_dependent_errors_exit_2_before_ray(small_dataset, capsys, no_ray, args, message):
    base = ["--model.preset=tiny", f"--data.path={small_dataset}", "--data.seq_len=64"]
    assert train.main(base + args) == 2
    assert message in capsys.readouterr().err


def test_unknown_yaml_field_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("inner: {stpes: 30}\n")
    with pytest.raises(ConfigError, match=r"inner.stpes: unknown field"):
        load_config([str(path)])


def test_resume_may_change_placement_but_not_the_math():
    saved = load_config(["--outer.placement=rank0"]).model_dump(mode="json")
    assert config_differences(saved, load_config([])) == []
    assert config_differences(saved, load_config(["--model.activation_checkpointing=true"])) == []
    assert config_differences(saved, load_config(["--outer.comm_dtype=bfloat16"])) == [
        "outer.comm_dtype"]


@pytest.mark.parametrize("strategy, option", [
    ("tsv", "keep_fraction"), ("ties", "sparsity"), ("dare", "sparsity"),
    ("isocts", "common_fraction")])
def test_a_checkpoint_older_than_a_strategy_option_resumes_with_its_default(strategy, option):
    """A saved config that lacks an option (added to the strategy since) had the option's
    default then, R-dependent ones included (tsv's 1/R); another value is a difference."""
    cfg = load_config([f"--outer.strategy={strategy}", "--scaling.replicas=4"])
    saved = cfg.model_dump(mode="json")
    assert option in saved["outer"]
    del saved["outer"][option]
    assert config_differences(saved, cfg) == []
    saved["outer"][option] = 0.5 if cfg.outer.strategy_options[option] != 0.5 else 0.25
    assert config_differences(saved, cfg) == [f"outer.{option}"]


def test_a_replica_over_several_workers_splits_its_batch():
    cfg = load_config(["--scaling.replicas_per_worker=1", "--scaling.workers_per_replica=2"])
    assert cfg.scaling.num_workers == 8
    assert cfg.data.micro_batch_size == cfg.data.batch_size // 2  # one micro-batch per worker


def test_a_cluster_without_room_for_the_data_readers_is_refused(small_dataset, tmp_path,
                                                                 monkeypatch, capsys):
    """All of a local cluster's CPUs taken by workers would leave Ray Data waiting forever."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("Ray must not start"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = [f"--data.path={small_dataset}", "--data.seq_len=64", "--run.rounds=1",
            "--run.num_cpus=2",
            f"--run.storage_path={tmp_path}", "--run.name=full"]
    assert train.main(args) == 2
    assert "run.num_cpus (2) leaves no CPU for Ray Data's readers beside 2 workers" in \
        capsys.readouterr().err
    assert not (tmp_path / "full").exists()  # nothing written: the same command can be fixed


def test_a_safe_run_name_is_accepted():
    assert load_config(["--run.name=03-isoloco-inner.lr=0.001,x+y_z"]).run.name == \
        "03-isoloco-inner.lr=0.001,x+y_z"


def test_a_non_utf8_config_file_names_the_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("inner: {lr: 0.001}\nrun: {name: caf\u00e9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text \(line 2, byte 34\)"):
        load_config([str(path)])


@pytest.mark.parametrize("storage", ["file/runs", "/proc/isoloco-runs"])
def test_an_unwritable_storage_path_exits_2_before_ray(small_dataset, tmp_path, capsys, no_ray,
                                                       storage):
    (tmp_path / "file").write_text("not a directory")
    path = storage if storage.startswith("/") else tmp_path / storage
    status = train.main(["--model.preset=tiny", f"--data.path={small_dataset}",
                         "--data.seq_len=64", "--run.rounds=1", f"--run.storage_path={path}"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"error: run.storage_path: cannot write to {path} (")
    assert "choose a writable directory" in err and "Traceback" not in err


@pytest.mark.parametrize("spelling", ["null", "None", "none", "NULL"])
def test_an_optional_field_is_unset_by_null_or_none(tmp_path, spelling):
    """YAML's `null` and Python's `None` both unset an optional field, in both flag forms,
    and win over the YAML file like any other flag."""
    path = tmp_path / "run.yaml"
    path.write_text("inner: {clip: 2.0}\nouter: {lr: 0.5}\nrun: {name: from-yaml}\n")
    cfg = load_config([str(path), f"--inner.clip={spelling}", "--outer.lr", spelling,
                       f"--run.name={spelling}"])
    assert cfg.inner.clip is None
    assert cfg.outer.lr == 0.7  # unset again: the strategy's paper value
    assert cfg.run.name is None
    assert load_config(["--run.wandb.project=p", f"--run.wandb.mode={spelling}"]
                       ).run.wandb.mode is None


@pytest.mark.parametrize("args, message", [
    (["--inner.steps=null"], "inner.steps: cannot be unset ('null'); it always takes a value"),
    (["--outer.strategy", "None"], "outer.strategy: cannot be unset ('None'); it always takes "
                                   "a value"),
])
def test_unsetting_a_field_that_always_has_a_value_names_it(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert str(err.value).startswith(message)


def test_help_says_how_to_unset_an_optional_field(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "are unset again with null, None or none" in out
    assert "--inner.clip=null (no clipping)" in out


@pytest.mark.parametrize("variable, value, why", [
    ("ISOLOCO_RAY_GPU_WAIT_SECONDS", "abc", "Input should be a valid number, unable to parse "
                                            "string as a number; it takes seconds ≥ 0"),
    ("ISOLOCO_RAY_FT_TIMEOUT_S", "0", "Input should be greater than 0; it takes seconds > 0"),
    ("ISOLOCO_RAY_FT_QUORUM_TIMEOUT_S", "inf", "Input should be a finite number; it takes "
                                               "seconds > 0"),
    ("ISOLOCO_RAY_FT_HEARTBEAT_TIMEOUT_S", "0.1", "Input should be greater than or equal to "
                                                  "0.5; it takes seconds ≥ 0.5"),
    ("ISOLOCO_RAY_RESIZE_CHECK_SECONDS", "-1", "Input should be greater than 0"),
    ("ISOLOCO_RAY_VERIFY_DATA", "sometimes", "it takes once, always or never"),
    ("ISOLOCO_RAY_CACHE", "FILE", "it names a file, not a directory; it takes a directory"),
])
def test_a_bad_environment_variable_is_one_line_naming_it_before_anything_starts(
        monkeypatch, capsys, tmp_path, variable, value, why):
    """Every ISOLOCO_RAY_ variable is read and checked in one place (env_settings.py) before
    a CLI starts anything: one `error:` line naming the variable, its value and what it takes,
    exit status 2, no traceback (train and tune alike)."""
    from isoloco_ray import tune

    if value == "FILE":
        value = str(tmp_path / "a-file")
        (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(variable, value)
    for main, args in ((train.main, ["--model.preset=tiny"]),
                       (tune.main, ["tune_configs/demo_strategies.yaml", "--dry-run"])):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {variable}={value!r}: ") and why in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_muon_is_an_inner_optimizer_with_its_momentum_and_a_stray_momentum_is_refused():
    cfg = load_config(["--inner.optimizer=muon"])
    assert (cfg.inner.optimizer, cfg.inner.muon_momentum) == ("muon", 0.95)
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    assert load_config(["--inner.optimizer=muon", "--inner.muon_momentum=0.9"]
                       ).inner.muon_momentum == 0.9
    assert load_config([]).inner.muon_momentum is None
    with pytest.raises(ConfigError, match=r"^inner.muon_momentum 0.9 has no effect with "
                       r"inner.optimizer adamw: set inner.optimizer=muon, or drop it$"):
        load_config(["--inner.muon_momentum=0.9"])
    with pytest.raises(ConfigError, match=r"inner.optimizer: Input should be 'adamw' or "
                       r"'muon' \(got 'sgd'\)"):
        load_config(["--inner.optimizer=sgd"])
