"""What several test files share: a tiny run's flags, grid files, strict JSON, a started grid."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from isoloco_ray import tune
from isoloco_ray.data import checks
from isoloco_ray.data.format import DatasetMeta

# A tiny run on the tests' small dataset (conftest.small_dataset): the tiny Llama, sequences of
# 64 tokens in batches of 4; each test adds the layout and length it needs.
TINY_RUN = ["--model.preset=tiny", "--data.seq_len=64", "--data.batch_size=4"]


def learning_flags(strategy: str) -> list[str]:
    """`--outer.strategy=strategy`, for a tiny run of a few rounds that must learn visibly.
    A strategy whose own wire sends a top-k share (sparseloco: 3% of each chunk a round, the
    rest later through its residual, after inner steps at its paper's lr of 1e-3) moves too
    little in a few rounds for that: it gets a quarter of each chunk and inner lr 2e-3."""
    from isoloco_ray.strategies import STRATEGIES

    if "topk" not in STRATEGIES[strategy].wire:
        return [f"--outer.strategy={strategy}"]
    return [f"--outer.strategy={strategy}", "--outer.topk=0.25", "--inner.lr=2e-3"]

# check_training_data's settings that the small dataset passes.
DATA_OK = dict(model_vocab_size=None, seq_len=64, replicas=2, batch_size=4)

TUNE_CONFIGS = Path(__file__).resolve().parent.parent / "tune_configs"


def write_grid(tmp_path: Path, data_dir: Path, **sections) -> Path:
    """A grid file on `data_dir` with a tiny base; `sections` replace or extend it."""
    grid = {"base": {"model": {"preset": "tiny"},
                     "data": {"path": str(data_dir), "seq_len": 64, "batch_size": 4},
                     "scaling": {"replicas": 2, "replicas_per_worker": 2},
                     "inner": {"steps": 3},
                     "run": {"rounds": 2, "eval_every": 1, "eval_tokens": 2048,
                             "storage_path": str(tmp_path / "grids")}}}
    grid.update(sections)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return path


def strict_json(path: Path) -> object:
    """The JSON in `path`, refusing NaN, Infinity and -Infinity."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}: not strict JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def started_grid(tmp_path: Path, data_dir: Path, names: list[str]) -> tuple[Path, Path]:
    """A grid interrupted after its first run wrote grid.json: the grid file and the grid
    directory. Trial 0 finished, trial 1 failed, the others never started."""
    path = write_grid(tmp_path, data_dir, name="shared",
                      trials=[{"outer.strategy": strategy} for strategy in names],
                      resources={"trial_cpus": 0.5, "max_concurrent": 1})
    grid = yaml.safe_load(path.read_text())
    grid["base"]["scaling"]["cpus_per_worker"] = 0.5
    path.write_text(yaml.safe_dump(grid))
    plan = tune.plan_grid(path, [])
    plan.grid_dir.mkdir(parents=True)
    (plan.grid_dir / "grid.json").write_text(json.dumps(plan.manifest(1)))
    done, failed = (trial.run_dir for trial in plan.trials[:2])
    done.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps(
        {"strategy": names[0], "tokens": 1536, "final_eval_loss": 5.0,
         "final_eval_perplexity": math.exp(5.0), "seconds": 1.0}))
    failed.mkdir(parents=True)
    (failed / "error.txt").write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    return path, plan.grid_dir


def check(data_dir: Path, **settings: object) -> None:
    """check_training_data of `data_dir` with DATA_OK, `settings` changed."""
    checks.check_training_data(data_dir, DatasetMeta.load(data_dir), **{**DATA_OK, **settings})


def truncate(path: Path) -> None:
    """Damage a file as a crash during its write would: its last 100 bytes gone."""
    path.write_bytes(path.read_bytes()[:-100])
