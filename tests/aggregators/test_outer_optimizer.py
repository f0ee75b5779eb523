"""OuterOptimizer: torch.optim.SGD semantics, ISO-C of the update, exact save / resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from isoloco_ray.aggregators import OuterOptimizer, isoc

# Small matrices: one thread is faster, and immune to a busy machine's oversubscription.
pytestmark = pytest.mark.usefixtures("one_thread")


SHAPES = {"w": (12, 8), "v": (8, 12), "b": (8,)}


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def directions(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.8, True)])
def test_matches_torch_sgd(momentum, nesterov):
    ours = make_params()
    theirs = {name: p.clone().requires_grad_(True) for name, p in make_params().items()}
    sgd = torch.optim.SGD(list(theirs.values()), lr=0.7, momentum=momentum, nesterov=nesterov)
    opt = OuterOptimizer(lr=0.7, momentum=momentum, nesterov=nesterov)
    for step in range(5):
        d = directions(step)
        for name, p in theirs.items():
            p.grad = d[name].clone()
        sgd.step()
        opt.step(ours, d)
    for name in SHAPES:
        assert torch.equal(ours[name], theirs[name].detach()), name
    assert opt.steps == 5


def test_orthogonalize_update_is_momentum_then_isoc():
    params = make_params()
    expected = {name: p.clone() for name, p in params.items()}
    opt = OuterOptimizer(lr=1.8, momentum=0.8, nesterov=True, orthogonalize_update=True)
    buf: dict[str, torch.Tensor] = {}
    for step in range(3):
        d = directions(step)
        opt.step(params, d)
        for name, g in d.items():
            buf[name] = g.clone() if name not in buf else 0.8 * buf[name] + g
            u = g + 0.8 * buf[name]
            expected[name] -= 1.8 * (isoc(u) if u.dim() == 2 else u)
    for name in SHAPES:
        assert torch.allclose(params[name], expected[name], rtol=1e-5, atol=1e-6), name


def test_resume_is_bit_identical(tmp_path):
    def run(steps: range, opt: OuterOptimizer, params: dict[str, torch.Tensor]) -> None:
        for step in steps:
            opt.step(params, directions(step))

    uninterrupted = make_params()
    run(range(4), OuterOptimizer(0.7, 0.9, nesterov=True, orthogonalize_update=True),
        uninterrupted)

    params = make_params()
    opt = OuterOptimizer(0.7, 0.9, nesterov=True, orthogonalize_update=True)
    run(range(2), opt, params)
    state = opt.state_dict()
    buffers = state.pop("buffers")
    save_file(buffers, tmp_path / "outer.safetensors")
    (tmp_path / "outer.json").write_text(json.dumps(state))
    run(range(2, 3), opt, params)  # must not touch the saved state
    assert torch.equal(load_file(tmp_path / "outer.safetensors")["w"], buffers["w"])

    restored = OuterOptimizer(lr=0.1)
    loaded = json.loads((tmp_path / "outer.json").read_text())
    loaded["buffers"] = load_file(tmp_path / "outer.safetensors")
    restored.load_state_dict(loaded)
    assert (restored.lr, restored.momentum, restored.nesterov, restored.steps) == (0.7, 0.9,
                                                                                    True, 2)
    resumed = make_params()
    run(range(2), OuterOptimizer(0.7, 0.9, nesterov=True, orthogonalize_update=True), resumed)
    run(range(2, 4), restored, resumed)
    for name in SHAPES:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    assert all(b.dtype == torch.float32 for b in restored.state_dict()["buffers"].values())


def test_bad_arguments():
    with pytest.raises(ValueError, match="same names"):
        OuterOptimizer(0.5).step(make_params(), {"w": torch.zeros(12, 8)})
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        OuterOptimizer(0.5, nesterov=True)
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        OuterOptimizer(0.5, momentum=-0.1)
