"""Per-round cost of the workers' agreement check: the full sha256 of the global parameters
(`checkpoint.parameters_sha256`: every value copied to the CPU and hashed; now only on
checkpoint rounds and at the end) against the on-device checksum that every other round uses
(`checkpoint.parameters_checksum`: integer sums of the float32 bits, a few hundred bytes to the
host). Freshly initialised models of the given presets, Llama-2's 32,000-token vocabulary;
the minimum of --repeat runs of each.

    python benchmarks/state_check.py                   # demo and 178M on CPU
    python benchmarks/state_check.py --models 178M 512M --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from isoloco_ray.config import ModelConfig
from isoloco_ray.workers.model import build_model, count_parameters
from isoloco_ray.workers.state.checkpoint import parameters_checksum, parameters_sha256

VOCAB = 32000


def best_seconds(fn, repeat: int, device: torch.device) -> float:
    """The fastest of `repeat` calls, CUDA synchronized around each."""
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "178M"],
                        choices=["tiny", "demo", "178M", "512M"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    print(f"device {args.device}, {torch.get_num_threads()} threads, best of {args.repeat}")
    print(f"{'model':8s}{'parameters':>14s}{'sha256 s':>10s}{'checksum s':>12s}{'speed-up':>10s}")
    for preset in args.models:
        net = build_model(ModelConfig(preset=preset), VOCAB, seed=0).to(device)
        params = {name: p.detach() for name, p in net.named_parameters()}
        full = best_seconds(lambda: parameters_sha256(params), args.repeat, device)
        cheap = best_seconds(lambda: parameters_checksum(params), args.repeat, device)
        print(f"{preset:8s}{count_parameters(net):>14,d}{full:>10.3f}{cheap:>12.3f}"
              f"{full / cheap:>9.1f}x", flush=True)


if __name__ == "__main__":
    main()
