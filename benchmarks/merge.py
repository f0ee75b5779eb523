"""Merge speed: isoloco_ray.aggregators against the plain per-tensor SVD version.

Builds the full matrix set of a Llama model (token embedding, per block q/k/v/o/gate/up/down
and two norms, final norm, untied lm_head) with synthetic pseudo-gradients from R replicas
(a shared low-rank signal with a power-law spectrum, per-replica low-rank parts, noise;
tests/reference_merges.realistic_deltas, seeded per tensor), then times, per strategy:

- ours:  ``merge_all`` over each group of same-shape tensors (batched as in training),
- plain: the reference of tests/reference_merges.py, one tensor at a time, full SVDs
         (float64 by default, ``--baseline-dtype float32`` for the float32 version),

on the same device and thread count, in one process, and reports the relative error of ours
against the plain result (aggregate ‖ours − plain‖/‖plain‖ over the model, and the worst tensor).

    python benchmarks/merge.py                      # 178M, R=8, CPU, first 2 blocks + embeddings
    python benchmarks/merge.py --full               # every block (minutes with plain SVDs)
    python benchmarks/merge.py --model 512M --device cuda --strategies isoc tsv isocts

The subset run also prints full-model estimates: embeddings + head measured, blocks scaled
by (blocks in the model / blocks run), since every block has the same shapes.
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


def model_tensors(model: str, blocks: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_block_tensor) for the embeddings, the first `blocks` blocks, the head."""
    cfg = MODELS[model]
    h, i = cfg["hidden"], cfg["intermediate"]
    kv = h // cfg["heads"] * cfg["kv_heads"]
    tensors = [("embed_tokens.weight", (cfg["vocab"], h), False)]
    for layer in range(blocks):
        p = f"layers.{layer}."
        tensors += [(p + name, shape, True) for name, shape in [
            ("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
            ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i)), ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,))]]
    tensors += [("norm.weight", (h,), False), ("lm_head.weight", (cfg["vocab"], h), False)]
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
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="178M")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="first 2 blocks + embeddings and head (the default)")
    size.add_argument("--full", action="store_true", help="every block")
    size.add_argument("--blocks", type=int, help="first N blocks + embeddings and head")
    parser.add_argument("--baseline-dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(args.device)
    cfg = MODELS[args.model]
    blocks = cfg["layers"] if args.full else (args.blocks or min(2, cfg["layers"]))
    baseline = getattr(torch, args.baseline_dtype)
    tensors = model_tensors(args.model, blocks)
    print(f"model {args.model}: {blocks} of {cfg['layers']} blocks + embeddings + head "
          f"({'full' if blocks == cfg['layers'] else 'subset'}), R={args.replicas}, "
          f"device {args.device}, {torch.get_num_threads()} threads, "
          f"plain = per-tensor {args.baseline_dtype} SVD", flush=True)

    # seconds[strategy][ours|plain][block|other], error sums, worst tensor error
    seconds = {s: {k: {True: 0.0, False: 0.0} for k in ("ours", "plain")}
               for s in args.strategies}
    err_sq = {s: 0.0 for s in args.strategies}
    ref_sq = {s: 0.0 for s in args.strategies}
    worst = {s: 0.0 for s in args.strategies}

    groups: dict[tuple[int, ...], list[tuple[str, bool]]] = {}
    for name, shape, in_block in tensors:
        groups.setdefault(shape, []).append((name, in_block))
    for shape, members in groups.items():
        deltas = {name: make_deltas(name, shape, args.replicas, args.seed, device)
                  for name, _ in members}
        in_block = members[0][1]
        for strategy in args.strategies:
            ours, t = timed(lambda: merge_all(strategy, deltas), device)
            seconds[strategy]["ours"][in_block] += t
            for name, _ in members:
                plain, t = timed(lambda: ref_merge(strategy, deltas[name], dtype=baseline),
                                 device)
                seconds[strategy]["plain"][in_block] += t
                e = (ours[name].double() - plain.double()).norm().item() ** 2
                r = plain.double().norm().item() ** 2
                err_sq[strategy] += e
                ref_sq[strategy] += r
                worst[strategy] = max(worst[strategy], math.sqrt(e / r) if r else 0.0)
            print(f"  {strategy:7s} {len(members)} x {shape}: ours "
                  f"{sum(seconds[strategy]['ours'].values()):8.2f}s  plain "
                  f"{sum(seconds[strategy]['plain'].values()):8.2f}s (cumulative)", flush=True)
        del deltas

    scale = cfg["layers"] / blocks
    print()
    print(f"{'strategy':9s}{'ours s':>10s}{'plain s':>10s}{'speed-up':>10s}"
          f"{'rel err':>11s}{'worst':>11s}{'full ours s':>13s}{'full plain s':>14s}")
    for s in args.strategies:
        ours = sum(seconds[s]["ours"].values())
        plain = sum(seconds[s]["plain"].values())
        full = {k: seconds[s][k][False] + scale * seconds[s][k][True] for k in ("ours", "plain")}
        rel = math.sqrt(err_sq[s] / ref_sq[s]) if ref_sq[s] else 0.0
        print(f"{s:9s}{ours:10.2f}{plain:10.2f}{plain / ours:9.2f}x{rel:11.1e}{worst[s]:11.1e}"
              f"{full['ours']:13.1f}{full['plain']:14.1f}")
    if blocks != cfg["layers"]:
        print(f"(full-model columns: embeddings + head as measured, blocks x {scale:g})")


if __name__ == "__main__":
    main()
