"""A replica's inner optimizer (`inner.optimizer`) and its warmup-cosine LR schedule.

`adamw`: AdamW over every parameter. `muon`: torch.optim.Muon over the hidden weight matrices
(every 2-D parameter but the token embedding and the output head, as Muon's authors and
MuLoCo use it), AdamW over the rest, as one `MuonAdamW` optimizer: one LR schedule drives
both, and one state_dict holds both. Muon's step is scaled to AdamW's update RMS
(adjust_lr_fn "match_rms_adamw", Moonshot's "Muon is Scalable for LLM Training"), so both
take `inner.lr` and `inner.weight_decay`.
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from isoloco_ray.config import InnerConfig, settled

# Parameters of a Llama model that Muon never takes: they are looked up (the embedding) or
# project onto the vocabulary (the head), not hidden linear maps.
NOT_MUON = ("embed_tokens", "lm_head")


def warmup_cosine(step: int, total_steps: int, warmup_fraction: float) -> float:
    """LR multiplier (docs/strategies.md): linear warmup from 0.1x, then cosine down to 0.1x
    at the end."""
    warmup_steps = int(warmup_fraction * total_steps)
    if step < warmup_steps:
        return 0.1 + 0.9 * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def muon_takes(name: str, shape: Sequence[int]) -> bool:
    """Whether `inner.optimizer: muon` steps parameter `name` of `shape` with Muon (else
    AdamW): the hidden weight matrices."""
    return len(shape) == 2 and not any(part in name for part in NOT_MUON)


class _JointState(ChainMap[Any, Any]):
    """Both optimizers' per-parameter state, read as one; `clear` forgets both."""

    def __getitem__(self, key: Any) -> Any:
        # Not ChainMap's: a lookup in an optimizer's defaultdict would add the key to it.
        for state in self.maps:
            if key in state:
                return state[key]
        raise KeyError(key)

    def clear(self) -> None:
        for state in self.maps:
            state.clear()


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `matrices`, torch.optim.AdamW over `others`, as one optimizer:
    its `param_groups` are theirs (a schedule that sets a group's lr sets theirs), `step` and
    `zero_grad` take both, and `state_dict` is {"muon": ..., "adamw": ...}."""

    def __init__(self, matrices: Iterable[nn.Parameter], others: Iterable[nn.Parameter], *,
                 lr: float, betas: tuple[float, float], weight_decay: float, momentum: float,
                 fused: bool = False) -> None:
        self.muon = torch.optim.Muon(list(matrices), lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, nesterov=True,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(list(others), lr=lr, betas=betas,
                                       weight_decay=weight_decay, fused=fused or None)
        # Optimizer.__init__ keeps the group dicts it is given: the same objects as theirs.
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Point this optimizer's groups and state at the two optimizers' (again after a load,
        which gives them new ones)."""
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        # Where Optimizer keeps its state dict: the joint view of theirs.
        self.state = _JointState(self.muon.state, self.adamw.state)  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("not a MuonAdamW state (a dict of muon and adamw states): the "
                             "checkpoint was written with another inner.optimizer")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self._link()


def make_inner_optimizer(model: nn.Module, inner: InnerConfig, total_steps: int,
                         fused: bool = False
                         ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """`inner.optimizer` over `model`'s parameters, with the warmup-cosine schedule over
    `total_steps`."""
    lr = settled(inner.lr, "inner.lr")
    weight_decay = settled(inner.weight_decay, "inner.weight_decay")
    optimizer: torch.optim.Optimizer
    if inner.optimizer == "muon":
        named = list(model.named_parameters())
        optimizer = MuonAdamW(
            [p for name, p in named if muon_takes(name, p.shape)],
            [p for name, p in named if not muon_takes(name, p.shape)],
            lr=lr, betas=inner.betas, weight_decay=weight_decay,
            momentum=settled(inner.muon_momentum, "inner.muon_momentum"), fused=fused)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=inner.betas,
                                      weight_decay=weight_decay, fused=fused or None)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, total_steps, inner.warmup))
    return optimizer, schedule


def schedule_at(optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LambdaLR,
                steps_done: int) -> None:
    """Put `schedule` (and `optimizer`'s lr) where `steps_done` of its steps leave it, bit for
    bit: LambdaLR sets lr = base_lr · λ(step) afresh at every step."""
    schedule.last_epoch = steps_done
    lrs = [base * factor(steps_done)
           for base, factor in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    schedule._last_lr = lrs  # what get_last_lr() reports, as after a step
