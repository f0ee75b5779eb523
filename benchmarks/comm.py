"""Outer-sync cost by placement at R = 8 replicas: the bytes each rank receives per
outer round (part 1) and the seconds each rank spends merging (part 2); and with each replica
spread over G workers (part 3).

Part 1 runs one real outer step of `OuterSync` per strategy, placement and comm_dtype on
W spawned gloo ranks (W = 2, 4, 8; each hosts L = R/W replicas), on the 178M model's
tensors with every dimension divided by 8. Bytes are linear in the parameter count, so
they are reported as multiples of P, the model's float32 bytes, and scaled to the real
178M model. They follow the cost model of isoloco_ray/workers/parallel/collectives.py:

- owners (rank0; sharded except the plain means in float32): an all-to-all brings each
  tensor's payload from the W-1 other ranks to its owner (the sum of the hosted Δ_r for
  mean-only strategies, all L Δ_r for per-replica merges), then each owner broadcasts its
  updates. A rank owning a fraction o of the model receives (W-1)·c·o·P + (1-o)·P (times
  1/2 in bfloat16), c = 1 (mean-only) or L (per-replica).
- everyone (replicated; sharded diloco, diloco_sgd and dare in float32): a float32
  all-reduce of the sums, 2(W-1)/W·P, for mean-only strategies; otherwise an all-gather of
  every payload, (W-1)·c·P.
- int8 / float8 (one byte per entry and a float32 scale per row): every replica's Δ_r is
  quantised on its own, for mean-only strategies too (c = L), so that what it loses is its
  own (error feedback); about (W-1)·L·o·P/4 + (1-o)·P/4 through the owners. "int8 top0.1"
  (outer.topk = 0.1) sends a tenth of each row, values in int8 and int32 indices: about
  (W-1)·L·o·P/8 for the payloads, updates dense in int8.

The baseline is the naive all-gather of every replica's Δ to every rank: (W-1)·L·P.

Part 2 times, in one process on the real 178M shapes at W = 4, the merge and outer
update (`OuterSync._merged`, then the momentum) of the tensors each rank owns:
replicated, every rank all of them; rank0, rank 0 all and the others none; sharded, each
rank its `OuterPlan` share. Summing or pruning the hosted Δ_r and applying the updates
are the same on every rank under every placement: they are shown apart. The Δ_r are
synthetic and seeded (benchmarks/merge.py's `make_deltas`), made one shape group at a
time and shared by the placements.

Part 3 spreads each of R = 4 replicas over G = 1 or 2 workers (R·G gloo ranks; G > 1
needs V = 1) and runs one outer step per strategy (default placement, float32) on the
workers' real layout: the G outer groups each step their share of the tensors
(plan.position_shares, split by merge cost), then each replica's workers share the new θ.
Busiest rank: the bytes received from other replicas (between nodes, when a replica's
workers share a node) and within the replica. The merge seconds are those of the busiest
position's share, timed in this process with every replica's Δ_r at hand (8 ranks on 2
cores would time the contention). With G = 2, bytes and merge seconds should drop by
about 2 (less where the cost split leaves the bytes uneven).

    python benchmarks/comm.py          # W = 2, 4, 8; all 9 blocks (~20 min, 2 cores)
    python benchmarks/comm.py --quick  # part 1 at W = 4; part 2 on 1 block (~7 min)
    python benchmarks/comm.py --part 1 --strategies diloco tsv
    python benchmarks/comm.py --part 3 --strategies diloco isoloco tsv   # (~1 min)
    python benchmarks/comm.py --part 4   # SparseLoCo's wire on 178M's shapes (~1 min)
    python benchmarks/comm.py --part 5 --blocks 1   # owners vs every worker on it (~7 min)

Part 4 sizes SparseLoCo's wire (workers/outer/chunk_topk_codec.py: chunk-wise top-k, 2- or
4-bit values, 12-bit positions) on the real 178M tensors, with no training: the bytes one
replica sends per round against its float32 Δ_r (P), and what a worker receives at R = 8 on
W = 4 (L = 2 replicas each) when every worker gathers every payload, (W-1)·L·payload, against
DiLoCo's float32 all-reduce of the sums, 2(W-1)/W·P, and an all-gather of every float32 Δ_r,
(W-1)·L·P; and the seconds one replica's payload takes to encode and to decode here (CPU).

Part 5 asks, for the same wire, whether every worker should merge every tensor (what runs) or
each tensor's owner, sending its merged update back packed (part5's docstring): the busiest
worker's bytes and seconds of each, on the first `--blocks` blocks of 178M.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from merge import MODELS, make_deltas, model_tensors  # benchmarks/merge.py, beside this file

from isoloco_ray.config import OuterConfig, load_config
from isoloco_ray.strategies import STRATEGIES as STRATEGY_SPECS
from isoloco_ray.strategies import OuterMerge
from isoloco_ray.testing import exit_after
from isoloco_ray.workers.local import in_gloo_group
from isoloco_ray.workers.outer.plan import OuterPlan
from isoloco_ray.workers.outer.step import OuterSync
from isoloco_ray.workers.outer.transport import Contributions
from isoloco_ray.workers.parallel.layout import WorkerLayout

T = TypeVar("T")

REPLICAS = 8
MERGE_RANKS = 4  # part 2's outer group
STRATEGIES = tuple(name for name, spec in STRATEGY_SPECS.items() if spec.has_outer_step)
# Part 1's (placement, comm_dtype) rows.
TRANSPORTS = (("sharded", "float32"), ("sharded", "bfloat16"), ("sharded", "int8"),
              ("sharded", "float8"), ("sharded", "int8 top0.1"), ("rank0", "float32"),
              ("replicated", "float32"))
TARGET_RANKS = 4
TARGETS = {"mean-only": 1 / 3, "per-replica": 1 / 2}  # busiest / baseline at W = 4
MERGE_TARGET = 1 / 2  # sharded / replicated, busiest rank's merge seconds
SCALED = "178M/8"
# Dividing every dimension keeps each tensor's share of the parameters (up to the
# norms), so the owners, and the bytes as a multiple of P, stay those of 178M.
MODELS[SCALED] = {**MODELS["178M"], **{key: MODELS["178M"][key] // 8
                                       for key in ("hidden", "intermediate", "vocab")}}
LAYERS = MODELS["178M"]["layers"]


def outer_config(strategy: str, placement: str, comm_dtype: str = "float32"
                 ) -> OuterConfig:
    """The outer section of a run of `strategy` at R = 8 (the strategy's defaults);
    `comm_dtype` "DTYPE topF" adds outer.topk = F."""
    dtype, _, topk = comm_dtype.partition(" top")
    return load_config([f"--outer.strategy={strategy}",
                        f"--outer.placement={placement}",
                        f"--outer.comm_dtype={dtype}",
                        f"--scaling.replicas={REPLICAS}",
                        "--scaling.replicas_per_worker=2"]
                       + ([f"--outer.topk={topk}"] if topk else [])).outer


def kind(strategy: str) -> str:
    """Whether the strategy's outer step needs only the replicas' sum."""
    return "mean-only" if OuterMerge.of(outer_config(strategy, "sharded")).of_mean \
        else "per-replica"


def model_shapes(model: str, blocks: int) -> dict[str, torch.Size]:
    """Embedding, the first `blocks` blocks, final norm and lm_head, in model order."""
    return {name: torch.Size(shape)
            for name, shape, _ in model_tensors(model, blocks, head=True)}


def float32_bytes(shapes: dict[str, torch.Size]) -> int:
    return 4 * sum(shape.numel() for shape in shapes.values())


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


# -- part 1: bytes ---------------------------------------------------------------------

def bytes_received(rank: int, world: int, runs: list[tuple[str, str, str]],
                   shapes: dict[str, torch.Size]) -> dict[tuple[str, str, str], int]:
    """On each gloo rank: one outer step per (strategy, placement, comm_dtype) from this
    rank's hosted replicas; the bytes this rank received in each."""
    per_rank = REPLICAS // world
    hosted = {}
    for replica in range(rank * per_rank, (rank + 1) * per_rank):
        generator = torch.Generator().manual_seed(replica)
        hosted[replica] = {name: 1e-3 * torch.randn(shape, generator=generator)
                           for name, shape in shapes.items()}
    params = {name: torch.zeros(shape) for name, shape in shapes.items()}
    received = {}
    for run in runs:
        sync = OuterSync(outer_config(*run), REPLICAS, seed=0)
        received[run] = sync.step(params, hosted, round_index=0).bytes_received
    return received


def part1(strategies: list[str], worlds: list[int]) -> None:
    shapes = model_shapes(SCALED, LAYERS)
    p = float32_bytes(shapes)
    real_gib = float32_bytes(model_shapes("178M", LAYERS)) / 2**30
    print(f"## Part 1: bytes received per rank in one outer round, R = {REPLICAS}\n\n"
          f"Measured on the 178M shapes / 8 (P = {p / 2**20:.1f} MiB); the GiB "
          f"column is for the 178M model (P = {real_gib:.3f} GiB).\n", flush=True)
    runs = [(s, place, dtype) for s in strategies for place, dtype in TRANSPORTS]
    ratios: dict[tuple[int, str, str, str], float] = {}
    for world in worlds:
        per_rank = in_gloo_group(bytes_received, world, runs, shapes)
        baseline = (world - 1) * (REPLICAS // world)  # × P
        print(f"### W = {world} ranks, L = {REPLICAS // world} replicas each: baseline "
              f"{baseline}·P = {baseline * real_gib:.2f} GiB\n")
        print("| strategy | kind | placement | dtype | busiest ×P | mean ×P "
              "| baseline ×P | busiest/baseline | busiest GiB (178M) |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|")
        for run in runs:
            counts = [result[run] / p for result in per_rank]
            busiest, mean = max(counts), sum(counts) / world
            ratios[(world, *run)] = busiest / baseline
            strategy, placement, dtype = run
            print(f"| {strategy} | {kind(strategy)} | {placement} | {dtype} "
                  f"| {busiest:.3f} | {mean:.3f} | {baseline} "
                  f"| {busiest / baseline:.3f} | {busiest * real_gib:.3f} |")
        print(flush=True)
    if TARGET_RANKS in worlds:
        print(f"Targets at W = {TARGET_RANKS} for the default placement, sharded (rank0 and "
              "replicated are the references), busiest/baseline: mean-only <= 1/3, "
              "per-replica <= 1/2")
        for placement, dtype in (t for t in TRANSPORTS if t[0] == "sharded"):
            verdicts = []
            for s in strategies:
                ratio = ratios[TARGET_RANKS, s, placement, dtype]
                met = "met" if ratio <= TARGETS[kind(s)] + 1e-9 else "MISSED"
                verdicts.append(f"{s} {ratio:.3f} {met}")
            print(f"- {placement} {dtype}: " + ", ".join(verdicts))
        print(flush=True)


# -- part 2: merge seconds -------------------------------------------------------------

def time_updates(outer: OuterConfig, contributions: Contributions,
                 seed: int) -> tuple[OuterSync, dict[str, torch.Tensor], float]:
    """A fresh one-rank OuterSync (no momentum yet), the updates it computes from
    `contributions` (every replica good) and the seconds that took: the best of up to 5
    runs while they take under half a second, as elementwise merges of a few tensors
    are at the mercy of the allocator and of the machine's other load."""
    best = float("inf")
    for _ in range(5):
        sync = OuterSync(outer, REPLICAS, seed)
        updates, took = timed(lambda: sync._momentum_updates(
            sync._merged(contributions, range(REPLICAS), 0)))
        best = min(best, took)
        if took >= 0.5:
            break
    return sync, updates, best


def part2(strategies: list[str], blocks: int, seed: int) -> None:
    shapes = model_shapes("178M", blocks)
    subset = ("every tensor" if blocks == LAYERS else
              f"embedding, {blocks} of {LAYERS} blocks, final norm, lm_head")
    print(f"## Part 2: merge seconds per rank in one outer step, R = {REPLICAS}, "
          f"W = {MERGE_RANKS}\n\n178M shapes ({subset}), CPU, "
          f"{torch.get_num_threads()} threads, wall seconds.\n", flush=True)
    good = list(range(REPLICAS))
    hosted = range(REPLICAS // MERGE_RANKS)  # rank 0's replicas, for the shared work
    # Per strategy, the tensor sets whose merge is timed: "all" (replicated: every rank;
    # rank0: rank 0) and each rank's sharded share.
    owned: dict[str, dict[str | int, set[str]]] = {}
    for s in strategies:
        resolved = OuterMerge.of(outer_config(s, "sharded"))
        plan = OuterPlan.build(shapes, resolved.merge, REPLICAS, MERGE_RANKS, "sharded",
                               resolved.orthogonalize_update)
        owned[s] = {"all": set(shapes), **dict(enumerate(map(set, plan.owned)))}
    seconds = {s: dict.fromkeys([*owned[s], "shared"], 0.0) for s in strategies}

    groups: dict[torch.Size, list[str]] = {}
    for name, shape in shapes.items():
        groups.setdefault(shape, []).append(name)
    for shape, names in groups.items():
        deltas = {n: make_deltas(n, tuple(shape), REPLICAS, seed, torch.device("cpu"))
                  for n in names}
        sums = {n: torch.stack(deltas[n]).sum(0) for n in names}
        for s in strategies:
            outer = outer_config(s, "sharded")
            mean_only = OuterMerge.of(outer).of_mean
            for key, tensors in owned[s].items():
                chosen = [n for n in names if n in tensors]
                if not chosen:
                    continue
                # What an owner holds after the all-to-all: the sum of the Δ_r
                # (mean-only; dare's sparsified sum costs the same) or every Δ_r.
                contributions = {n: [[sums[n]] if mean_only else deltas[n]]
                                 for n in chosen}
                sync, updates, took = time_updates(outer, contributions, seed)
                seconds[s][key] += took
                if key == "all":
                    payload = {r: {n: deltas[n][r] for n in names} for r in hosted}
                    _, took = timed(lambda: sync.exchange.pack(payload, good, 0))
                    params = {n: torch.zeros(shape) for n in names}
                    _, applied = timed(lambda: sync.optimizer.apply(params, updates))
                    seconds[s]["shared"] += took + applied
        print(f"  {len(names)} x {tuple(shape)} done", flush=True)
        del deltas, sums

    print("\n| strategy | kind | replicated s (each rank) | rank0 s (rank 0) "
          "| sharded s per rank | sharded busiest s | sharded/replicated "
          "| target <= 1/2 | + every rank s |")
    print("|---|---|---:|---:|---|---:|---:|---|---:|")
    for s in strategies:
        whole = seconds[s]["all"]
        sharded = [seconds[s][rank] for rank in range(MERGE_RANKS)]
        ratio = max(sharded) / whole
        met = "met" if ratio <= MERGE_TARGET else "MISSED"
        print(f"| {s} | {kind(s)} | {whole:.2f} | {whole:.2f} "
              f"| {' / '.join(f'{t:.2f}' for t in sharded)} | {max(sharded):.2f} "
              f"| {ratio:.3f} | {met} | {seconds[s]['shared']:.2f} |")
    print("\n(replicated and rank0: one measurement, the whole set on one rank; "
          "+ every rank: summing or pruning rank 0's hosted Δ_r and applying the "
          "updates, the same under every placement and left out of the ratio)",
          flush=True)


# -- part 3: a replica spread over G workers ---------------------------------------------

SPREAD_REPLICAS = 4
SPREAD_POSITIONS = (1, 2)


def spread_deltas(replica: int, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(replica)
    return {name: 1e-3 * torch.randn(shape, generator=generator)
            for name, shape in shapes.items()}


def spread_outer(strategy: str) -> OuterConfig:
    return load_config([f"--outer.strategy={strategy}",
                        f"--scaling.replicas={SPREAD_REPLICAS}"]).outer


def spread_step(rank: int, world: int, positions: int, strategies: list[str],
                shapes: dict[str, torch.Size]) -> dict[str, tuple[int, int]]:
    """On each gloo rank of R = 4 replicas × G = `positions` workers: one outer step per
    strategy and the share within the replica; (bytes from other replicas, bytes within
    the replica) by strategy."""
    scaling = load_config([f"--scaling.replicas={SPREAD_REPLICAS}",
                           "--scaling.replicas_per_worker=1",
                           f"--scaling.workers_per_replica={positions}"]).scaling
    layout = WorkerLayout.create(scaling, rank, world)
    hosted = {rank // positions: spread_deltas(rank // positions, shapes)}
    figures = {}
    for strategy in strategies:
        sync = OuterSync(spread_outer(strategy), SPREAD_REPLICAS, 0, layout.sync_group,
                         positions, layout.position)
        params = {name: torch.zeros(shape) for name, shape in shapes.items()}
        stats = sync.step(params, hosted, round_index=0)
        within = (0 if layout.shard is None
                  else layout.shard.share(sync.shares(shapes), params, params))
        figures[strategy] = (stats.bytes_received, within)
    return figures


def spread_merge_seconds(strategy: str, positions: int, shapes: dict[str, torch.Size]
                         ) -> float:
    """The busiest position's merge seconds (payload, merge, momentum, update; the best of
    2 tries, the first warms up) with every replica's Δ_r in this process."""
    hosted = {r: spread_deltas(r, shapes) for r in range(SPREAD_REPLICAS)}
    seconds = []
    for position in range(positions):
        tries = []
        for _ in range(2):
            sync = OuterSync(spread_outer(strategy), SPREAD_REPLICAS, 0, None, positions,
                             position)
            params = {name: torch.zeros(shape) for name, shape in shapes.items()}
            tries.append(sync.step(params, hosted, round_index=0).merge_seconds)
        seconds.append(min(tries))
    return max(seconds)


def part3(strategies: list[str]) -> None:
    shapes = model_shapes(SCALED, LAYERS)
    p = float32_bytes(shapes)
    print(f"## Part 3: one outer step with each of R = {SPREAD_REPLICAS} replicas spread over "
          f"G workers (178M shapes / 8, P = {p / 2**20:.1f} MiB), busiest rank\n")
    print("| strategy | G | ranks | from other replicas ×P | within the replica ×P "
          "| merge s | vs G = 1: bytes, merge |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    results = {g: in_gloo_group(spread_step, SPREAD_REPLICAS * g, g, strategies, shapes)
               for g in SPREAD_POSITIONS}
    for strategy in strategies:
        whole: tuple[float, float] | None = None
        for g, per_rank in results.items():
            outer = max(r[strategy][0] for r in per_rank) / p
            within = max(r[strategy][1] for r in per_rank) / p
            merge = spread_merge_seconds(strategy, g, shapes)
            whole = whole or (outer, merge)
            print(f"| {strategy} | {g} | {len(per_rank)} | {outer:.3f} | {within:.3f} "
                  f"| {merge:.3f} | {outer / whole[0]:.2f}, {merge / whole[1]:.2f} |")
    print(flush=True)


# -- part 4: SparseLoCo's wire ---------------------------------------------------------

# (density, value bits): the paper's 1% and 3.125% (128 of each 4096), 2 bits; 4 bits.
SPARSE_WIRES = ((0.01, 2), (1 / 32, 2), (1 / 64, 2), (1 / 32, 4))


def part4() -> None:
    from isoloco_ray.workers.outer.chunk_topk_codec import ChunkTopKCodec

    shapes = model_shapes("178M", LAYERS)
    p = float32_bytes(shapes)
    workers, hosted = TARGET_RANKS, REPLICAS // TARGET_RANKS
    all_reduce, all_gather = 2 * (workers - 1) / workers * p, (workers - 1) * hosted * p
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) for shape in shapes.values()]
    print(f"## Part 4: SparseLoCo's wire, 178M ({p / 2**20:,.0f} MiB of float32 Δ_r), "
          f"R = {REPLICAS} on W = {workers}\n")
    print("| density | bits | sent per replica | P / sent | received per worker "
          "(gathered) | vs float32 all-reduce | vs float32 all-gather | encode s | "
          "decode s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for density, bits in SPARSE_WIRES:
        codec = ChunkTopKCodec(density, bits)
        sent = sum(codec.elements(shape) for shape in shapes.values())
        received = (workers - 1) * hosted * sent
        wire, encode_s = timed(lambda: codec.encode(tensors, torch.device("cpu")))
        _, decode_s = timed(lambda: codec.decode(wire, list(shapes.values())))
        assert wire.numel() == sent
        print(f"| {density:.4f} | {bits} | {sent / 2**20:,.2f} MiB | {p / sent:.1f}x "
              f"| {received / 2**20:,.2f} MiB | {all_reduce / received:.1f}x fewer "
              f"| {all_gather / received:.1f}x fewer | {encode_s:.2f} | {decode_s:.2f} |")
    print(flush=True)


# -- part 5: SparseLoCo's payloads merged by every worker, or by each tensor's owner --------

OWNER_WIRES = ((1 / 32, 2), (0.01, 2))


def part5(strategies: list[str], blocks: int, seed: int) -> None:
    """Every worker gathers every replica's packed payload and merges every tensor (what runs
    today, outer.placement=replicated), against each tensor's owner (plan.py's sharded split)
    gathering its tensors' payloads, merging them and sending its merged update back packed
    by the same codec (the other choice of issue 49: not built; the update would need an
    error-feedback residual of its own on the owner). Bytes by the codec's sizes; seconds
    measured in this process on the real shapes, per worker: decoding what arrives, the
    merge and outer momentum of its tensors, and for the owner the update's encode and the
    other owners' updates' decode. Busiest worker of W = 4, R = 8."""
    from isoloco_ray.workers.outer.chunk_topk_codec import ChunkTopKCodec

    shapes = model_shapes("178M", blocks)
    subset = ("every tensor" if blocks == LAYERS else
              f"embedding, {blocks} of {LAYERS} blocks, final norm, lm_head")
    workers, hosted = TARGET_RANKS, REPLICAS // TARGET_RANKS
    cpu = torch.device("cpu")
    print(f"## Part 5: SparseLoCo's payloads merged by every worker or by each tensor's "
          f"owner, R = {REPLICAS} on W = {workers}\n\n178M shapes ({subset}), CPU, "
          f"{torch.get_num_threads()} threads; busiest worker's bytes received and seconds "
          "(decode, merge, and for owners the update's encode and the others' updates' "
          "decode).\n", flush=True)
    print("| strategy | wire | every worker: received | every worker: s | owners: received "
          "(busiest) | owners: s (busiest) | owners / every worker: bytes | seconds |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    plans = {}
    for s in strategies:
        resolved = OuterMerge.of(outer_config(s, "sharded"))
        plans[s] = [set(names) for names in OuterPlan.build(
            shapes, resolved.merge, REPLICAS, workers, "sharded",
            resolved.orthogonalize_update).owned]
    for density, bits in OWNER_WIRES:
        codec = ChunkTopKCodec(density, bits)
        size = {name: codec.elements(shape) for name, shape in shapes.items()}
        wire = f"int{bits} top {density:.2%}"
        outers = {s: outer_config(s, "replicated", f"int{bits} top{density}")
                  for s in strategies}
        seconds = {s: {"all": 0.0, **dict.fromkeys(range(workers), 0.0)} for s in strategies}
        for name, shape in shapes.items():
            deltas = make_deltas(name, tuple(shape), REPLICAS, seed, cpu)
            packed = [codec.encode([d], cpu) for d in deltas]
            decoded, decode_s = timed(lambda: [codec.decode(w, [shape])[0] for w in packed])
            contributions = {name: [decoded]}  # one process holds every replica's
            for s in strategies:
                _, updates, merge_s = time_updates(outers[s], contributions, seed)
                update_wire, encode_s = timed(lambda: codec.encode([updates[name]], cpu))
                _, update_decode_s = timed(lambda: codec.decode(update_wire, [shape]))
                seconds[s]["all"] += decode_s + merge_s
                for rank, mine in enumerate(plans[s]):
                    seconds[s][rank] += (decode_s + merge_s + encode_s + update_decode_s
                                         if name in mine else update_decode_s)
        for s in strategies:
            everyone_bytes = (workers - 1) * hosted * sum(size.values())
            most = max((workers - 1) * hosted * sum(size[n] for n in mine)
                       + sum(size[n] for n in shapes if n not in mine) for mine in plans[s])
            busiest = max(seconds[s][rank] for rank in range(workers))
            print(f"| {s} | {wire} | {everyone_bytes / 2**20:,.2f} MiB "
                  f"| {seconds[s]['all']:.2f} | {most / 2**20:,.2f} MiB | {busiest:.2f} "
                  f"| {most / everyone_bytes:.2f} | {busiest / seconds[s]['all']:.2f} |",
                  flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, nargs="+", choices=(1, 2, 3, 4, 5),
                        default=[1, 2, 3, 4])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES,
                        default=list(STRATEGIES))
    parser.add_argument("--ranks", type=int, nargs="+", choices=(2, 4, 8),
                        help="part 1: outer group sizes W (default 2 4 8)")
    parser.add_argument("--blocks", type=int,
                        help=f"parts 2 and 5: the first N blocks of 178M (default {LAYERS})")
    parser.add_argument("--threads", type=int, default=2, help="part 2: torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="part 1 at W = 4 only, part 2 on 1 block")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds before the benchmark stops with its stacks (a hang)")
    args = parser.parse_args()
    exit_after(args.timeout)
    if args.blocks is not None and not 1 <= args.blocks <= LAYERS:
        parser.error(f"--blocks must be in 1..{LAYERS}")
    worlds = args.ranks or ([TARGET_RANKS] if args.quick else [2, 4, 8])
    blocks = args.blocks or (1 if args.quick else LAYERS)
    torch.set_num_threads(args.threads)
    for part in sorted(set(args.part)):
        started = time.perf_counter()
        if part == 1:
            part1(args.strategies, worlds)
        elif part == 2:
            part2(args.strategies, blocks, args.seed)
        elif part == 3:
            part3(args.strategies)
        elif part == 4:
            part4()
        else:
            part5(args.strategies, blocks, args.seed)
        took = time.perf_counter() - started
        print(f"(part {part}: {took:.0f} s wall)\n", flush=True)


if __name__ == "__main__":
    main()
