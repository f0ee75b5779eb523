"""Optional Weights & Biases logging of runs and Tune trials.

Logging is on only when `run.wandb.project` is set; otherwise nothing here imports `wandb` or
contacts W&B. A single run logs from the driver (the progress follower sees every round's
metrics, so no code runs in the Ray Train workers); Tune trials log through Ray's own
`WandbLoggerCallback`. `WANDB_MODE=offline` (or `run.wandb.mode: offline`) keeps everything
local: W&B writes the run under the run directory, for `wandb sync` later.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from isoloco_ray.config import ConfigError, TrainConfig, WandbConfig

INSTALL_HINT = "pip install 'isoloco_ray[wandb]'"


def wandb_enabled(wandb_cfg: WandbConfig) -> bool:
    """Whether this config asks for W&B logging."""
    return wandb_cfg.project is not None


def check_wandb_available(cfg: TrainConfig) -> None:
    """ConfigError when W&B logging is asked for but the package is missing (checked before
    anything starts, like every other configuration error)."""
    if wandb_enabled(cfg.run.wandb) and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"run.wandb.project is set but the wandb package is not installed; "
                          f"{INSTALL_HINT}, or leave run.wandb.project unset")


def wandb_mode(wandb_cfg: WandbConfig) -> str | None:
    """The W&B mode to use: the config's, else WANDB_MODE, else None (wandb's default)."""
    return wandb_cfg.mode or os.environ.get("WANDB_MODE") or None


def wandb_init_kwargs(wandb_cfg: WandbConfig) -> dict[str, Any]:
    """The `wandb.init` arguments the config sets (project, entity, tags, mode)."""
    kwargs: dict[str, Any] = {"project": wandb_cfg.project}
    if wandb_cfg.entity:
        kwargs["entity"] = wandb_cfg.entity
    if wandb_cfg.tags:
        kwargs["tags"] = list(wandb_cfg.tags)
    mode = export_wandb_mode(wandb_cfg)
    if mode:
        kwargs["mode"] = mode
    return kwargs


def export_wandb_mode(wandb_cfg: WandbConfig) -> str | None:
    """Set WANDB_MODE to the mode in use and return it: Ray's W&B integration asks for an API
    key unless WANDB_MODE itself says offline (also when a grid is resumed)."""
    mode = wandb_mode(wandb_cfg)
    if mode and wandb_enabled(wandb_cfg):
        os.environ["WANDB_MODE"] = mode
    return mode


def wandb_run_id(name: str) -> str:
    """A W&B run id from a run name: stable, so reusing the name resumes the same W&B run."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)[:64]


class RunLogger:
    """Logs one run's per-round metrics and final summary to W&B from the driver.

    A no-op when `run.wandb.project` is unset; use as a context manager so the W&B run is
    finished (and, offline, its files complete) even when training fails.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        self.run: Any = None
        if not wandb_enabled(cfg.run.wandb):
            return
        import wandb

        name = cfg.run.name or run_dir.name
        self.run = wandb.init(
            **wandb_init_kwargs(cfg.run.wandb), group=cfg.run.wandb.group, name=name,
            id=wandb_run_id(name), resume="allow",
            # W&B keeps its files locally: in the run directory, or its default for a URI.
            dir=str(run_dir) if isinstance(run_dir, Path) else None,
            config=cfg.model_dump(mode="json"))

    def log(self, metrics: dict[str, Any]) -> None:
        """One report of the training loop (one outer round, or the initial evaluation)."""
        if self.run is not None:
            self.run.log(metrics, step=metrics.get("round"))

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        """Record the run's summary (final figures) and close the W&B run."""
        if self.run is None:
            return
        if summary:
            self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary is not None else 1)
        self.run = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def tune_wandb_callback(wandb_cfg: WandbConfig, grid_name: str) -> Any:
    """Ray Tune's W&B logger for a grid (one W&B run per trial, grouped by grid), or None."""
    if not wandb_enabled(wandb_cfg):
        return None
    from ray.air.integrations.wandb import WandbLoggerCallback

    return WandbLoggerCallback(group=wandb_cfg.group or grid_name,
                               **wandb_init_kwargs(wandb_cfg))
