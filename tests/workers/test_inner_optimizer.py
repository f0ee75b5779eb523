"""The inner optimizer (workers/inner_optimizer.py): Muon on the hidden matrices and AdamW on the
rest, as one optimizer that one LR schedule drives, equal to torch's two optimizers stepped
side by side; its state through a checkpoint file and back."""

from __future__ import annotations

import io

import pytest
import torch

from isoloco_ray.config import load_config
from isoloco_ray.workers.inner_optimizer import (
    MuonAdamW,
    make_inner_optimizer,
    muon_takes,
    schedule_at,
    warmup_cosine,
)
from isoloco_ray.workers.model import build_model

MUON = ["--model.preset=tiny", "--inner.optimizer=muon", "--inner.lr=0.01",
        "--inner.weight_decay=0.1"]
VOCAB = 64


def model_and_batches(seed: int = 0, steps: int = 6) -> tuple[torch.nn.Module, list]:
    cfg = load_config(MUON)
    model = build_model(cfg.model, VOCAB, seed)
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(steps)]
    return model, batches


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedules: list,
          batches: list) -> None:
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        for schedule in schedules:
            schedule.step()


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model, _ = model_and_batches()
    muon = {name for name, p in model.named_parameters() if muon_takes(name, p.shape)}
    adamw = {name for name, p in model.named_parameters()} - muon
    assert muon and all(p.dim() == 2 for name, p in model.named_parameters() if name in muon)
    assert {name.rsplit(".", 2)[-2] for name in muon} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert "model.embed_tokens.weight" in adamw and "lm_head.weight" in adamw
    assert all("norm" in name for name in adamw - {"model.embed_tokens.weight",
                                                   "lm_head.weight"})


def test_one_schedule_over_muon_and_adamw_is_both_optimizers_stepped_side_by_side():
    """MuonAdamW with one warmup-cosine schedule ends bit for bit where torch.optim.Muon over
    the matrices and torch.optim.AdamW over the rest end, each with its own schedule."""
    cfg = load_config(MUON + ["--inner.warmup=0.5"])
    total = 6
    model, batches = model_and_batches(steps=total)
    optimizer, schedule = make_inner_optimizer(model, cfg.inner, total)
    assert isinstance(optimizer, MuonAdamW)
    train(model, optimizer, [schedule], batches)

    reference, _ = model_and_batches(steps=total)
    named = list(reference.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if muon_takes(n, p.shape)], lr=0.01,
                            weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for n, p in named if not muon_takes(n, p.shape)], lr=0.01,
                              betas=(0.9, 0.95), weight_decay=0.1)
    schedules = [torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: warmup_cosine(step, total, 0.5)) for opt in (muon, adamw)]

    class Both:
        def zero_grad(self, set_to_none: bool = True) -> None:
            reference.zero_grad(set_to_none=set_to_none)

        def step(self) -> None:
            muon.step()
            adamw.step()

    train(reference, Both(), schedules, batches)  # type: ignore[arg-type]
    for (name, mine), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(mine, theirs), name
    assert [g["lr"] for g in optimizer.param_groups] == [
        muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]]


def test_its_state_goes_through_a_weights_only_file_and_training_goes_on_bit_for_bit():
    """Saved after 3 steps (torch.save, loaded with weights_only=True as checkpoints are) into
    a fresh optimizer and schedule, the next 3 steps are those of the run that never stopped;
    schedule_at and `state.clear` reach both optimizers."""
    cfg = load_config(MUON)
    whole, batches = model_and_batches()
    optimizer, schedule = make_inner_optimizer(whole, cfg.inner, 6)
    train(whole, optimizer, [schedule], batches)

    model, _ = model_and_batches()
    optimizer, schedule = make_inner_optimizer(model, cfg.inner, 6)
    train(model, optimizer, [schedule], batches[:3])
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, _ = model_and_batches()
    resumed.load_state_dict(model.state_dict())
    optimizer, schedule = make_inner_optimizer(resumed, cfg.inner, 6)
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    train(resumed, optimizer, [schedule], batches[3:])
    for (name, mine), (_, theirs) in zip(resumed.named_parameters(), whole.named_parameters()):
        assert torch.equal(mine, theirs), name

    # Every parameter's state read through the joint view, each in its own optimizer only.
    assert all(optimizer.state[p] for p in resumed.parameters())
    matrices = {id(p) for n, p in resumed.named_parameters() if muon_takes(n, p.shape)}
    assert {id(p) for p in optimizer.muon.state} == matrices
    assert not matrices & {id(p) for p in optimizer.adamw.state}
    schedule_at(optimizer, schedule, 0)
    assert {g["lr"] for g in optimizer.muon.param_groups + optimizer.adamw.param_groups} == {
        0.01 * warmup_cosine(0, 6, cfg.inner.warmup)}
    optimizer.state.clear()
    assert not optimizer.muon.state and not optimizer.adamw.state


def test_an_adamw_state_is_refused_by_muon_with_the_reason():
    cfg = load_config(MUON)
    model, _ = model_and_batches()
    optimizer, _ = make_inner_optimizer(model, cfg.inner, 6)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="another inner.optimizer"):
        optimizer.load_state_dict(adamw.state_dict())
