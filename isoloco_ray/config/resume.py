"""What a resumed run must share with the run that wrote its checkpoint."""

from __future__ import annotations

from typing import Any

from isoloco_ray.config.train_config import TrainConfig
from isoloco_ray.strategies import strategy_options

# What a resumed run must share with the run that wrote its checkpoint: these define the math.
RESUME_MUST_MATCH = ("model", "data", "scaling", "inner", "outer")
# Within those, what a resumed run may change: it moves work between workers, not the math.
RESUME_MAY_CHANGE = ("outer.placement", "model.activation_checkpointing")


def config_differences(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Fields (`section.field`) in which a saved resolved config differs from `current` and
    that a resumed run must not change."""
    now = current.model_dump(mode="json")
    # A setting added since the checkpoint was written is missing from it: the run had its
    # default then (a strategy's option: that of its options model, for the run's R).
    defaults = TrainConfig.model_construct().model_dump(mode="json")
    defaults["outer"].update(strategy_options(current.outer.strategy, {},
                                              current.scaling.replicas))
    differing = [f"{section}.{key}" for section in RESUME_MUST_MATCH for key in now[section]
                 if saved.get(section, {}).get(key, defaults[section].get(key))
                 != now[section][key]
                 and f"{section}.{key}" not in RESUME_MAY_CHANGE]
    return differing + [f"run.{key}" for key in ("rounds", "seed")
                        if saved.get("run", {}).get(key) != now["run"][key]]
