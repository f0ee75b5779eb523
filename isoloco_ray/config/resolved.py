"""What validation settles, typed as set: the values a config may leave unset for a preset,
the strategy or the token budget to decide.

The sections keep those fields optional, because "unset" is a setting (`--outer.lr=null`: the
strategy's paper value; `--model.hidden_size=null`: the preset's). Validation fills every one of
them (`TrainConfig._resolve`, `ModelConfig._fill_from_preset`,
`DataConfig._check_micro_batch`), and the workers read them through `TrainConfig.resolved`,
`ModelConfig.shape` or `settled`: no worker handles an unset value, and a config that skipped
validation (`model_construct`) is refused by field name instead of failing as a None deep
inside training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def settled(value: T | None, field: str) -> T:
    """`value`, which validation has set; ValueError naming `field` if it is still unset."""
    if value is None:
        raise ValueError(f"{field} is unset: build the config with TrainConfig.model_validate "
                         "(or isoloco_ray.config.build_config), which fills it")
    return value


@dataclass(frozen=True)
class ModelShape:
    """The Llama's sizes once its preset is applied. `vocab_size` stays optional: unset, the
    data's tokenizer decides it (meta.json)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int
    vocab_size: int | None


@dataclass(frozen=True)
class Resolved:
    """The settled values the workers read of a whole TrainConfig (those of one section are
    read where the section is: `ModelConfig.shape`, `settled(inner.lr, "inner.lr")`)."""

    rounds: int  # run.rounds, or the token budget's
    micro_batch_size: int  # data.micro_batch_size, or the batch size (whole for one worker)
