"""The W&B sweep converter, on sweep files written here in the research code's format."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from isoloco_ray import tune
from isoloco_ray.grids.expand import build_trials
from isoloco_ray.grids.spec import GridFile

MAIN_SWEEP = """\
name: main 178M
project: isoloco-paper
method: grid
metric: {goal: minimize, name: val_loss}
program: train.py
command:
  - ${env}
  - torchrun
  - --standalone
  - --nproc_per_node=4
  - ${program}
  - ${args}
parameters:
  strategy: {values: [adam_baseline, diloco_baseline, diloco_sgd_noMom, isocloco, isoloco,
                      isoctsloco, tsvloco]}
  inner_learning_rate: {value: 1.38e-3}
  outer_learning_rate: {value: 0.7}
  outer_momentum: {value: 0.9}
  outer_nesterov: {value: "true"}
  inner_beta2: {value: 0.95}
  weight_decay: {value: 0.1}
  warmup_steps: {value: 0.1}
  inner_steps: {value: 30}
  batch_size: {value: 32}
  micro_batch_size: {value: 16}
  token_budget: {value: 3552440320}
  virtual_workers: {value: 2}
  hparams_file: {value: configs/178M/hparams.json}
  use_compile: {value: "true"}
  tsv_singular_ratio: {value: 0.125}
  tsv_decorrelate: {value: "true"}
  orthogonalize_object: {value: gradient}
  common_space_fraction: {value: 0.8}
  seed: {values: [0, 1]}
  shards_path: {value: $DATA_DIR/fineweb}
  save_path: {value: $SAVE_DIR}
  mystery_knob: {value: 3}
"""

MERGE_SWEEP = """\
name: merging
project: isoloco-paper
method: grid
metric: {goal: minimize, name: val_loss}
program: train.py
command:
  - torchrun
  - --nproc_per_node
  - 4
  - ${program}
  - ${args}
parameters:
  strategy: {value: mergeloco}
  inner_learning_rate: {value: 2e-3}
  outer_learning_rate: {value: 1.5}
  sparsity: {value: 0.1}
  prune_method: {values: [magnitude, random]}
  prune_dimension: {value: all}
  rescale_pruned: {values: ["false", "true"]}
  ties_disjoint: {values: ["true", "false"]}
  warmup_steps: {value: 45}
  inner_steps: {value: 30}
  batch_size: {value: 32}
  sequence_length: {value: 1024}
  token_budget: {value: 3552440320}
  virtual_workers: {value: 2}
  hparams_file: {value: /home/me/isoloco/hparams/512M/config.json}
"""

LR_SWEEP = """\
name: lr_grid
method: grid
metric: {goal: minimize, name: val_loss}
command:
  - torchrun
  - --nproc-per-node=2
  - ${program}
parameters:
  strategy: {value: diloco_baseline}
  inner_learning_rate: {values: [1e-3, 2e-3]}
  outer_learning_rate: {values: [0.5, 0.7]}
  hparams_file: {value: hp/178M/x.json}
  virtual_workers: {value: 4}
"""


def convert(tmp_path: Path, text: str, capsys) -> tuple[dict, str, str]:
    """(grid file mapping, its YAML text, stderr) of converting `text` through the CLI."""
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    assert tune.main(["--from-wandb-sweep", str(path)]) == 0
    out, err = capsys.readouterr()
    return yaml.safe_load(out), out, err


def trials_of(grid: dict, tmp_path: Path, monkeypatch) -> list:
    """The converted grid's trials, validated as TrainConfigs (data not read)."""
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SAVE_DIR", str(tmp_path / "save"))
    return build_trials(GridFile.model_validate(grid), {}, tmp_path / "grid")


def test_every_key_maps_and_env_references_are_kept(tmp_path, capsys, monkeypatch):
    grid, text, err = convert(tmp_path, MAIN_SWEEP, capsys)
    assert "$DATA_DIR/fineweb" in text and "$SAVE_DIR" in text  # kept for the tune CLI
    assert "warning: unknown sweep parameters left out: mystery_knob" in err
    assert "use_compile: left out" in err
    assert grid["name"] == "main_178M"
    assert grid["metric"] == {"name": "final_eval_loss", "mode": "min"}
    base = grid["base"]
    assert base["data"] == {"seq_len": 2048, "batch_size": 32, "micro_batch_size": 16,
                            "path": "$DATA_DIR/fineweb"}
    assert base["scaling"] == {"use_gpu": True, "replicas": 8, "replicas_per_worker": 2}
    assert base["model"] == {"preset": "178M"}
    assert base["inner"] == {"betas": [0.9, 0.95], "weight_decay": 0.1, "warmup": 0.1,
                             "steps": 30}
    assert base["run"] == {"token_budget": 3552440320, "storage_path": "$SAVE_DIR",
                           "wandb": {"project": "isoloco-paper"}}

    trials = trials_of(grid, tmp_path, monkeypatch)
    assert len(trials) == 14  # 7 strategies x 2 seeds
    by_strategy = {t.config.outer.strategy: t for t in trials if t.config.run.seed == 1}
    assert list(by_strategy) == ["adamw_ddp", "diloco", "diloco_sgd", "isoc", "isoloco",
                                 "isocts", "tsv"]
    adam = by_strategy["adamw_ddp"]
    assert adam.config.inner.lr == 0.7  # the baseline's AdamW lr is outer_learning_rate
    assert "outer.lr" not in adam.overrides and "outer.momentum" not in adam.overrides
    diloco = by_strategy["diloco"].config
    assert (diloco.inner.lr, diloco.outer.lr, diloco.outer.momentum, diloco.outer.nesterov) == (
        1.38e-3, 0.7, 0.9, True)
    assert by_strategy["diloco_sgd"].config.outer.momentum == 0.0  # noMom: sweep's not applied
    assert by_strategy["isoloco"].config.outer.orthogonalize == "gradient"
    assert by_strategy["isocts"].config.outer.common_fraction == 0.8
    tsv = by_strategy["tsv"].config.outer
    assert (tsv.keep_fraction, tsv.decorrelate, tsv.momentum) == (0.125, True, 0.0)
    assert by_strategy["isocts"].config.outer.momentum == 0.9  # optional momentum: kept
    assert "note: parameters.outer_momentum does not apply to adamw_ddp, diloco_sgd, isoc, " \
           "tsv" in err
    assert all(t.config.data.path == str(tmp_path / "data" / "fineweb") for t in trials)


def test_mergeloco_is_dare_only_when_random_rescaled_and_not_disjoint(tmp_path, capsys,
                                                                       monkeypatch):
    grid, _, err = convert(tmp_path, MERGE_SWEEP, capsys)
    assert "warning" not in err
    assert grid["base"]["model"] == {"preset": "512M"}
    assert grid["base"]["data"]["seq_len"] == 1024
    assert grid["base"]["inner"]["lr"] == 2e-3  # "2e-3" is a string in YAML; parsed
    # warmup_steps >= 1: steps over all inner steps; rounds = budget // (32·1024·30·8) = 451.
    assert grid["base"]["inner"]["warmup"] == pytest.approx(45 / (451 * 30), abs=1e-6)
    trials = trials_of(grid, tmp_path, monkeypatch)
    assert len(trials) == 8
    dare = [t.config.outer for t in trials if t.config.outer.strategy == "dare"]
    assert len(dare) == 1
    assert (dare[0].prune, dare[0].rescale, dare[0].disjoint) == ("random", True, False)
    assert {t.config.outer.strategy for t in trials} == {"ties", "dare"}


def test_independent_values_become_a_grid(tmp_path, capsys, monkeypatch):
    grid, _, err = convert(tmp_path, LR_SWEEP, capsys)
    assert grid["grid"] == {"inner.lr": [1e-3, 2e-3], "outer.lr": [0.5, 0.7]}
    assert "trials" not in grid
    assert grid["base"]["scaling"]["replicas"] == 8  # 2 processes x 4 virtual workers
    assert "warning" not in err  # optional keys missing: no noise
    assert len(trials_of(grid, tmp_path, monkeypatch)) == 4


def test_a_sweep_without_shards_path_reads_the_research_codes_data(tmp_path, capsys,
                                                                  monkeypatch):
    """No shards_path: the research code's default directory, said in the file's header; the
    converted 178M grid dry-runs without DATA_DIR (a warning), never against the demo corpus."""
    grid, text, err = convert(tmp_path, MERGE_SWEEP.replace("512M", "178M"), capsys)
    default = "$DATA_DIR/dclm_tokenized-train_valid_test"
    assert grid["base"]["data"]["path"] == default
    header = text.split("\nname:")[0]
    assert f"# data.path: the sweep sets no shards_path; {default}" in header
    assert f"note: data.path: the sweep sets no shards_path; {default}" in err
    converted = tmp_path / "merging.yaml"
    converted.write_text(text)
    monkeypatch.delenv("DATA_DIR", raising=False)
    assert tune.main([str(converted), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "names the unset environment variable DATA_DIR" in out + err
    assert "demo" not in out + err and "blocks (128 tokens)" not in out + err


def test_a_grid_of_a_large_model_without_data_path_is_refused(tmp_path, capsys, no_ray):
    """The demo corpus is for the tiny and demo models: a 178M grid without data.path is an
    error naming data.path, in a dry run too, and so is a 178M run of the train CLI."""
    from isoloco_ray import train

    grid = tmp_path / "big.yaml"
    grid.write_text("base:\n  model: {preset: 178M}\ngrid:\n  outer.lr: [0.5, 0.7]\n")
    assert tune.main([str(grid), "--dry-run"]) == 2
    message = "data.path: unset, and the demo corpus is for the tiny and demo models, not " \
              "model.preset 178M; set data.path to a prepared dataset"
    assert message in capsys.readouterr().err
    assert train.main(["--model.preset=178M"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (("{value: mergeloco}", "{min: 0, max: 1}"), "parameters.strategy: expected {value: X}"),
    (("{value: mergeloco}", "{value: sgd_magic}"), "unknown strategy 'sgd_magic'"),
    (("{value: all}", "{value: diagonal}"), "parameters.prune_dimension: unknown value"),
])
def test_unconvertible_sweeps_exit_2(tmp_path, capsys, change, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(MERGE_SWEEP.replace(*change))
    assert tune.main(["--from-wandb-sweep", str(path)]) == 2
    assert message in capsys.readouterr().err
