"""Training tokens/s of the Ray run against a plain single-process loop on the same machine.

    python benchmarks/throughput.py [--rounds N] [--steps H] [train flags ...]

Both do the same inner steps of the same config on the demo data: the Ray run as
`python -m isoloco_ray.train` does it (R/V workers, Ray Data streams, outer all-reduce), timed
after start-up (its summary's tokens_per_s: outer rounds only, no eval, no start-up); the plain
loop is one process with every core, no Ray, the replicas one after another, reading shards
with pyarrow. Prints both, the ratio, and Ray's start-up seconds. Target ratio: >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from isoloco_ray.config import load_config
from isoloco_ray.data.prepare import ensure_demo_data
from isoloco_ray.workers.local import run_local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--storage", default="/tmp/isoloco_ray_bench")
    args, train_flags = parser.parse_known_args()
    flags = [f"--run.rounds={args.rounds}", f"--run.eval_every={args.rounds}",
             "--run.eval_tokens=4096", *train_flags]
    data_dir = ensure_demo_data()

    cfg = load_config(flags)
    single = load_config(flags + [f"--scaling.replicas_per_worker={cfg.scaling.replicas}"])
    started = time.perf_counter()
    plain, _ = run_local(single, data_dir, threads_per_worker=os.cpu_count() or 1)
    plain_wall = time.perf_counter() - started

    name = f"throughput-{time.time_ns()}"
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "isoloco_ray.train", *flags, f"--run.name={name}",
         f"--run.storage_path={args.storage}"], check=True, capture_output=True, text=True)
    ray_wall = time.perf_counter() - started
    summary_path = Path(out.stdout.strip().splitlines()[-1].removeprefix("summary: "))
    ray = json.loads(summary_path.read_text())
    startup = ray_wall - ray["train_seconds"] - (plain_wall - plain["train_seconds"])

    print(f"config: {' '.join(flags)}  (R={cfg.scaling.replicas}, "
          f"{cfg.scaling.num_workers} Ray workers, {os.cpu_count()} cores)")
    print(f"{'run':<28}{'tokens/s':>12}{'train s':>10}{'wall s':>10}")
    print(f"{'plain loop, 1 process':<28}{plain['tokens_per_s']:>12,.0f}"
          f"{plain['train_seconds']:>10.1f}{plain_wall:>10.1f}")
    print(f"{'Ray Train + Ray Data':<28}{ray['tokens_per_s']:>12,.0f}"
          f"{ray['train_seconds']:>10.1f}{ray_wall:>10.1f}")
    print(f"ratio Ray / plain: {ray['tokens_per_s'] / plain['tokens_per_s']:.2f}  "
          f"(target >= 0.9); Ray start-up and teardown overhead ~{startup:.0f} s")


if __name__ == "__main__":
    main()
