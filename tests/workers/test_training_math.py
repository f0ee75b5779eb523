"""The training math without Ray: the outer step by hand, and layout invariance over gloo."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY_RUN, learning_flags
from isoloco_ray.config import load_config
from isoloco_ray.strategies import STRATEGIES
from isoloco_ray.workers.local import run_local
from isoloco_ray.workers.outer.step import OuterSync

# Every strategy with an outer step, from the registry (a new one is tested by name here).
OUTER_STEP_STRATEGIES = [name for name, spec in STRATEGIES.items() if spec.has_outer_step]


def test_diloco_outer_steps_match_hand_computed_nesterov():
    cfg = load_config(["--scaling.replicas=2", "--scaling.replicas_per_worker=2"])
    sync = OuterSync(cfg.outer, replicas=2, seed=0)  # diloco: lr 0.7, momentum 0.9, nesterov
    theta = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5, -0.5])}
    round1 = {0: {"w": torch.tensor([[0.2, 0.0], [0.0, 0.4]]), "b": torch.tensor([0.1, 0.0])},
              1: {"w": torch.tensor([[0.0, 0.2], [0.2, 0.0]]), "b": torch.tensor([0.3, 0.2])}}
    sync.step(theta, round1, round_index=0)
    # g1 = mean = [[.1,.1],[.1,.2]], [.2,.1]; buf = g1; u = g1 + .9 g1 = 1.9 g1; θ -= .7 u
    g1w, g1b = torch.tensor([[0.1, 0.1], [0.1, 0.2]]), torch.tensor([0.2, 0.1])
    expected_w = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) - 0.7 * 1.9 * g1w
    expected_b = torch.tensor([0.5, -0.5]) - 0.7 * 1.9 * g1b
    torch.testing.assert_close(theta["w"], expected_w)
    torch.testing.assert_close(theta["b"], expected_b)
    round2 = {0: {"w": torch.ones(2, 2), "b": torch.zeros(2)},
              1: {"w": -torch.ones(2, 2) * 0.5, "b": torch.ones(2)}}
    sync.step(theta, round2, round_index=1)
    # g2 = [[.25]*2]*2, [.5,.5]; buf = .9 g1 + g2; u = g2 + .9 buf
    g2w, g2b = torch.full((2, 2), 0.25), torch.full((2,), 0.5)
    expected_w -= 0.7 * (g2w + 0.9 * (0.9 * g1w + g2w))
    expected_b -= 0.7 * (g2b + 0.9 * (0.9 * g1b + g2b))
    torch.testing.assert_close(theta["w"], expected_w)
    torch.testing.assert_close(theta["b"], expected_b)


def test_diloco_sgd_is_plain_mean_step():
    cfg = load_config(["--outer.strategy=diloco_sgd", "--outer.lr=0.5"])
    sync = OuterSync(cfg.outer, replicas=4, seed=0)
    theta = {"w": torch.zeros(3, 2)}
    deltas = {r: {"w": torch.full((3, 2), float(r))} for r in range(4)}
    sync.step(theta, deltas, round_index=0)
    torch.testing.assert_close(theta["w"], torch.full((3, 2), -0.5 * 1.5))


TINY = TINY_RUN + ["--scaling.replicas=2", "--inner.steps=3", "--run.rounds=2",
                   "--data.micro_batch_size=2", "--run.eval_tokens=1024", "--run.eval_every=1"]


@pytest.mark.parametrize("strategy", ["diloco", "tsv"])
def test_layout_does_not_change_the_math(small_dataset, strategy):
    """R = 2 as two replicas on one worker, and as one replica on each of two gloo workers."""
    one = load_config(TINY + ["--scaling.replicas_per_worker=2", f"--outer.strategy={strategy}"])
    two = load_config(TINY + ["--scaling.replicas_per_worker=1", f"--outer.strategy={strategy}"])
    summary_one, params_one = run_local(one, small_dataset)
    summary_two, params_two = run_local(two, small_dataset)
    assert params_one.keys() == params_two.keys()
    for name in params_one:
        torch.testing.assert_close(params_two[name], params_one[name], rtol=0, atol=1e-6)
    assert summary_two["final_eval_loss"] == pytest.approx(summary_one["final_eval_loss"],
                                                           abs=1e-6)
    assert summary_one["final_eval_loss"] < summary_one["initial_eval_loss"]
    assert summary_two["outer_bytes_per_round"] > 0 == summary_one["outer_bytes_per_round"]


@pytest.mark.parametrize("strategy", [*OUTER_STEP_STRATEGIES, "dare --outer.disjoint=true",
                                      "ties --outer.prune=random --outer.prune_dim=row",
                                      "adamw_ddp"])
def test_every_strategy_trains_without_nan(small_dataset, strategy):
    name, *options = strategy.split()
    cfg = load_config(TINY + ["--scaling.replicas=4", "--scaling.replicas_per_worker=4",
                              *learning_flags(name), *options])
    summary, params = run_local(cfg, small_dataset)
    assert all(torch.isfinite(p).all() for p in params.values())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3


@pytest.mark.parametrize("ordering", ["gradient", "update"])
def test_isoloco_orders_isoc_and_momentum_as_outer_orthogonalize_says(ordering):
    """outer.orthogonalize reaches the outer step: `gradient` is momentum on ISO-C of the mean Δ,
    `update` ISO-C of the momentum update (OuterOptimizer's own math: test_outer_optimizer)."""
    from isoloco_ray.aggregators import OuterOptimizer, isoc

    cfg = load_config(["--outer.strategy=isoloco", f"--outer.orthogonalize={ordering}"])
    sync = OuterSync(cfg.outer, replicas=2, seed=0)
    reference = OuterOptimizer(lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True,
                               orthogonalize_update=ordering == "update")
    g = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(12, 8, generator=g), "b": torch.randn(8, generator=g)}
    expected = {name: value.clone() for name, value in theta.items()}
    for round_index in range(3):
        deltas = {r: {name: torch.randn(value.shape, generator=g) for name, value in theta.items()}
                  for r in range(2)}
        mean = {name: (deltas[0][name] + deltas[1][name]) / 2 for name in theta}
        if ordering == "gradient":
            mean = {name: isoc(d) if d.dim() == 2 else d for name, d in mean.items()}
        sync.step(theta, deltas, round_index=round_index)
        reference.step(expected, mean)
        for name in theta:
            torch.testing.assert_close(theta[name], expected[name], rtol=1e-5, atol=1e-6)


def test_bf16_autocast_and_micro_batches_train(small_dataset):
    """bf16 autocast (the GPU default) runs on CPU too; accumulation over micro-batches gives
    the same first-step gradients as the whole batch."""
    cfg = load_config(TINY + ["--run.autocast=bf16", "--scaling.replicas_per_worker=2"])
    summary, params = run_local(cfg, small_dataset)
    assert all(torch.isfinite(p).all() for p in params.values())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.parametrize("autocast", ["off", "bf16"])
def test_activation_checkpointing_trains_the_same_model(small_dataset, autocast):
    """Recomputing each block in the backward pass gives the same numbers, bit for bit, in
    float32 and under bf16 autocast (the GPU default), and keeps only the blocks' inputs."""
    flags = TINY + ["--scaling.replicas_per_worker=2", f"--run.autocast={autocast}"]
    summary_kept, params_kept = run_local(load_config(flags), small_dataset)
    summary_recomputed, params_recomputed = run_local(
        load_config(flags + ["--model.activation_checkpointing=true"]), small_dataset)
    assert params_recomputed.keys() == params_kept.keys()
    for name, value in params_kept.items():
        assert torch.equal(params_recomputed[name], value), name
    assert summary_recomputed["final_eval_loss"] == summary_kept["final_eval_loss"]


def test_activation_checkpointing_saves_only_the_blocks_inputs():
    from isoloco_ray.workers.model import build_model

    def saved_bytes(flags: list[str]) -> int:
        model = build_model(load_config(["--model.preset=tiny", *flags]).model, 300, seed=0)
        model.train()
        saved = []
        batch = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            model(input_ids=batch, labels=batch).loss.backward()
        return sum(saved)

    assert saved_bytes(["--model.activation_checkpointing=true"]) < 0.6 * saved_bytes([])


def test_gradient_accumulation_matches_whole_batch():
    from isoloco_ray.workers.model import Runtime, build_model
    from isoloco_ray.workers.replica import accumulate_gradients

    cfg = load_config(["--model.preset=tiny"])
    batch = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    grads, losses = [], []
    for micro in (4, 1):
        model = build_model(cfg.model, vocab_size=300, seed=0)
        runtime = Runtime(device=torch.device("cpu"), bf16=False, forward=model)
        losses.append(accumulate_gradients(runtime, batch, micro))
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[1], losses[0])
    for whole, accumulated in zip(*grads):
        torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("strategy", ["diloco", "tsv"])
def test_replica_spread_over_two_workers_matches_one_worker(small_dataset, strategy):
    """2 replicas × 2 workers (gradients averaged inside each replica every step, outer sync
    among same-position workers) == 2 replicas × 1 worker, same per-replica batch."""
    base = TINY + ["--scaling.replicas_per_worker=1", f"--outer.strategy={strategy}"]
    whole = load_config(base)
    spread = load_config(base + ["--scaling.workers_per_replica=2"])
    assert spread.scaling.num_workers == 4
    summary_whole, params_whole = run_local(whole, small_dataset)
    summary_spread, params_spread = run_local(spread, small_dataset)
    for name in params_whole:
        torch.testing.assert_close(params_spread[name], params_whole[name], rtol=0, atol=1e-5)
    assert summary_spread["final_eval_loss"] == pytest.approx(summary_whole["final_eval_loss"],
                                                              abs=1e-5)
    assert summary_spread["tokens"] == summary_whole["tokens"]


@pytest.mark.parametrize("strategy", [["diloco"], ["isoc"], ["tsv"], ["dare"],
                                      ["ties", "--outer.prune=random", "--outer.disjoint=false"]],
                         ids=["diloco", "isoc", "tsv", "dare", "ties-random-mean"])
def test_the_plain_loop_over_quorums_is_the_plain_loop_when_one_worker_takes_every_round(
        small_dataset, strategy):
    """plain_loop.run_over_quorums (the reference for workers missing rounds) with one worker
    hosting every replica, present in every round: the plain loop, bit for bit; for the
    merges of the mean of pruned Δ_r (dare, ties without disjoint) too, whose Δ_r are pruned
    where hosted, before the sum."""
    from isoloco_ray.workers import plain_loop

    cfg = load_config(TINY + ["--scaling.replicas=4", "--scaling.replicas_per_worker=4",
                              "--run.rounds=3", f"--outer.strategy={strategy[0]}",
                              *strategy[1:]])
    plain = plain_loop.run(cfg, small_dataset)
    over_quorums = plain_loop.run_over_quorums(cfg, small_dataset, [[0]] * cfg.run.rounds)
    for name, value in plain.items():
        assert torch.equal(over_quorums[name], value), name
