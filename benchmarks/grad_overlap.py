"""Inner-step seconds of a replica spread over G = 2 workers: the gradient all-reduce started
from backward, bucket by bucket (workers/parallel/gradient_average.py), against one all-reduce after
backward (what the workers did before).

    python benchmarks/grad_overlap.py [--preset 178M] [--steps 5] [--seq-len 128] [--threads 1]

Two gloo ranks on this machine, each computing the gradients of its rows of one batch (the
real Llama of the preset, random tokens) and averaging them with the other. Per mode the table
shows medians over the steps after the first: the step's seconds (forward, backward and the
average) and how long the average kept training waiting after backward. Both modes give the
same gradients bit for bit (tests/workers/test_gradient_average.py). On loopback with two
cores the transfer competes with backward for the cores; across nodes it does not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from isoloco_ray.config import load_config
from isoloco_ray.testing import exit_after
from isoloco_ray.workers.local import in_gloo_group
from isoloco_ray.workers.model import Runtime, build_model
from isoloco_ray.workers.parallel.collectives import TrafficCounter, all_reduce_sum
from isoloco_ray.workers.parallel.gradient_average import GradientAverage
from isoloco_ray.workers.replica import accumulate_gradients

VOCAB = 32000
MODES = ("after backward", "overlapped")


def step_seconds(rank: int, world: int, preset: str, steps: int, seq_len: int
                 ) -> dict[str, tuple[list[float], list[float], int]]:
    """Per mode: each step's seconds, the seconds after backward, and the buckets."""
    cfg = load_config([f"--model.preset={preset}"])
    model = build_model(cfg.model, vocab_size=VOCAB, seed=0)
    runtime = Runtime(device=torch.device("cpu"), bf16=False, forward=model)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    results = {}
    for mode in MODES:
        totals, waits = [], []
        average = GradientAverage(params, None, world)
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            batch = torch.randint(0, VOCAB, (2, seq_len), generator=generator)
            started = time.perf_counter()
            if mode == "overlapped":
                accumulate_gradients(runtime, batch, 2, average.arm)
                backward_done = time.perf_counter()
                average.finish()
            else:
                accumulate_gradients(runtime, batch, 2)
                backward_done = time.perf_counter()
                grads = [p.grad for p in params if p.grad is not None]
                all_reduce_sum(grads, TrafficCounter())
                for grad in grads:
                    grad /= world
            done = time.perf_counter()
            totals.append(done - started)
            waits.append(done - backward_done)
        results[mode] = (totals, waits, len(average.buckets))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="178M")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds before the benchmark stops with its stacks (a hang)")
    args = parser.parse_args()
    exit_after(args.timeout)
    ranks = in_gloo_group(step_seconds, 2, args.preset, args.steps, args.seq_len,
                          threads=args.threads)
    print(f"## Gradient average of G = 2 workers, {args.preset}, 2 x {args.seq_len} tokens "
          f"per worker, medians of steps 2..{args.steps}\n")
    print("| mode | buckets | step s | waiting after backward s |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        # The slower rank's figures: the step ends when both have their gradients.
        totals = [max(r[mode][0][i] for r in ranks) for i in range(1, args.steps)]
        waits = [max(r[mode][1][i] for r in ranks) for i in range(1, args.steps)]
        print(f"| {mode} | {ranks[0][mode][2]} | {statistics.median(totals):.3f} "
              f"| {statistics.median(waits):.3f} |")


if __name__ == "__main__":
    main()
