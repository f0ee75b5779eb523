"""Merge speed: isoloco_ray.aggregators against the plain per-tensor SVD version.

Builds the matrix set of a Llama model (token embedding, per block q/k/v/o/gate/up/down and
two norms, final norm, untied lm_head) with synthetic pseudo-gradients from R replicas (a
shared low-rank signal with a power-law spectrum, per-replica low-rank parts, noise:
isoloco_ray/aggregators/reference.realistic_deltas, seeded per tensor), then times, per strategy:

- ours:  ``merge_all`` over each group of same-shape tensors (batched as in training),
- plain: the reference of isoloco_ray/aggregators/reference.py, one tensor at a time, full SVDs
         (float64 by default, ``--baseline-dtype float32`` for the float32 version),

on the same device and thread count, in one process, and reports the relative error of ours
against the plain result (aggregate ‖ours − plain‖/‖plain‖, and the worst tensor).

    python benchmarks/merge.py             # = --quick: 178M, R=8, CPU, 2 blocks + embedding
    python benchmarks/merge.py --full      # every tensor (tens of minutes on 2 CPU cores)
    python benchmarks/merge.py --model 512M --device cuda --strategies isoc tsv isocts
    python benchmarks/merge.py --sets issue --threads 2   # fixed matrix sets, see SETS

A subset run also prints full-model estimates: every block has the same shapes, and lm_head
the embedding's, so each measured tensor is counted once per tensor of the model it stands for.

``--sets`` times fixed matrix sets instead of a model (one matrix per shape, R replicas each):
per set the CPU and wall seconds of ours (``merge`` per matrix) and of the plain version
(float32 SVDs unless ``--baseline-dtype`` says otherwise), the minimum over ``--repeat`` runs
of each, interleaved, and the worst relative error of ours against the float64 reference.
"""

from __future__ import annotations

import argparse
import math
import time
import zlib

import torch

from isoloco_ray.aggregators import merge, merge_all
from isoloco_ray.aggregators.reference import realistic_deltas, ref_merge

MODELS = {
    "demo": dict(hidden=128, layers=4, heads=4, kv_heads=4, intermediate=352, vocab=4096),
    "178M": dict(hidden=1024, layers=9, heads=8, kv_heads=8, intermediate=2688, vocab=32000),
    "512M": dict(hidden=1536, layers=12, heads=12, kv_heads=12, intermediate=5440,
                 vocab=32000),
}
STRATEGIES = ("isoc", "tsv", "isocts", "ties", "mean")

# --sets: (strategy, label, shapes). "issue": the sets of the square-matrix speed issue (178M
# attention + MLP shapes for isoc, a hidden-512 model's for tsv / isocts); "178M": tsv and
# isocts on the 178M shapes too.
_SHAPES_178M = [(1024, 1024), (2688, 1024), (1024, 2688)]
_SHAPES_512 = [(512, 512), (1344, 512)]
SETS = {
    "issue": [("isoc", "178M q/o + up + down", _SHAPES_178M),
              ("tsv", "hidden 512: q + up", _SHAPES_512),
              ("isocts", "hidden 512: q + up", _SHAPES_512)],
    "178M": [("tsv", "178M q/o + up + down", _SHAPES_178M),
             ("isocts", "178M q/o + up + down", _SHAPES_178M)],
}


def model_tensors(model: str, blocks: int, head: bool
                  ) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, weight) for the embedding, the first `blocks` blocks, the final norm and,
    if `head`, lm_head; weight = how many tensors of the full model the entry stands for."""
    cfg = MODELS[model]
    h, i = cfg["hidden"], cfg["intermediate"]
    kv = h // cfg["heads"] * cfg["kv_heads"]
    per_block = cfg["layers"] / blocks
    tensors = [("embed_tokens.weight", (cfg["vocab"], h), 1.0 if head else 2.0)]
    for layer in range(blocks):
        p = f"layers.{layer}."
        tensors += [(p + name, shape, per_block) for name, shape in [
            ("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
            ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i)), ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,))]]
    tensors.append(("norm.weight", (h,), 1.0))
    if head:
        tensors.append(("lm_head.weight", (cfg["vocab"], h), 1.0))
    return tensors


def make_deltas(name: str, shape: tuple[int, ...], replicas: int, seed: int,
                device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    if len(shape) == 2:
        deltas = realistic_deltas(shape, replicas, g)
    else:
        deltas = [1e-3 * torch.randn(shape, generator=g) for _ in range(replicas)]
    return [d.to(device) for d in deltas]


def timed(fn, device: torch.device):
    """(result, wall seconds, CPU seconds of this process): on a shared machine the CPU
    seconds are the steadier measure, wall seconds also count time spent waiting."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run_sets(which: str, strategies: list[str], replicas: int, repeat: int, seed: int,
             device: torch.device, baseline: torch.dtype) -> None:
    """Time the fixed matrix sets of SETS[which] (or all of them): see the module docstring."""
    chosen = [entry for key in (SETS if which == "all" else [which]) for entry in SETS[key]
              if entry[0] in strategies]
    rows = []
    for strategy, label, shapes in chosen:
        deltas = {f"{label} {m}x{n}": make_deltas(f"{m}x{n}", (m, n), replicas, seed, device)
                  for m, n in shapes}
        best = {side: [math.inf, math.inf] for side in ("ours", "plain")}  # [cpu, wall]
        for _ in range(repeat):
            ours, plain = {}, {}
            for side, out, fn in [
                    ("ours", ours, lambda ds: merge(strategy, ds)),
                    ("plain", plain, lambda ds: ref_merge(strategy, ds, dtype=baseline))]:
                cpu_s = wall_s = 0.0
                for name, ds in deltas.items():
                    out[name], w, c = timed(lambda: fn(ds), device)
                    cpu_s, wall_s = cpu_s + c, wall_s + w
                best[side] = [min(best[side][0], cpu_s), min(best[side][1], wall_s)]
        worst_ref = worst_plain = 0.0
        for name, ds in deltas.items():
            exact = ref_merge(strategy, ds).double()
            worst_ref = max(worst_ref, ((ours[name].double() - exact).norm()
                                        / exact.norm()).item())
            worst_plain = max(worst_plain, ((ours[name].double() - plain[name].double()).norm()
                                            / plain[name].double().norm()).item())
        rows.append((strategy, label, best, worst_ref, worst_plain))
        print(f"  {strategy:7s} {label}: plain cpu {best['plain'][0]:.3f} s, ours cpu "
              f"{best['ours'][0]:.3f} s", flush=True)
        deltas.clear()
    print()
    print(f"{'strategy':9s}{'set':24s}{'plain cpu':>10s}{'ours cpu':>10s}{'speed-up':>9s}"
          f"{'plain s':>9s}{'ours s':>9s}{'speed-up':>9s}{'err f64':>9s}{'vs plain':>9s}")
    for strategy, label, best, worst_ref, worst_plain in rows:
        (pc, pw), (oc, ow) = best["plain"], best["ours"]
        print(f"{strategy:9s}{label:24s}{pc:10.3f}{oc:10.3f}{pc / oc:8.2f}x{pw:9.3f}{ow:9.3f}"
              f"{pw / ow:8.2f}x{worst_ref:9.1e}{worst_plain:9.1e}")
    print(f"(cpu: CPU seconds of the process, all threads; s: wall seconds; each the minimum "
          f"over {repeat} interleaved runs; err f64: worst relative error of ours against the "
          f"float64 SVD reference; vs plain: against the timed plain result)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="178M")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="the first 2 blocks + the embedding (the default)")
    size.add_argument("--full", action="store_true", help="every tensor of the model")
    size.add_argument("--blocks", type=int, help="the first N blocks + the embedding")
    size.add_argument("--sets", choices=[*SETS, "all"],
                      help="time the fixed matrix sets SETS[...] instead of a model")
    parser.add_argument("--repeat", type=int, default=3,
                        help="--sets: runs of each side, the minimum is reported")
    parser.add_argument("--baseline-dtype", choices=["float64", "float32"],
                        help="the plain version's dtype (default float64; float32 for --sets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int,
                        help="torch threads for both sides (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if args.sets:
        baseline = getattr(torch, args.baseline_dtype or "float32")
        print(f"matrix sets {args.sets!r}: R={args.replicas}, device {args.device}, "
              f"{torch.get_num_threads()} threads, plain = per-matrix "
              f"{str(baseline).removeprefix('torch.')} SVD", flush=True)
        run_sets(args.sets, args.strategies, args.replicas, args.repeat, args.seed, device,
                 baseline)
        return
    cfg = MODELS[args.model]
    blocks = cfg["layers"] if args.full else min(args.blocks or 2, cfg["layers"])
    baseline = getattr(torch, args.baseline_dtype or "float64")
    tensors = model_tensors(args.model, blocks, head=args.full)
    what = ("every tensor" if args.full else
            f"{blocks} of {cfg['layers']} blocks + embedding (lm_head has its shape)")
    print(f"model {args.model}: {what}, R={args.replicas}, device {args.device}, "
          f"{torch.get_num_threads()} threads, plain = per-tensor "
          f"{str(baseline).removeprefix('torch.')} SVD",
          flush=True)

    # Per strategy and side ("ours" / "plain"): measured wall and CPU seconds, and the
    # full-model estimate of the wall seconds; error sums; worst tensor.
    sides = ("ours", "plain")
    wall = {s: dict.fromkeys(sides, 0.0) for s in args.strategies}
    cpu = {s: dict.fromkeys(sides, 0.0) for s in args.strategies}
    model = {s: dict.fromkeys(sides, 0.0) for s in args.strategies}
    err_sq = dict.fromkeys(args.strategies, 0.0)
    ref_sq = dict.fromkeys(args.strategies, 0.0)
    worst = dict.fromkeys(args.strategies, 0.0)

    def add(strategy: str, side: str, weight: float, w: float, c: float) -> None:
        wall[strategy][side] += w
        cpu[strategy][side] += c
        model[strategy][side] += weight * w

    groups: dict[tuple[int, ...], list[tuple[str, float]]] = {}
    for name, shape, weight in tensors:
        groups.setdefault(shape, []).append((name, weight))
    for shape, members in groups.items():
        deltas = {name: make_deltas(name, shape, args.replicas, args.seed, device)
                  for name, _ in members}
        weight = members[0][1]  # the same for every tensor of a shape group
        for strategy in args.strategies:
            ours, w, c = timed(lambda: merge_all(strategy, deltas), device)
            add(strategy, "ours", weight, w, c)
            for name, _ in members:
                plain, w, c = timed(lambda: ref_merge(strategy, deltas[name], dtype=baseline),
                                    device)
                add(strategy, "plain", weight, w, c)
                e = (ours[name].double() - plain.double()).norm().item() ** 2
                r = plain.double().norm().item() ** 2
                err_sq[strategy] += e
                ref_sq[strategy] += r
                worst[strategy] = max(worst[strategy], math.sqrt(e / r) if r else 0.0)
            print(f"  {strategy:7s} {len(members)} x {shape}: cumulative wall s ours "
                  f"{wall[strategy]['ours']:.2f} plain {wall[strategy]['plain']:.2f}, CPU s "
                  f"ours {cpu[strategy]['ours']:.2f} plain {cpu[strategy]['plain']:.2f}",
                  flush=True)
        deltas.clear()

    print()
    print(f"{'strategy':9s}{'ours s':>9s}{'plain s':>9s}{'speed-up':>9s}{'ours cpu':>10s}"
          f"{'plain cpu':>10s}{'speed-up':>9s}{'rel err':>9s}{'worst':>9s}"
          f"{'model ours s':>13s}{'model plain s':>14s}")
    for s in args.strategies:
        rel = math.sqrt(err_sq[s] / ref_sq[s]) if ref_sq[s] else 0.0
        print(f"{s:9s}{wall[s]['ours']:9.2f}{wall[s]['plain']:9.2f}"
              f"{wall[s]['plain'] / wall[s]['ours']:8.2f}x{cpu[s]['ours']:10.2f}"
              f"{cpu[s]['plain']:10.2f}{cpu[s]['plain'] / cpu[s]['ours']:8.2f}x"
              f"{rel:9.1e}{worst[s]:9.1e}{model[s]['ours']:13.1f}{model[s]['plain']:14.1f}")
    print("(s: wall seconds; cpu: CPU seconds of the process, all threads; model: wall-second "
          "estimates for every tensor of the model" + ("" if args.full else ", from the subset")
          + ")")


if __name__ == "__main__":
    main()
