"""The outer sync across ranks: every placement computes the same step, the traffic is what the
cost model says, momentum lives with the owner, bfloat16 transport halves the bytes.

R = 8 replicas on 4 gloo ranks (2 hosted each), against the same steps in one process."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from isoloco_ray.config import MODEL_PRESETS, load_config
from isoloco_ray.strategies import PLACEMENTS, STRATEGIES, WIRE_FORMATS, OuterMerge
from isoloco_ray.workers.local import in_gloo_group
from isoloco_ray.workers.outer.codec import codec_for
from isoloco_ray.workers.outer.plan import OuterPlan, assign_owners, merge_cost
from isoloco_ray.workers.outer.step import OuterSync

REPLICAS, RANKS, ROUNDS = 8, 4, 3
SHAPES = {"embed": (48, 16), "q": (16, 16), "k": (8, 16), "norm": (16,), "up": (40, 16),
          "down": (16, 40), "head": (48, 16)}
VARIANTS = {
    "diloco": [], "diloco_sgd": [], "isoc": [], "isoloco": [],
    "isoloco_update": ["--outer.strategy=isoloco", "--outer.orthogonalize=update"],
    "isocts": [], "tsv": [], "ties": [],
    "ties_random_rows": ["--outer.strategy=ties", "--outer.prune=random",
                         "--outer.prune_dim=row"],
    "dare": [], "dare_disjoint": ["--outer.strategy=dare", "--outer.disjoint=true"],
    # Its outer step on a lossless wire (the mean at lr 1); its own wire: QUANTIZED_RUNS.
    "sparseloco": ["--outer.strategy=sparseloco", "--outer.topk=null",
                   "--outer.error_feedback=false"],
}
# bfloat16 transport where it casts something: a mean merge sends sums to owners (sharded);
# with replicated it would all-reduce float32 sums (refused: config/train_config.py), a per-replica
# merge (tsv) sends every Δ_r in bfloat16 either way.
BF16_RUNS = (("diloco", "sharded"), ("tsv", "sharded"), ("tsv", "replicated"))
DIVERGED = (1, 5)  # (round, replica): a NaN pseudo-gradient the step must leave out


def variant_config(variant: str, placement: str, comm_dtype: str = "float32"):
    flags = VARIANTS[variant] or [f"--outer.strategy={variant}"]
    return load_config(flags + [f"--scaling.replicas={REPLICAS}", "--scaling.replicas_per_worker=2",
                                f"--outer.placement={placement}",
                                f"--outer.comm_dtype={comm_dtype}"])


def initial_params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def pseudo_gradient(replica: int, round_index: int) -> dict[str, torch.Tensor]:
    """Δ_r: a shared direction plus replica noise (so the merges have structure to find)."""
    delta = {}
    for name, shape in SHAPES.items():
        common = torch.Generator().manual_seed(zlib.crc32(f"{round_index}/{name}".encode()))
        own = torch.Generator().manual_seed(zlib.crc32(f"{replica}/{round_index}/{name}".encode()))
        delta[name] = 0.01 * (torch.randn(shape, generator=common)
                              + 0.5 * torch.randn(shape, generator=own))
    if (round_index, replica) == DIVERGED:
        delta["q"][0, 0] = float("nan")
    return delta


def run_outer_steps(rank: int, world: int, runs: list[tuple[str, str, str]],
                    through_bfloat16: bool = False) -> dict:
    """Each (variant, placement, comm_dtype) for ROUNDS rounds on this rank's replicas
    (`through_bfloat16`: every Δ_r rounded to bfloat16 first)."""
    hosted_per_rank = REPLICAS // world
    results = {}
    for variant, placement, comm_dtype in runs:
        cfg = variant_config(variant, placement, comm_dtype)
        sync = OuterSync(cfg.outer, REPLICAS, seed=0)
        params = initial_params()
        history, dropped = [], []
        for round_index in range(ROUNDS):
            hosted = {r: pseudo_gradient(r, round_index)
                      for r in range(rank * hosted_per_rank, (rank + 1) * hosted_per_rank)}
            if through_bfloat16:
                hosted = {r: {n: t.bfloat16().float() for n, t in delta.items()}
                          for r, delta in hosted.items()}
            state_before = sync.state_dict()
            stats = sync.step(params, hosted, round_index)
            history.append({"params": {n: p.clone() for n, p in params.items()},
                            "bytes": stats.bytes_received, "state_before": state_before})
            dropped.append(stats.dropped)
        results[variant, placement, comm_dtype] = {
            "history": history, "dropped": dropped,
            "momentum": sorted(sync.state_dict()["buffers"]),
            "owners": sync.plan({n: torch.Size(s) for n, s in SHAPES.items()}).owners}
    return results


def all_runs() -> list[tuple[str, str, str]]:
    runs = [(v, p, "float32") for v in VARIANTS for p in PLACEMENTS]
    return runs + [(v, p, "bfloat16") for v, p in BF16_RUNS]


@pytest.fixture(scope="module")
def four_ranks():
    """Rank-ordered results of every run on 4 gloo ranks (one spawn for the module)."""
    return in_gloo_group(run_outer_steps, RANKS, all_runs())


@pytest.fixture(scope="module")
def one_process():
    """The same runs with all 8 replicas in this process, no process group."""
    return run_outer_steps(0, 1, [(v, "replicated", "float32") for v in VARIANTS])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_placement_computes_the_single_process_step(four_ranks, one_process, variant):
    reference = one_process[variant, "replicated", "float32"]
    assert reference["dropped"] == [[], [DIVERGED[1]], []]
    for placement in PLACEMENTS:
        ranks = [result[variant, placement, "float32"] for result in four_ranks]
        for result in ranks:
            assert result["dropped"] == reference["dropped"]
            for round_index in range(ROUNDS):
                got = result["history"][round_index]["params"]
                want = reference["history"][round_index]["params"]
                for name in SHAPES:
                    # Every rank ends bit-identical to the others ...
                    assert torch.equal(got[name],
                                       ranks[0]["history"][round_index]["params"][name])
                    # ... and equal to the one-process step up to summation order.
                    torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6,
                                               msg=f"{placement} {name} round {round_index}")


def resolved(variant: str) -> OuterMerge:
    """The registry's view of a variant (strategies.OuterMerge): what travels, who merges."""
    return OuterMerge.of(variant_config(variant, "sharded").outer)


def test_every_outer_strategy_and_wire_format_is_covered():
    """The variants and transports here are read against the registries, so a new strategy
    or wire format is tested here or this fails."""
    merges = {resolved(variant).strategy for variant in VARIANTS}
    assert merges == {name for name, spec in STRATEGIES.items() if spec.has_outer_step}
    carried = {kind for *_, kind in all_runs()} | {kind for _, _, kind, *_ in QUANTIZED_RUNS}
    assert carried == set(WIRE_FORMATS)


def expected_bytes(variant: str, placement: str, owners: dict[str, int], rank: int,
                   itemsize: int = 4) -> int:
    """The cost model of docs/design.md for one round with every tensor in one bucket."""
    numel = {name: torch.Size(shape).numel() for name, shape in SHAPES.items()}
    total = sum(numel.values())
    hosted = REPLICAS // RANKS
    mean_only = resolved(variant).of_mean
    everyone = placement == "replicated" or (
        placement == "sharded" and resolved(variant).elementwise and itemsize == 4)
    if everyone:
        if mean_only:  # a float32 all-reduce of the sums, whatever comm_dtype
            return int(2 * (RANKS - 1) / RANKS * total * 4)
        return (RANKS - 1) * hosted * total * itemsize  # all-gather
    owned = sum(numel[name] for name, owner in owners.items() if owner == rank)
    copies = 1 if mean_only else hosted
    to_owner = (RANKS - 1) * copies * owned * itemsize  # all-to-all: the other ranks' payloads
    from_owners = (total - owned) * itemsize  # broadcasts of the other owners' updates
    return to_owner + from_owners


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_traffic_follows_the_cost_model(four_ranks, variant):
    for placement in PLACEMENTS:
        for rank, result in enumerate(four_ranks):
            run = result[variant, placement, "float32"]
            want = expected_bytes(variant, placement, run["owners"], rank)
            assert [h["bytes"] for h in run["history"]] == [want] * ROUNDS, (placement, rank)


def test_sharded_placement_spreads_owners_and_rank0_owns_everything(four_ranks):
    sharded = four_ranks[0]["tsv", "sharded", "float32"]["owners"]
    assert set(sharded.values()) == set(range(RANKS))
    assert set(four_ranks[0]["tsv", "rank0", "float32"]["owners"].values()) == {0}
    # rank0: rank 0 receives every other rank's Δ_r; the others only the broadcasts.
    rank0 = [r["tsv", "rank0", "float32"]["history"][0]["bytes"] for r in four_ranks]
    assert rank0[0] > 4 * max(rank0[1:])


def test_momentum_lives_with_the_owner(four_ranks):
    names = set(SHAPES)
    held = [set(r["isoloco", "sharded", "float32"]["momentum"]) for r in four_ranks]
    assert set().union(*held) == names
    assert sum(len(h) for h in held) == len(names)  # disjoint
    owners = four_ranks[0]["isoloco", "sharded", "float32"]["owners"]
    assert all(owners[name] == rank for rank, h in enumerate(held) for name in h)
    assert [set(r["isoloco", "rank0", "float32"]["momentum"]) for r in four_ranks] == \
        [names, set(), set(), set()]
    for placement in ("replicated", "sharded"):  # sharded diloco: an all-reduce, no owners
        assert all(set(r["diloco", placement, "float32"]["momentum"]) == names
                   for r in four_ranks)


def test_resuming_sharded_momentum_under_another_placement(four_ranks):
    """Every rank's momentum file together restores a run, whatever the new placement."""
    ranks = [r["isoloco", "sharded", "float32"]["history"] for r in four_ranks]
    last = ROUNDS - 1
    saved = ranks[0][last]["state_before"]
    buffers = {}
    for history in ranks:
        buffers.update(history[last]["state_before"]["buffers"])
    sync = OuterSync(variant_config("isoloco", "replicated").outer, REPLICAS, seed=0)
    sync.load_state_dict({**saved, "buffers": buffers},
                         {n: torch.Size(s) for n, s in SHAPES.items()})
    params = {n: p.clone() for n, p in ranks[0][last - 1]["params"].items()}
    sync.step(params, {r: pseudo_gradient(r, last) for r in range(REPLICAS)}, last)
    for name in SHAPES:
        torch.testing.assert_close(params[name], ranks[0][last]["params"][name], rtol=0,
                                   atol=1e-6)


def test_missing_momentum_is_reported(four_ranks):
    state = four_ranks[1]["isoloco", "sharded", "float32"]["history"][-1]["state_before"]
    sync = OuterSync(variant_config("isoloco", "sharded").outer, REPLICAS, seed=0)
    with pytest.raises(ValueError, match="lacks the outer momentum of .* a file is missing"):
        sync.load_state_dict(state, {n: torch.Size(s) for n, s in SHAPES.items()})


def relative_error(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    return float((got - want).norm() / (want - start).norm())


def test_bfloat16_transport_halves_the_bytes_to_and_from_owners(four_ranks):
    for variant, placement in BF16_RUNS:
        for rank, result in enumerate(four_ranks):
            run = result[variant, placement, "bfloat16"]
            assert run["history"][0]["bytes"] == expected_bytes(
                variant, placement, run["owners"], rank, itemsize=2), (variant, placement)
    # Sharded: all-to-all and broadcasts at 2 bytes against the float32 all-reduce's 2(W-1)/W.
    assert four_ranks[0]["diloco", "sharded", "bfloat16"]["history"][0]["bytes"] < \
        0.6 * four_ranks[0]["diloco", "sharded", "float32"]["history"][0]["bytes"]


def test_bfloat16_transport_keeps_the_mean_step(four_ranks):
    """bfloat16 keeps 8 significant bits (relative rounding <= 2^-9) of the hosted sums and
    of the updates."""
    start = initial_params()
    half = four_ranks[0]["diloco", "sharded", "bfloat16"]["history"][-1]["params"]
    full = four_ranks[0]["diloco", "sharded", "float32"]["history"][-1]["params"]
    for name in SHAPES:
        assert relative_error(half[name], full[name], start[name]) < 1e-2, name


def test_bfloat16_transport_merges_in_float32():
    """A per-replica merge of bfloat16-carried Δ_r is the float32 merge of the rounded Δ_r
    (TSV's truncated SVD of noisy Δ_r is itself far more sensitive to that rounding, so the
    comparison is with the rounded inputs); sharded placement also rounds the update."""
    four = in_gloo_group(run_outer_steps, RANKS, [("tsv", p, "bfloat16") for p in
                                                   ("sharded", "replicated")])
    rounded = run_outer_steps(0, 1, [("tsv", "replicated", "float32")], through_bfloat16=True)
    want = rounded["tsv", "replicated", "float32"]["history"]
    start = initial_params()
    for round_index in range(ROUNDS):
        replicated = four[0]["tsv", "replicated", "bfloat16"]["history"][round_index]["params"]
        sharded = four[0]["tsv", "sharded", "bfloat16"]["history"][round_index]["params"]
        for name in SHAPES:
            torch.testing.assert_close(replicated[name], want[round_index]["params"][name],
                                       rtol=0, atol=1e-6)
            assert relative_error(sharded[name], want[round_index]["params"][name],
                                  start[name]) < 1e-2


def test_sharded_owners_balance_the_estimated_merge_cost():
    """On the 178M model's shapes (9 blocks, 32k vocabulary) at R = 8."""
    preset = MODEL_PRESETS["178M"]
    hidden, inter, vocab = preset["hidden_size"], preset["intermediate_size"], 32000
    shapes = {"embed": torch.Size((vocab, hidden)), "head": torch.Size((vocab, hidden))}
    for block in range(preset["num_layers"]):
        for name in ("q", "k", "v", "o"):
            shapes[f"{block}.{name}"] = torch.Size((hidden, hidden))
        shapes[f"{block}.up"] = shapes[f"{block}.gate"] = torch.Size((inter, hidden))
        shapes[f"{block}.down"] = torch.Size((hidden, inter))
        shapes[f"{block}.norm1"] = shapes[f"{block}.norm2"] = torch.Size((hidden,))
    for merge in ("mean", "isoc", "tsv", "ties"):
        costs = {name: merge_cost(shape, merge, 8) for name, shape in shapes.items()}
        for ranks in (2, 4, 8):
            plan = OuterPlan.build(shapes, merge, 8, ranks, "sharded")
            loads = plan.loads(costs)
            best_possible = max(sum(costs.values()) / ranks, max(costs.values()))
            assert max(loads) <= 4 / 3 * best_possible, (merge, ranks)
            assert sorted(n for owned in plan.owned for n in owned) == sorted(shapes)
            assert plan == OuterPlan.build(shapes, merge, 8, ranks, "sharded")  # deterministic


def test_transfer_steps_bucket_each_owners_tensors():
    shapes = {f"t{i}": torch.Size((100 * (i + 1),)) for i in range(10)}
    plan = OuterPlan.build(shapes, "mean", 4, 3, "sharded")
    numels = {name: shape.numel() for name, shape in shapes.items()}
    steps = plan.transfer_steps({name: 4 * n for name, n in numels.items()}, copies=2,
                                bucket_bytes=4000)
    for owner in range(3):
        moved = [name for step in steps for name in step[owner]]
        assert moved == list(plan.owned[owner])  # each once, in model order
        for step in steps:
            size = sum(2 * numels[name] * 4 for name in step[owner])
            assert size <= 4000 or len(step[owner]) == 1


def test_placement_names_are_checked():
    with pytest.raises(ValueError, match="placement must be one of"):
        assign_owners({"w": 1.0}, 2, "everywhere")
    with pytest.raises(Exception, match="outer.placement"):
        load_config(["--outer.placement=everywhere"])


# -- 8-bit transport with error feedback ---------------------------------------------------------

TOPK = 0.25
ROW_CODES = [name for name, spec in WIRE_FORMATS.items()
             if spec.per_replica and not spec.chunked]  # int8, float8
DECAY = 0.9  # outer.error_decay below 1: SparseLoCo's decaying accumulator
QUANTIZED_RUNS = [(v, p, kind, None, 1.0) for v in ("diloco", "isoloco", "tsv")
                  for p in ("sharded", "replicated") for kind in ROW_CODES] + [
                  (v, p, kind, TOPK, 1.0) for v in ("diloco", "tsv")
                  for p in ("sharded", "replicated") for kind in ("float32", "int8")] + [
                  (v, p, "int8", topk, DECAY) for v, topk in (("diloco", None), ("tsv", TOPK))
                  for p in ("sharded", "replicated")] + [
                  # SparseLoCo's wire: gathered by every worker, each chunk's largest entries.
                  ("diloco", "replicated", "int2", TOPK, DECAY),
                  ("sparseloco", "replicated", "int2", TOPK, DECAY),
                  ("tsv", "replicated", "int4", TOPK, 1.0),
                  # ... or sent to each tensor's owner, whose update comes back packed alike.
                  ("tsv", "sharded", "int4", TOPK, 1.0), ("ties", "sharded", "int2", TOPK, DECAY),
                  ("isocts", "rank0", "int2", TOPK, 1.0)]


def run_with_feedback(rank: int, world: int,
                      runs: list[tuple[str, str, str, float | None, float]]) -> dict:
    """Each (variant, placement, comm_dtype, topk, error_decay) with outer.error_feedback for
    ROUNDS rounds on this rank's replicas, the residuals held as the Trainer holds them (one
    dict each)."""
    hosted_ids = range(rank * REPLICAS // world, (rank + 1) * REPLICAS // world)
    results = {}
    for variant, placement, comm_dtype, topk, decay in runs:
        cfg = load_config((VARIANTS[variant] or [f"--outer.strategy={variant}"]) + [
            f"--scaling.replicas={REPLICAS}", "--scaling.replicas_per_worker=2",
            f"--outer.placement={placement}", f"--outer.comm_dtype={comm_dtype}",
            "--outer.error_feedback=true", f"--outer.error_decay={decay}"]
            + ([f"--outer.topk={topk}"] if topk else []))
        sync = OuterSync(cfg.outer, REPLICAS, seed=0)
        params = initial_params()
        feedback: dict[int, dict[str, torch.Tensor]] = {r: {} for r in hosted_ids}
        history = []
        for round_index in range(ROUNDS):
            hosted = {r: pseudo_gradient(r, round_index) for r in hosted_ids}
            stats = sync.step(params, hosted, round_index, feedback=feedback)
            history.append({"params": {n: p.clone() for n, p in params.items()},
                            "bytes": stats.bytes_received, "dropped": stats.dropped})
        results[variant, placement, comm_dtype, topk, decay] = {
            "history": history, "owners": sync.plan({n: torch.Size(s)
                                                     for n, s in SHAPES.items()}).owners,
            "feedback": {r: {n: e.clone() for n, e in fb.items()} for r, fb in feedback.items()}}
    return results


def reference_with_feedback(variant: str, comm_dtype: str, topk: float | None = None,
                            decay: float = 1.0, packed_updates: bool = False
                            ) -> tuple[list, dict]:
    """The semantics in plain steps, one process: replica r sends x = Δ_r + β·e_r (β =
    `decay`), the merge sees decode(encode(x)) (float32 otherwise), and e_r becomes
    x − decode(encode(x)); a dropped replica keeps its e_r. With `topk`, decode(encode(x))
    keeps each row's largest entries (written here with torch.topk, not the codec).
    `packed_updates` (owners on a chunked wire): each tensor's update u (merge, then outer
    momentum) is sent as decode(encode(u + e)) and e becomes u + e − that, e from zero."""
    codec = codec_for(comm_dtype, topk if WIRE_FORMATS[comm_dtype].chunked else None)

    def sent_of(x: torch.Tensor) -> torch.Tensor:
        if topk is None or WIRE_FORMATS[comm_dtype].chunked:  # chunks: test_chunk_topk_codec
            return codec.roundtrip(x)
        rows = x.reshape(x.shape[0] if x.dim() > 1 else 1, -1)
        k = max(1, math.ceil(topk * rows.shape[1]))
        kept = rows.abs().topk(k, dim=1).indices
        dense = torch.zeros_like(rows)
        dense.scatter_(1, kept, codec.roundtrip(rows.gather(1, kept)))
        return dense.view(x.shape)

    sync = OuterSync(variant_config(variant, "replicated").outer, REPLICAS, seed=0)
    params = initial_params()
    residual = {r: {n: torch.zeros(s) for n, s in SHAPES.items()} for r in range(REPLICAS)}
    owner_residual: dict[str, torch.Tensor] = {}
    history = []
    for round_index in range(ROUNDS):
        sent = {}
        for r in range(REPLICAS):
            delta = pseudo_gradient(r, round_index)
            if (round_index, r) == DIVERGED:
                sent[r] = delta  # non-finite: left out, its residual kept
                continue
            x = {n: delta[n] + decay * residual[r][n] for n in SHAPES}
            sent[r] = {n: sent_of(x[n]) for n in SHAPES}
            residual[r] = {n: x[n] - sent[r][n] for n in SHAPES}
        if not packed_updates:
            sync.step(params, sent, round_index)
        else:
            good = [r for r in range(REPLICAS) if (round_index, r) != DIVERGED]
            arrived = {n: [[sent[r][n] for r in range(REPLICAS)]] for n in SHAPES}
            updates = sync._momentum_updates(sync._merged(arrived, good, round_index))
            corrected = {n: u + owner_residual.get(n, 0) for n, u in updates.items()}
            back = {n: codec.roundtrip(c) for n, c in corrected.items()}
            owner_residual = {n: corrected[n] - back[n] for n in SHAPES}
            sync.optimizer.apply(params, back)
        history.append({n: p.clone() for n, p in params.items()})
    return history, residual


@pytest.fixture(scope="module")
def quantized_four_ranks():
    return in_gloo_group(run_with_feedback, RANKS, QUANTIZED_RUNS)


@pytest.mark.parametrize("variant, comm_dtype, topk, decay", sorted({
    (variant, comm_dtype, topk, decay) for variant, _, comm_dtype, topk, decay in QUANTIZED_RUNS},
    key=str))
def test_compressed_transport_merges_the_decoded_corrected_deltas(quantized_four_ranks, variant,
                                                                  comm_dtype, topk, decay):
    want, want_residual = reference_with_feedback(variant, comm_dtype, topk, decay)
    if decay != 1.0:  # not vacuous: undecayed residuals lead elsewhere
        undecayed, _ = reference_with_feedback(variant, comm_dtype, topk)
        assert any((undecayed[-1][n] - want[-1][n]).abs().max() > 1e-5 for n in SHAPES)
    start = initial_params()
    chunked = WIRE_FORMATS[comm_dtype].chunked
    for placement in PLACEMENTS:
        if (variant, placement, comm_dtype, topk, decay) not in quantized_four_ranks[0]:
            continue
        expected = want
        if chunked and placement != "replicated":  # owners pack their updates too
            expected = reference_with_feedback(variant, comm_dtype, topk, decay,
                                               packed_updates=True)[0]
            assert any((expected[-1][n] - want[-1][n]).abs().max() > 1e-4 for n in SHAPES)
        ranks = [result[variant, placement, comm_dtype, topk, decay]
                 for result in quantized_four_ranks]
        for round_index in range(ROUNDS):
            assert ranks[0]["history"][round_index]["dropped"] == (
                [DIVERGED[1]] if round_index == DIVERGED[0] else [])
            got = ranks[0]["history"][round_index]["params"]
            for name in SHAPES:
                for other in ranks[1:]:  # every rank ends bit-identical
                    assert torch.equal(other["history"][round_index]["params"][name], got[name])
                if placement == "replicated" or chunked:  # the reference exactly
                    torch.testing.assert_close(got[name], expected[round_index][name],
                                               rtol=0, atol=1e-6)
                else:  # owners send their updates in comm_dtype too (never sparse)
                    bound = {"float32": 1e-6, "int8": 2e-2, "float8": 1e-1}[comm_dtype]
                    assert relative_error(got[name], want[round_index][name],
                                          start[name]) < bound
        for rank, result in enumerate(ranks):
            for r, residual in result["feedback"].items():
                assert r // (REPLICAS // RANKS) == rank
                for name in SHAPES:
                    if placement == "replicated" or chunked:
                        torch.testing.assert_close(residual[name], want_residual[r][name],
                                                   rtol=0, atol=1e-6)
                    assert residual[name].abs().sum() > 0


def test_quantized_transport_takes_a_byte_per_entry_and_a_scale_per_row(quantized_four_ranks):
    wire = {name: torch.Size(s).numel() + 4 * (s[0] if len(s) > 1 else 1)
            for name, s in SHAPES.items()}
    hosted = REPLICAS // RANKS
    for variant in ("diloco", "tsv"):
        for rank, result in enumerate(quantized_four_ranks):
            replicated = result[variant, "replicated", "int8", None, 1.0]["history"][0]["bytes"]
            assert replicated == (RANKS - 1) * hosted * sum(wire.values())  # all-gather
            run = result[variant, "sharded", "int8", None, 1.0]
            owned = sum(wire[n] for n, owner in run["owners"].items() if owner == rank)
            assert run["history"][0]["bytes"] == (
                (RANKS - 1) * hosted * owned + sum(wire.values()) - owned)
            assert result[variant, "sharded", "float8", None, 1.0]["history"][0]["bytes"] == \
                run["history"][0]["bytes"]


def test_topk_sends_each_rows_largest_entries_and_their_indices(quantized_four_ranks):
    def rows_columns(s):  # type: ignore[no-untyped-def]
        rows = s[0] if len(s) > 1 else 1
        return rows, torch.Size(s).numel() // rows

    for comm_dtype, value_bytes, row_bytes in (("float32", 4, 0), ("int8", 1, 4)):
        sparse = {}
        for name, shape in SHAPES.items():
            rows, columns = rows_columns(shape)
            k = math.ceil(TOPK * columns)
            sparse[name] = rows * (k * (value_bytes + 4) + row_bytes)  # values, int32 indices
        for result in quantized_four_ranks:
            replicated = result["tsv", "replicated", comm_dtype, TOPK, 1.0]["history"][0][
                "bytes"]
            assert replicated == (RANKS - 1) * (REPLICAS // RANKS) * sum(sparse.values())


def test_sparselocos_wire_gathers_every_replicas_packed_payload(quantized_four_ranks):
    for comm_dtype, variant, decay in (("int2", "diloco", DECAY), ("int4", "tsv", 1.0)):
        codec = codec_for(comm_dtype, TOPK)
        payload = sum(codec.elements(torch.Size(s)) for s in SHAPES.values())
        for result in quantized_four_ranks:
            got = result[variant, "replicated", comm_dtype, TOPK, decay]["history"][0]["bytes"]
            assert got == (RANKS - 1) * (REPLICAS // RANKS) * payload  # all-gather, as sent
        assert payload < sum(torch.Size(s).numel() for s in SHAPES.values())  # < 1 byte each


def test_owners_on_sparselocos_wire_receive_their_tensors_payloads_and_send_updates_packed(
        quantized_four_ranks):
    """Each owner receives the other ranks' packed payloads of its tensors and every other
    owner's packed update, each the chunk codec's bytes."""
    codec = codec_for("int4", TOPK)
    packed = {name: codec.elements(torch.Size(s)) for name, s in SHAPES.items()}
    for rank, result in enumerate(quantized_four_ranks):
        run = result["tsv", "sharded", "int4", TOPK, 1.0]
        owned = sum(packed[n] for n, owner in run["owners"].items() if owner == rank)
        assert 0 < owned < sum(packed.values())  # the tensors are spread over the owners
        assert run["history"][0]["bytes"] == (
            (RANKS - 1) * (REPLICAS // RANKS) * owned + sum(packed.values()) - owned)


# -- a replica spread over G workers: each outer group steps 1/G of the tensors ----------------

SPREAD_RUNS = (("diloco", "replicated"), ("tsv", "replicated"), ("isoloco", "sharded"),
               ("ties_random_rows", "replicated"))
SPREAD_NAN = (1, 1)  # (round, replica): a NaN in a tensor that only position 1 steps


def spread_config(variant: str, placement: str, workers_per_replica: int):
    flags = VARIANTS[variant] or [f"--outer.strategy={variant}"]
    return load_config(flags + ["--scaling.replicas=2", "--scaling.replicas_per_worker=1",
                                f"--scaling.workers_per_replica={workers_per_replica}",
                                f"--outer.placement={placement}"])


def spread_delta(replica: int, round_index: int, nan_in: str) -> dict[str, torch.Tensor]:
    delta = pseudo_gradient(replica, round_index)
    if (round_index, replica) == SPREAD_NAN:
        delta[nan_in].view(-1)[0] = float("nan")
    return delta


def run_spread_steps(rank: int, world: int, positions: int) -> dict:
    """R = 2 replicas, each on `positions` workers (ranks g·G … g·G+G−1): the outer step of
    every SPREAD_RUNS variant for ROUNDS rounds, then the share within the replica."""
    import torch.distributed as dist

    from isoloco_ray.workers.parallel.layout import ReplicaShard

    same_position = [list(range(p, world, positions)) for p in range(positions)]
    outer_group, _ = dist.new_subgroups_by_enumeration(same_position)
    replica_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(s * positions, (s + 1) * positions)) for s in range(world // positions)])
    shard = ReplicaShard(rank % positions, positions, replica_group)
    replica, shapes = rank // positions, {n: torch.Size(s) for n, s in SHAPES.items()}
    results = {}
    for variant, placement in SPREAD_RUNS:
        cfg = spread_config(variant, placement, positions)
        sync = OuterSync(cfg.outer, 2, seed=0, group=outer_group, positions=positions,
                         position=rank % positions)
        params, history = initial_params(), []
        nan_in = sync.shares(shapes)[-1][0]
        for round_index in range(ROUNDS):
            stats = sync.step(params, {replica: spread_delta(replica, round_index, nan_in)},
                              round_index)
            shared = shard.share(sync.shares(shapes), params, params)
            history.append({"params": {n: p.clone() for n, p in params.items()},
                            "bytes": stats.bytes_received, "shared": shared,
                            "dropped": stats.dropped})
        results[variant, placement] = {"history": history, "shares": sync.shares(shapes),
                                       "momentum": sorted(sync.state_dict()["buffers"])}
    return results


@pytest.fixture(scope="module")
def spread_ranks():
    """Rank-ordered results of R = 2 replicas × G = 2 workers on 4 gloo ranks, and of R = 2
    replicas × G = 1 (whole outer steps) on 2."""
    return in_gloo_group(run_spread_steps, 4, 2), in_gloo_group(run_spread_steps, 2, 1)


@pytest.mark.parametrize("variant, placement", SPREAD_RUNS)
def test_each_position_steps_its_share_and_the_replica_ends_bit_identical(
        spread_ranks, variant, placement):
    """The G outer groups each step 1/G of the tensors, yet every worker ends with the step
    G = 1 takes, bit for bit (each tensor's outer step is the same computation, at one
    position), and leaves out the same replicas (a NaN in a tensor only position 1 steps)."""
    spread, whole = spread_ranks
    reference = whole[0][variant, placement]
    shares = spread[0][variant, placement]["shares"]
    assert len(shares) == 2 and all(shares) and set(shares[0]).isdisjoint(shares[1])
    assert set(shares[0]) | set(shares[1]) == set(SHAPES)
    for rank, result in enumerate(spread):
        run = result[variant, placement]
        for round_index, step in enumerate(run["history"]):
            want = reference["history"][round_index]
            assert step["dropped"] == want["dropped"] == ([1] if round_index == 1 else [])
            for name in SHAPES:
                assert torch.equal(step["params"][name], want["params"][name]), \
                    (rank, round_index, name)


@pytest.mark.parametrize("variant, placement", SPREAD_RUNS)
def test_each_outer_group_moves_its_share_of_the_bytes(spread_ranks, variant, placement):
    """Across replicas each position's outer group moves only its share's bytes (together
    what G = 1 moves); within a replica, each worker receives the others' share of θ."""
    spread, whole = spread_ranks
    shares = spread[0][variant, placement]["shares"]
    for rank, result in enumerate(spread):
        run = result[variant, placement]
        whole_bytes = whole[0][variant, placement]["history"][0]["bytes"]
        assert 0 < run["history"][0]["bytes"] < whole_bytes
        others = [n for n in SHAPES if n not in shares[rank % 2]]
        assert run["history"][0]["shared"] == 4 * sum(math.prod(SHAPES[n]) for n in others)
    # The two positions' outer bytes add up to G = 1's (a round without a dropped replica).
    assert (spread[0][variant, placement]["history"][0]["bytes"]
            + spread[1][variant, placement]["history"][0]["bytes"]
            == whole[0][variant, placement]["history"][0]["bytes"])


def test_each_position_holds_the_momentum_of_its_share(spread_ranks):
    spread, _ = spread_ranks
    for variant, placement in (("diloco", "replicated"), ("isoloco", "sharded")):  # momentum
        held = [set(r[variant, placement]["momentum"]) for r in spread]
        shares = spread[0][variant, placement]["shares"]
        for rank in (0, 1, 2, 3):
            if placement == "replicated":
                assert held[rank] == set(shares[rank % 2]), (variant, rank)
        # Ranks 0 and 2 (position 0, replicas 0 and 1) hold position 0's share between them.
        assert held[0] | held[2] == set(shares[0])
        assert held[1] | held[3] == set(shares[1])


@pytest.mark.parametrize("flags", [
    ["--outer.strategy=sparseloco", f"--outer.topk={TOPK}"],  # 2-bit chunks, gathered
    ["--outer.strategy=tsv", "--outer.comm_dtype=int8", "--outer.placement=sharded",
     "--outer.error_feedback=true"],  # to each tensor's owner
], ids=["gathered", "to-owners"])
def test_each_payload_is_encoded_once_and_its_residual_is_what_the_wire_lost(flags,
                                                                              monkeypatch):
    """With error feedback, the residual comes from the payload as the wire delivers it: where
    the transport decoded this rank's own payload already (every worker gathers every
    payload) it is taken from there, so each replica's x is encoded once a round (twice
    before: once more for the residual); elsewhere from the codec's round trip of x, the
    same bytes. Either way sent + residual = x exactly (one rank: world 1)."""
    cfg = load_config(flags + [f"--scaling.replicas={REPLICAS}",
                               f"--scaling.replicas_per_worker={REPLICAS}"])
    sync = OuterSync(cfg.outer, REPLICAS, seed=0)
    codec = sync.exchange.codec
    encoded: list[int] = []  # tensors per encode call, a round trip counting as one each
    encode, roundtrip = type(codec).encode, type(codec).roundtrip

    def counted_encode(self, tensors, device):
        encoded.append(len(tensors))
        return encode(self, tensors, device)

    def counted_roundtrip(self, tensor):
        encoded.append(1)
        return roundtrip(self, tensor)

    monkeypatch.setattr(type(codec), "encode", counted_encode)
    monkeypatch.setattr(type(codec), "roundtrip", counted_roundtrip)
    params = initial_params()
    feedback: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(REPLICAS)}
    for round_index in range(2):
        hosted = {r: pseudo_gradient(r, round_index) for r in range(REPLICAS)}
        accumulated = {r: {n: hosted[r][n] + cfg.outer.error_decay * feedback[r][n]
                           if n in feedback[r] else hosted[r][n] for n in SHAPES}
                       for r in range(REPLICAS)}
        kept = {r: dict(feedback[r]) for r in range(REPLICAS)}
        encoded.clear()
        dropped = sync.step(params, hosted, round_index, feedback=feedback).dropped
        assert dropped == ([DIVERGED[1]] if round_index == DIVERGED[0] else [])
        if sync.route.everyone_merges:  # each copy once, in the gather (twice before)
            assert sum(encoded) == REPLICAS * len(SHAPES)
        for r in range(REPLICAS):
            if r in dropped:  # its residual kept as it was
                assert feedback[r].keys() == kept[r].keys()
                assert all(feedback[r][n] is kept[r][n] for n in kept[r])
                continue
            for name in SHAPES:
                delivered = codec.roundtrip(accumulated[r][name])
                assert torch.equal(feedback[r][name], accumulated[r][name] - delivered)
                assert feedback[r][name].abs().sum() > 0  # the wire lost something
