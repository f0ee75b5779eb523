"""Training tokens/s of the Ray run against a plain single-process loop on the same machine.

    python benchmarks/throughput.py [--rounds N] [--steps H] [train flags ...]

Both do the same inner steps of the same config on the demo data: the Ray run as
`python -m isoloco_ray.train` does it (R/V workers, Ray Data streams, outer all-reduce), timed
after start-up (its summary's tokens_per_s: outer rounds only, no eval, no start-up); the plain
loop is one process with every core, no Ray, the replicas one after another, reading shards
with pyarrow. Prints both, the ratio, and Ray's start-up: seconds to start the cluster, the
first round against a steady one (the first starts the data streams), and the wall time the run
spends outside its rounds. Targets: ratio >= 0.9, first round <= 2x a steady one.
`--ray-only` skips the plain loop (e.g. to compare worker layouts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from isoloco_ray.config import load_config
from isoloco_ray.data.prepare.documents import ensure_demo_data
from isoloco_ray.testing import exit_after
from isoloco_ray.workers.local import run_local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--storage", default="/tmp/isoloco_ray_bench")
    parser.add_argument("--ray-only", action="store_true", help="skip the plain loop")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds before the benchmark stops with its stacks (a hang)")
    args, train_flags = parser.parse_known_args()
    exit_after(args.timeout)
    flags = [f"--run.rounds={args.rounds}", f"--run.eval_every={args.rounds}",
             "--run.eval_tokens=4096", *train_flags]
    data_dir = ensure_demo_data()

    cfg = load_config(flags)
    plain = None
    if not args.ray_only:
        single = load_config(flags + [f"--scaling.replicas_per_worker={cfg.scaling.replicas}"])
        started = time.perf_counter()
        plain, _ = run_local(single, data_dir, threads_per_worker=os.cpu_count() or 1)
        plain_wall = time.perf_counter() - started

    name = f"throughput-{time.time_ns()}"
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "isoloco_ray.train", *flags, f"--run.name={name}",
         f"--run.storage_path={args.storage}"], check=True, capture_output=True, text=True,
        timeout=args.timeout)
    ray_wall = time.perf_counter() - started
    lines = out.stdout.strip().splitlines()
    summary_path = Path(lines[-1].removeprefix("summary: "))
    ray = json.loads(summary_path.read_text())
    layout = next(line for line in lines if line.startswith("isoloco_ray: "))

    print(f"config: {' '.join(flags)}  ({os.cpu_count()} cores)")
    print(layout.split(", data ")[0])
    print(f"{'run':<28}{'tokens/s':>12}{'train s':>10}{'wall s':>10}")
    if plain is not None:
        print(f"{'plain loop, 1 process':<28}{plain['tokens_per_s']:>12,.0f}"
              f"{plain['train_seconds']:>10.1f}{plain_wall:>10.1f}")
    print(f"{'Ray Train + Ray Data':<28}{ray['tokens_per_s']:>12,.0f}"
          f"{ray['train_seconds']:>10.1f}{ray_wall:>10.1f}")
    if plain is not None:
        print(f"ratio Ray / plain: {ray['tokens_per_s'] / plain['tokens_per_s']:.2f}  "
              "(target >= 0.9)")
    first = ray["first_round_seconds"]
    steady = ((ray["train_seconds"] - first) / (ray["rounds"] - 1) if ray["rounds"] > 1
              else math.nan)
    print(f"start-up: Ray cluster {ray['ray_start_seconds']:.1f} s; first round {first:.1f} s "
          f"vs a steady round {steady:.1f} s ({first / steady:.2f}x, target <= 2); "
          f"wall outside the rounds {ray_wall - ray['train_seconds']:.0f} s (Python and Ray "
          "start, datasets, workers, evals, export, teardown"
          + (f"; the plain loop's: {plain_wall - plain['train_seconds']:.0f} s)" if plain
             else ")"))


if __name__ == "__main__":
    main()
