"""Merge speed: isoloco_ray.aggregators against the plain per-tensor SVD version.

Builds the matrix set of a Llama model (token embedding, per block q/k/v/o/gate/up/down and
two norms, final norm, untied lm_head) with synthetic pseudo-gradients from R replicas (a
shared low-rank signal with a power-law spectrum, per-replica low-rank parts, noise:
tests/reference_merges.realistic_deltas, seeded per tensor), then times, per strategy:

- ours:  ``merge_all`` over each group of same-shape tensors (batched as in training),
- plain: the reference of tests/reference_merges.py, one tensor at a time, full SVDs
         (float64 by default, ``--baseline-dtype float32`` for the float32 version),

on the same device and thread count, in one process, and reports the relative error of ours
against the plain result (aggregate ‖ours − plain‖/‖plain‖, and the worst tensor).

    python benchmarks/merge.py             # = --quick: 178M, R=8, CPU, 2 blocks + embedding
    python benchmarks/merge.py --full      # every tensor (tens of minutes on 2 CPU cores)
    python benchmarks/merge.py --model 512M --device cuda --strategies isoc tsv isocts

A subset run also prints full-model estimates: every block has the same shapes, and lm_head
the embedding's, so each measured tensor is counted once per tensor of the model it stands for.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_merges import realistic_deltas, ref_merge  # noqa: E402

from isoloco_ray.aggregators import merge_all  # noqa: E402

MODELS = {
    "demo": dict(hidden=128, layers=4, heads=4, kv_heads=4, intermediate=352, vocab=4096),
    "178M": dict(hidden=1024, layers=9, heads=8, kv_heads=8, intermediate=2688, vocab=32000),
    "512M": dict(hidden=1536, layers=12, heads=12, kv_heads=12, intermediate=5440,
                 vocab=32000),
}
STRATEGIES = ("isoc", "tsv", "isocts", "ties", "mean")


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
    parser.add_argument("--baseline-dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int,
                        help="torch threads for both sides (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    cfg = MODELS[args.model]
    blocks = cfg["layers"] if args.full else min(args.blocks or 2, cfg["layers"])
    baseline = getattr(torch, args.baseline_dtype)
    tensors = model_tensors(args.model, blocks, head=args.full)
    what = ("every tensor" if args.full else
            f"{blocks} of {cfg['layers']} blocks + embedding (lm_head has its shape)")
    print(f"model {args.model}: {what}, R={args.replicas}, device {args.device}, "
          f"{torch.get_num_threads()} threads, plain = per-tensor {args.baseline_dtype} SVD",
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
        deltas = {}  # free this group's tensors before the next is made

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
