"""Inner-step throughput and MFU of one model on one device, through the project's own code.

Builds the Llama with isoloco_ray.workers.model (build_model, Runtime: bf16 autocast on GPU,
optional torch.compile) and times the inner step the workers run (replica.inner_step: gradients,
clipping, fused AdamW on CUDA, the LR schedule) on random tokens, so no data is needed.

    python benchmarks/gpu_step.py --preset 178M --steps 10               # on a GPU
    python benchmarks/gpu_step.py --device cpu --preset tiny --steps 2   # a quick check anywhere

MFU = 6 * parameters * tokens/s / peak FLOPS (the usual estimate: it leaves out attention's
seq_len-dependent FLOPs, so it slightly understates the work at long contexts). --peak-flops
is the device's dense bf16 peak: 989e12 for an H100 SXM, the same for an H200.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from isoloco_ray import gpu_memory
from isoloco_ray.config import InnerConfig, ModelConfig, load_config
from isoloco_ray.workers.model import Runtime, build_model, count_parameters, parameter_shapes
from isoloco_ray.workers.inner_optimizer import make_inner_optimizer
from isoloco_ray.workers.replica import inner_step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "demo", "178M", "512M"], default="178M")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (Llama-2: 32000)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=None, help="default: --batch")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, "
                   "allocator, cuBLAS heuristics)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the forward")
    p.add_argument("--peak-flops", type=float, default=989e12,
                   help="dense bf16 peak of the device (H100/H200 SXM: 989e12)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    args = p.parse_args(argv)
    args.seq_len = min(args.seq_len, ModelConfig(preset=args.preset).max_seq_len)
    return args


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    """Time `args.steps` inner steps after `args.warmup` untimed ones."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=args.preset), args.vocab, seed=0).to(device)
    runtime = Runtime.create(model, device, args.autocast, args.compile)
    optimizer, schedule = make_inner_optimizer(model, InnerConfig(lr=1e-3, weight_decay=0.1),
                                               total_steps=args.warmup + args.steps,
                                               fused=device.type == "cuda")
    # Host batches, as the data stream hands them over (pinned + async copy on GPU).
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len)) for _ in range(2)]
    micro = args.micro_batch or args.batch

    def step(i: int) -> torch.Tensor:
        return inner_step(runtime, optimizer, schedule, [batches[i % 2]], micro, clip=1.0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(args.warmup):
        step(i)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    seconds = time.perf_counter() - started
    params = count_parameters(model)
    tokens_per_s = args.steps * args.batch * args.seq_len / seconds
    return {
        "preset": args.preset, "device": str(device), "params": params,
        "bf16": runtime.bf16, "compile": args.compile, "batch": args.batch,
        "seq_len": args.seq_len, "step_ms": 1000 * seconds / args.steps,
        "tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / args.peak_flops,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else 0.0),
        "estimated_mem_gib": estimated_gib(args),
        "loss": float(loss),
    }


def estimated_gib(args: argparse.Namespace) -> float:
    """gpu_memory's estimate of what this measurement holds: the model, its gradients and
    AdamW moments, and one micro-batch's activations and logits (no θ, no outer step)."""
    cfg = load_config([f"--model.preset={args.preset}", f"--data.seq_len={args.seq_len}",
                       f"--data.batch_size={args.batch}",
                       f"--data.micro_batch_size={args.micro_batch or args.batch}",
                       f"--run.autocast={args.autocast}", "--scaling.replicas=1",
                       "--scaling.replicas_per_worker=1",
                       f"--scaling.use_gpu={args.device.startswith('cuda')}"])
    memory = gpu_memory.estimate(cfg, parameter_shapes(cfg.model, args.vocab), args.vocab)
    held = sum(memory.state[part] for part in ("parameters", "gradients", "AdamW moments"))
    return (held + sum(memory.step.values())) / gpu_memory.GIB


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return
    # torch.cuda.max_memory_allocated measures a GPU only: on CPU the estimate stands alone.
    peak = (f"{result['peak_mem_gib']:.1f} GiB" if str(result["device"]).startswith("cuda")
            else "not measured on cpu")
    print(f"{result['preset']:>5} {result['params'] / 1e6:7.1f}M  bf16={result['bf16']!s:5} "
          f"compile={result['compile']!s:5} batch {result['batch']}x{result['seq_len']}: "
          f"{result['step_ms']:8.1f} ms/step {result['tokens_per_s']:>12,.0f} tok/s "
          f"MFU {100 * result['mfu']:5.1f}%  peak mem {peak} "
          f"(estimated {result['estimated_mem_gib']:.1f} GiB)")


if __name__ == "__main__":
    main()
