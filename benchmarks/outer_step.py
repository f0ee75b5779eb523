"""Seconds of one outer step (`OuterSync.step`) on a compressed wire with error feedback, in
one process: R replicas hosted on one worker, on a model preset's real tensor shapes, the Δ_r
synthetic and seeded. What it shows: the cost of packing, encoding, decoding and merging per
round on this machine, apart from training and the network (one rank: the all-gather copies
locally).

    python benchmarks/outer_step.py                      # demo shapes, R = 4, 2-bit top-3.1%
    python benchmarks/outer_step.py --preset 178M --replicas 8 --rounds 4

Prints a table: strategy, wire, the median step over the rounds after the first (which
allocates the residuals)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from isoloco_ray.config import load_config
from isoloco_ray.workers.model import parameter_shapes
from isoloco_ray.workers.outer.step import OuterSync

WIRES = {  # strategy -> its flags for a 2-bit top-k wire with error feedback
    "sparseloco": [],  # its defaults: int2, top-1/32 per chunk, β 0.95 accumulator
    "diloco": ["--outer.comm_dtype=int2", "--outer.topk=0.03125",
               "--outer.error_feedback=true", "--outer.error_decay=0.95",
               "--outer.placement=replicated"],
    "ties": ["--outer.comm_dtype=int2", "--outer.topk=0.03125",
             "--outer.error_feedback=true", "--outer.placement=replicated"],
}


def step_seconds(strategy: str, preset: str, replicas: int, rounds: int) -> float:
    cfg = load_config([f"--outer.strategy={strategy}", f"--scaling.replicas={replicas}",
                       f"--scaling.replicas_per_worker={replicas}", f"--model.preset={preset}",
                       *WIRES[strategy]])
    shapes = parameter_shapes(cfg.model, cfg.model.vocab_size or 8192)
    generator = torch.Generator().manual_seed(0)
    sync = OuterSync(cfg.outer, replicas, seed=0)
    params = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    feedback: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(replicas)}
    times = []
    for round_index in range(rounds):
        hosted = {r: {n: 1e-2 * torch.randn(s, generator=generator) for n, s in shapes.items()}
                  for r in range(replicas)}
        started = time.perf_counter()
        sync.step(params, hosted, round_index, feedback=feedback)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    print(f"outer step, {args.preset} shapes, R = {args.replicas} on one worker, "
          f"{torch.get_num_threads()} torch threads")
    print("| strategy | wire | step s (median) |")
    print("|---|---|---:|")
    for strategy, flags in WIRES.items():
        wire = " ".join(flags) or "its defaults"
        seconds = step_seconds(strategy, args.preset, args.replicas, args.rounds)
        print(f"| {strategy} | {wire} | {seconds:.3f} |", flush=True)


if __name__ == "__main__":
    main()
