"""The outer optimizer: heavy-ball / Nesterov momentum exactly as torch.optim.SGD, optionally
followed by ISO-C of the update (docs/strategies.md, "Outer momentum"; IsoLoCo's "update"
ordering)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from isoloco_ray.aggregators.checks import check_bool
from isoloco_ray.aggregators.isoc import isoc


class OuterOptimizer:
    """θ ← θ − lr·u for each parameter tensor, u built from its merged direction g:

    - momentum μ > 0: buf ← μ·buf + g (buf starts at 0, so the first buf is g);
      u = g + μ·buf with Nesterov, else u = buf. Otherwise u = g.
    - orthogonalize_update and a 2-D tensor: u ← ISO-C(u) (momentum first, then ISO-C).

    torch.optim.SGD semantics without dampening or weight decay; momentum buffers are kept in
    float32, one per parameter name, and are part of `state_dict`.
    """

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 orthogonalize_update: bool = False) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0; got {lr!r}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum must be >= 0; got {momentum!r}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov needs momentum > 0")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = check_bool("nesterov", nesterov)
        self.orthogonalize_update = check_bool("orthogonalize_update", orthogonalize_update)
        self.steps = 0
        self.buffers: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, params: Mapping[str, Tensor], directions: Mapping[str, Tensor]) -> None:
        """Update every tensor of `params` in place from `directions` (same names, same shapes)."""
        if set(params) != set(directions):
            missing = sorted(set(params) ^ set(directions))
            raise ValueError(f"params and directions must have the same names; differing: "
                             f"{missing}")
        for name, param in params.items():
            if directions[name].shape != param.shape:
                raise ValueError(f"direction {name!r} has shape {tuple(directions[name].shape)}, "
                                 f"the parameter {tuple(param.shape)}")
        self.apply(params, {name: self.update(name, directions[name].to(param.device))
                            for name, param in params.items()})

    @torch.no_grad()
    def update(self, name: str, direction: Tensor) -> Tensor:
        """The float32 update u of one tensor from its merged direction g, advancing its
        momentum buffer. `step` is `update` for every tensor, then `apply`; calling them
        apart lets each tensor's update be computed where its momentum lives (one owner rank)."""
        g = direction.to(torch.float32)
        u = g
        if self.momentum > 0.0:
            buf = self.buffers.get(name)
            if buf is None:
                buf = self.buffers[name] = g.clone()
            else:
                if buf.device != g.device:  # e.g. loaded from a checkpoint on CPU
                    buf = self.buffers[name] = buf.to(g.device)
                buf.mul_(self.momentum).add_(g)
            u = g.add(buf, alpha=self.momentum) if self.nesterov else buf.clone()
        if self.orthogonalize_update and u.dim() == 2:
            u = isoc(u)
        return u

    @torch.no_grad()
    def apply(self, params: Mapping[str, Tensor], updates: Mapping[str, Tensor]) -> None:
        """θ ← θ − lr·u for every tensor of `params` (in place); counts one step."""
        for name, param in params.items():
            param.add_(updates[name].to(device=param.device, dtype=param.dtype), alpha=-self.lr)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and step count (JSON-able) and "buffers": {name: float32 CPU
        tensor} (copies, safetensors-ready; moved back to the parameter's device on use)."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "orthogonalize_update": self.orthogonalize_update,
            "step": self.steps,
            "buffers": {name: buf.detach().to("cpu", copy=True)
                        for name, buf in self.buffers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore exactly what `state_dict` returned (hyperparameters included)."""
        restored = OuterOptimizer(state["lr"], state["momentum"], state["nesterov"],
                                  state.get("orthogonalize_update", False))
        self.lr, self.momentum = restored.lr, restored.momentum
        self.nesterov, self.orthogonalize_update = restored.nesterov, restored.orthogonalize_update
        self.steps = int(state["step"])
        self.buffers = {name: torch.as_tensor(buf).detach().to(torch.float32).clone()
                        for name, buf in state["buffers"].items()}
