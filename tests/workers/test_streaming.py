"""Streaming outer sync (outer.fragments, outer.delay, outer.mix): the fragments, the schedule,
the settings' checks, a plain-PyTorch reference loop of the semantics against the real
implementation (one process and 2 gloo ranks), bit-identity with the plain outer step, and
exact resume with fragments in flight."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import TINY_RUN, learning_flags
from pydantic import ValidationError
from transformers import LlamaForCausalLM

from isoloco_ray.config import load_config
from isoloco_ray.strategies import STRATEGIES, OuterMerge
from isoloco_ray.workers import plain_loop
from isoloco_ray.workers.local import StopAfterRound, run_local
from isoloco_ray.workers.model import llama_config
from isoloco_ray.workers.replica import Replica
from isoloco_ray.workers.rounds.fragments import round_events, split_fragments
from isoloco_ray.workers.state.checkpoint import CheckpointError, parameters_sha256

# The references in this process on one thread, as run_local's ranks: on some CPUs (an AMD
# EPYC) MKL splits float64 work by thread count, and tsv and isocts then differ in the last bit.
pytestmark = pytest.mark.usefixtures("one_thread")

# Every strategy with an outer step, from the registry (a new one is tested by name here).
OUTER_STEP_STRATEGIES = [name for name, spec in STRATEGIES.items() if spec.has_outer_step]

# -- fragments -----------------------------------------------------------------------------------


def model_shapes(preset: str, **sizes) -> dict[str, torch.Size]:
    cfg = load_config([f"--model.preset={preset}", *(f"--model.{k}={v}" for k, v in
                                                     sizes.items())])
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(cfg.model, vocab_size=4096))
    return {name: p.shape for name, p in model.named_parameters()}


@pytest.mark.parametrize("preset, fragments", [("demo", 2), ("demo", 4), ("178M", 3),
                                               ("178M", 9), ("512M", 4)])
def test_fragments_are_whole_layers_in_order_balanced_by_size(preset, fragments):
    shapes = model_shapes(preset)
    parts = split_fragments(shapes, fragments)
    assert len(parts) == fragments and all(parts)
    assert [name for part in parts for name in part] == list(shapes)  # contiguous, in order
    assert "model.embed_tokens.weight" in parts[0]
    assert {"model.norm.weight", "lm_head.weight"} <= set(parts[-1])

    def layers(part):
        return {name.split(".")[2] for name in part if ".layers." in name}

    for a, b in itertools.combinations(parts, 2):
        assert not layers(a) & layers(b)  # no layer is split
    # The largest fragment is the smallest possible: brute force over every split of layers.
    units = [[n for n in shapes if f".layers.{i}." in n] for i in range(len(layers(shapes)))]
    units[0] = [n for n in shapes if ".layers." not in n and "embed" in n] + units[0]
    units[-1] += [n for n in shapes if n in ("model.norm.weight", "lm_head.weight")]
    sizes = [sum(shapes[n].numel() for n in unit) for unit in units]
    best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
               for cuts in itertools.combinations(range(1, len(sizes)), fragments - 1))
    assert max(sum(shapes[n].numel() for n in part) for part in parts) == best


def test_one_fragment_is_the_whole_model_and_too_many_are_refused():
    shapes = model_shapes("tiny")
    assert split_fragments(shapes, 1) == [tuple(shapes)]
    with pytest.raises(ValueError, match=r"outer.fragments \(3\) exceeds the model's 2"):
        split_fragments(shapes, 3)


# -- the schedule ------------------------------------------------------------------------------


@pytest.mark.parametrize("steps, fragments, delay", [(4, 1, 0), (4, 1, 3), (6, 2, 0),
                                                     (6, 3, 1), (12, 4, 2), (8, 2, 3)])
def test_round_events_follow_the_streaming_rule(steps, fragments, delay):
    """Fragment p's sync starts after global inner step t iff (t − p·H/P) % H == 0 and lands
    `delay` steps later (after the last step at the latest); at a round's end nothing is in
    flight, and at any time at most one sync is."""
    rounds = 3
    total = rounds * steps
    expected = {(t, p, True) for t in range(1, total + 1) for p in range(fragments)
                if (t - p * steps // fragments) % steps == 0}
    expected |= {(min(t + delay, total), p, False) for t, p, _ in expected}
    seen, in_flight = [], set()
    for r in range(rounds):
        for event in round_events(r, rounds, steps, fragments, delay):
            t = r * steps + event.step
            seen.append((t, event.fragment, event.starts))
            if event.starts:
                assert not in_flight
                in_flight.add(event.fragment)
                assert event.sync_round == (t - 1) // steps  # the round its steps ended
            else:
                in_flight.remove(event.fragment)
        assert not in_flight, f"a sync in flight at the end of round {r}"
    assert set(seen) == expected and len(seen) == len(expected)
    assert [t for t, _, _ in seen] == sorted(t for t, _, _ in seen)


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--outer.fragments=3", "--inner.steps=10"], r"outer.fragments \(3\) must divide "
     r"inner.steps \(10\)"),
    (["--outer.fragments=2", "--inner.steps=10", "--outer.delay=5"],
     r"outer.delay \(5\) must be less than inner.steps / outer.fragments \(5\)"),
    (["--outer.delay=20", "--inner.steps=20"], r"outer.delay \(20\) must be less"),
    (["--outer.fragments=5", "--model.preset=demo", "--inner.steps=20"],
     r"outer.fragments \(5\) exceeds model.num_layers \(4\)"),
    (["--outer.strategy=adamw_ddp", "--outer.fragments=2"], "adamw_ddp has none"),
    (["--outer.strategy=adamw_ddp", "--outer.mix=0.5"], "adamw_ddp has none"),
    (["--outer.mix=1"], "less than 1"),
    (["--outer.mix=nan"], "finite number"),
    (["--outer.mix=-0.1"], "greater than or equal to 0"),
    (["--outer.fragments=0"], "greater than or equal to 1"),
    (["--outer.delay=-1"], "greater than or equal to 0"),
])
def test_bad_streaming_settings_are_refused_naming_the_field(flags, message):
    with pytest.raises((ValidationError, ValueError), match=message):
        load_config(flags)


def test_old_checkpoints_configs_resume_with_the_streaming_defaults():
    """A checkpoint written before these settings existed holds no outer.fragments etc.: the
    defaults are what it ran with, so it must still resume."""
    from isoloco_ray.config import config_differences

    cfg = load_config([])
    saved = cfg.model_dump(mode="json")
    for key in ("fragments", "delay", "mix"):
        del saved["outer"][key]
    assert config_differences(saved, cfg) == []
    saved["outer"]["strategy"] = "tsv"
    assert config_differences(saved, cfg) == ["outer.strategy"]


# -- the plain loop (workers/plain_loop.py) against the Trainer ---------------------------------


# A small streaming run: 2 fragments, delay 1, mix 0.5, whole batches (as the reference).
STREAMING = ["--model.preset=tiny", "--scaling.replicas=2", "--inner.steps=4",
             "--run.rounds=3", "--data.seq_len=64", "--data.batch_size=4",
             "--data.micro_batch_size=4", "--run.eval_tokens=512", "--run.eval_every=3",
             "--outer.fragments=2", "--outer.delay=1", "--outer.mix=0.5"]


@pytest.mark.parametrize("strategy, layout", [
    ("diloco", ["--scaling.replicas_per_worker=1"]),
    ("tsv", ["--scaling.replicas_per_worker=1"]),
    ("isocts", ["--scaling.replicas_per_worker=2"]),
    # Each replica on 2 workers: 2 outer groups, each with a background group of its own.
    ("ties", ["--scaling.replicas_per_worker=1", "--scaling.workers_per_replica=2",
              "--data.micro_batch_size=2"]),
], ids=["diloco-2-ranks", "tsv-2-ranks", "isocts-1-process", "ties-4-ranks-G2"])
def test_streaming_matches_the_plain_reference(small_dataset, strategy, layout):
    """The real implementation (replicas taking turns in one process, or one per gloo rank
    with the sync in a background thread and its own process group) against the reference."""
    cfg = load_config(STREAMING + [f"--outer.strategy={strategy}", *layout])
    expected = plain_loop.streaming_run(cfg, small_dataset)
    summary, params = run_local(cfg, small_dataset)
    assert params.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(params[name], expected[name], rtol=0, atol=2e-6)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_delay_changes_the_result_and_mix_keeps_local_progress(small_dataset):
    """Not a no-op: each setting changes the parameters (checked against the reference)."""
    base = load_config(STREAMING + ["--scaling.replicas_per_worker=2"])
    results = {}
    for delay, mix in [(0, 0.0), (1, 0.0), (1, 0.5)]:
        cfg = base.model_copy(deep=True)
        cfg.outer.delay, cfg.outer.mix = delay, mix
        _, params = run_local(cfg, small_dataset)
        expected = plain_loop.streaming_run(cfg, small_dataset)
        for name in expected:
            torch.testing.assert_close(params[name], expected[name], rtol=0, atol=2e-6)
        results[delay, mix] = parameters_sha256(params)
    assert len(set(results.values())) == 3


# -- off is the plain outer step, bit for bit ------------------------------------------------


# Whole batches (micro_batch_size = batch_size), as the reference takes them.
TINY = TINY_RUN + ["--inner.steps=3", "--run.rounds=2", "--data.micro_batch_size=4",
                   "--run.eval_tokens=1024", "--run.eval_every=1", "--scaling.replicas=4"]


@pytest.mark.parametrize("strategy, per_worker", [
    *((name, 4) for name in OUTER_STEP_STRATEGIES),
    ("diloco", 2), ("tsv", 2), ("ties --outer.comm_dtype=int8 --outer.error_feedback=true", 2),
    ("isocts --outer.comm_dtype=bfloat16", 2), ("dare --outer.comm_dtype=float8", 2),
    ("diloco --inner.optimizer=muon", 4), ("tsv --inner.optimizer=muon", 2)])
def test_one_fragment_without_delay_or_mix_is_the_plain_outer_step_bit_for_bit(
        small_dataset, strategy, per_worker):
    """4 replicas in one process, or 2 on each of 2 gloo ranks, against `plain_loop.run`."""
    name, *options = strategy.split()
    cfg = load_config(TINY + [f"--scaling.replicas_per_worker={per_worker}",
                              f"--outer.strategy={name}", *options,
                              "--outer.fragments=1", "--outer.delay=0", "--outer.mix=0"])
    _, params = run_local(cfg, small_dataset)
    expected = plain_loop.run(cfg, small_dataset)
    assert params.keys() == expected.keys()
    summed_over_ranks = per_worker < 4 and OuterMerge.of(cfg.outer).of_mean and \
        cfg.outer.comm_dtype == "float32"
    for n in expected:
        if summed_over_ranks:
            # Each rank sums its own Δ_r before the all-reduce: float32 sums in another order,
            # a few ulps of the largest |Δ| (~1e-2) per round.
            torch.testing.assert_close(params[n], expected[n], rtol=0, atol=1e-7)
        else:
            assert torch.equal(params[n], expected[n]), n


# -- checkpoints with fragments in flight --------------------------------------------------------


@pytest.mark.parametrize("flags", [
    ["--outer.fragments=2"],
    ["--outer.fragments=2", "--outer.delay=1", "--outer.mix=0.5"],
    ["--outer.delay=3", "--outer.strategy=tsv", "--outer.comm_dtype=int8",
     "--outer.error_feedback=true"],
    ["--outer.fragments=2", "--outer.delay=1", "--outer.strategy=dare",
     "--outer.comm_dtype=float8", "--outer.error_feedback=true"],
], ids=["fragments", "fragments-delay-mix", "delay-int8-feedback",
        "fragments-delay-float8-feedback"])
def test_interrupted_streaming_run_resumes_bit_identically(small_dataset, tmp_path, flags):
    """A checkpoint is taken at a round's end, where no fragment is in flight; with delay,
    fragment 0's sync of that moment starts right after it, so the resumed run starts it."""
    cfg = load_config(["--model.preset=tiny", "--scaling.replicas=2",
                       "--scaling.replicas_per_worker=2", "--inner.steps=4", "--run.rounds=4",
                       "--run.checkpoint_every=2", "--data.seq_len=64", "--data.batch_size=4",
                       "--run.eval_tokens=512", "--run.eval_every=2", *flags])
    whole, whole_params = run_local(cfg, small_dataset)
    with pytest.raises(StopAfterRound):
        run_local(cfg, small_dataset, checkpoints=tmp_path, stop_after=3)
    saved = torch.load(tmp_path / "round_000002" / "replica_0001.pt", weights_only=True)
    assert set(saved["params"]) == set(whole_params) and saved["losses_finite"] is True
    resumed, resumed_params = run_local(cfg, small_dataset,
                                        restore_from=tmp_path / "round_000002")
    for name in whole_params:
        assert torch.equal(resumed_params[name], whole_params[name]), name
    assert resumed["final_eval_loss"] == whole["final_eval_loss"]

    del saved["params"]  # a replica file without the replica's own parameters is refused
    torch.save(saved, tmp_path / "round_000002" / "replica_0001.pt")
    with pytest.raises(CheckpointError, match="replica 1's checkpoint does not hold the "
                                              "model's parameters of its own"):
        run_local(cfg, small_dataset, restore_from=tmp_path / "round_000002")


def test_a_diverged_replica_starts_again_from_the_global_parameters(small_dataset,
                                                                    monkeypatch):
    poisoned = set()
    original = Replica.run_inner_steps

    def once(self, *args, **kwargs):  # replica 1 diverges in its first segment only
        losses = original(self, *args, **kwargs)
        if self.index == 1 and not poisoned:
            poisoned.add(1)
            with torch.no_grad():
                for p in self.params.values():
                    p.fill_(math.nan)
            self.losses_finite = False
        return losses

    monkeypatch.setattr(Replica, "run_inner_steps", once)
    reports = []
    cfg = load_config(STREAMING + ["--scaling.replicas_per_worker=2", "--run.eval_every=1"])
    summary, params = run_local(cfg, small_dataset, reports=reports)
    assert "error" not in summary and all(torch.isfinite(p).all() for p in params.values())
    assert [m["dropped_replicas"] for m in reports if m["round"] > 0] == [[1], [], []]
    assert all(math.isfinite(m["loss"]) for m in reports if m["round"] > 0)


def test_a_failing_background_sync_raises_where_it_lands():
    from isoloco_ray.workers.rounds.overlap import Background

    background = Background(torch.device("cpu"))

    def broken() -> None:
        raise RuntimeError("lost the link")

    pending = background.start(broken)
    with pytest.raises(RuntimeError, match="lost the link"):
        background.finish(pending)
    assert background.finish(background.start(lambda: 42)) == 42
    background.close()


def test_progress_line_shows_how_long_training_waited_for_the_syncs():
    from isoloco_ray.metrics import format_progress

    line = format_progress({"round": 3, "tokens": 768, "loss": 6.0, "tokens_per_s": 1000.0,
                            "inner_seconds": 9.0, "outer_comm_seconds": 2.0,
                            "outer_merge_seconds": 0.5, "outer_bytes_received": 2**21,
                            "outer_wait_seconds": 0.25}, rounds=6, overlapped=True)
    assert line.endswith("inner 9.0s comm 2.00s merge 0.50s 2.0 MiB in | waited 0.25s")
    plain = format_progress({"round": 3, "tokens": 768, "loss": 6.0, "tokens_per_s": 1000.0,
                             "inner_seconds": 9.0, "outer_comm_seconds": 2.0,
                             "outer_merge_seconds": 0.5, "outer_bytes_received": 2**21,
                             "outer_wait_seconds": 2.5}, rounds=6)
    assert plain.endswith("merge 0.50s 2.0 MiB in")  # waited = comm + merge: not shown


# -- every strategy and placement keeps working ------------------------------------------------


@pytest.mark.parametrize("strategy", OUTER_STEP_STRATEGIES)
def test_every_strategy_trains_with_fragments_delay_and_mix(small_dataset, strategy):
    cfg = load_config(STREAMING + ["--scaling.replicas=4", "--scaling.replicas_per_worker=4",
                                   *learning_flags(strategy)])
    summary, params = run_local(cfg, small_dataset)
    assert all(torch.isfinite(p).all() for p in params.values())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3


@pytest.mark.parametrize("strategy, options", [
    ("tsv", ["--outer.placement=rank0", "--outer.comm_dtype=bfloat16"]),
    ("isoloco", ["--outer.placement=replicated"]),
    ("dare", ["--outer.comm_dtype=int8", "--outer.error_feedback=true"]),
], ids=["tsv-rank0-bf16", "isoloco-replicated", "dare-int8-feedback"])
def test_placements_and_compressed_transport_with_streaming(small_dataset, strategy, options):
    """On 2 gloo ranks; every round checks that both ranks hold the same global parameters
    (the run would stop with an error otherwise)."""
    cfg = load_config(STREAMING + ["--scaling.replicas_per_worker=1",
                                   f"--outer.strategy={strategy}", *options])
    summary, params = run_local(cfg, small_dataset)
    assert "error" not in summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # Where each tensor is merged does not change the result.
    if "--outer.placement=rank0" in options:
        sharded = cfg.model_copy(deep=True)
        sharded.outer.placement = "sharded"
        _, sharded_params = run_local(sharded, small_dataset)
        assert parameters_sha256(sharded_params) == parameters_sha256(params)


def test_the_sync_thread_runs_on_one_cpu_thread_and_leaves_the_training_threads_alone():
    """Two OpenMP teams outnumbering the cores slow every team down (overlap.py)."""
    from isoloco_ray.workers.rounds.overlap import Background

    before = torch.get_num_threads()
    background = Background(torch.device("cpu"))
    assert background.finish(background.start(torch.get_num_threads)) == 1
    assert torch.get_num_threads() == before
    background.close()
