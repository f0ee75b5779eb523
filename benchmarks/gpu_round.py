"""Full outer rounds with two replicas on one worker (device), per outer strategy.

Runs the workers' own `Trainer` in this process with a WorkerEnv on the chosen device (what a
Ray Train worker gets, without Ray; `workers.local.run_local` is CPU-only), on a synthetic
dataset prepared locally (no network: a BPE trained on generated text), and prints each
strategy's last round: inner seconds, merge seconds, tokens/s; and on a GPU the worker's peak
memory (torch.cuda.max_memory_allocated) against gpu_memory's estimate for the run, the figure
`python -m isoloco_ray.train` checks before a GPU run (on CPU: the estimate, the measurement
skipped).

    python benchmarks/gpu_round.py --strategies isoloco tsv                      # on a GPU
    python benchmarks/gpu_round.py --device cpu --preset tiny --steps 1 --rounds 1  # quick check
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

import torch

from isoloco_ray import gpu_memory
from isoloco_ray.config import ModelConfig, TrainConfig
from isoloco_ray.testing import synthetic_documents
from isoloco_ray.workers.local import local_env
from isoloco_ray.workers.loop import Trainer
from isoloco_ray.workers.model import parameter_shapes


def synthetic_data(out: Path, documents: int, block_len: int) -> Path:
    """A prepared dataset of generated sentences in `out` (reused when already there)."""
    from isoloco_ray.data.prepare.documents import prepare_dataset

    if (out / "meta.json").is_file():
        return out
    prepare_dataset(synthetic_documents(documents, seed=0), out, vocab_size=2048,
                    block_len=block_len, shard_blocks=32, valid_fraction=0.02,
                    test_fraction=0.01, source_name="gpu_round synthetic")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "demo", "178M", "512M"], default="178M")
    p.add_argument("--strategies", nargs="+", default=["isoloco", "tsv"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16, help="sequences per inner step, per replica")
    p.add_argument("--steps", type=int, default=5, help="H, inner steps per round")
    p.add_argument("--rounds", type=int, default=2, help="the first one also warms up")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--documents", type=int, default=20000, help="synthetic documents")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the synthetic data is kept (default: a temporary directory)")
    return p.parse_args(argv)


def run_strategy(args: argparse.Namespace, strategy: str, data_dir: Path) -> dict:
    """The last round's metrics of a run of `strategy` with R = V = 2 on `args.device`."""
    seq_len = min(args.seq_len, ModelConfig(preset=args.preset).max_seq_len)
    cfg = TrainConfig.model_validate({
        "model": {"preset": args.preset},
        "data": {"path": str(data_dir), "seq_len": seq_len, "batch_size": args.batch},
        "scaling": {"replicas": 2, "replicas_per_worker": 2,
                    "use_gpu": args.device.startswith("cuda")},
        "inner": {"steps": args.steps},
        "outer": {"strategy": strategy},
        "run": {"rounds": args.rounds, "eval_every": 10**6, "eval_tokens": 4 * seq_len,
                "checkpoint_every": 10**6, "compile": args.compile},
    })
    reports: list[dict] = []
    env = local_env(reports=reports, device=args.device)
    cuda = env.device.type == "cuda"
    if cuda:  # the peak of this strategy's worker alone, not of the one before
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)
    trainer = Trainer(cfg, data_dir, env)
    trainer.run()
    vocab = trainer.dataset.meta.vocab_size
    memory = gpu_memory.estimate(cfg, parameter_shapes(cfg.model, vocab), vocab)
    return {**reports[-1], "memory": memory_line(strategy, memory, env.device)}


def memory_line(strategy: str, memory: gpu_memory.GpuMemory, device: torch.device) -> str:
    """gpu_memory's estimate for this run's worker (what `train` checks before a GPU run and
    prints as "GPU memory per worker") against the peak torch's allocator measured. The
    estimate's peak counts RUNTIME_BYTES for the CUDA context and the allocator's slack, which
    max_memory_allocated leaves out: the tensors are compared without it."""
    estimated = (memory.peak_bytes - gpu_memory.RUNTIME_BYTES) / gpu_memory.GIB
    if device.type != "cuda":
        return (f"memory {strategy}: estimated peak {estimated:.2f} GiB of tensors (state "
                f"{memory.state_bytes / gpu_memory.GIB:.2f}); measured: skipped on "
                f"{device.type} (torch.cuda.max_memory_allocated needs a GPU)")
    allocated = torch.cuda.max_memory_allocated(device) / gpu_memory.GIB
    reserved = torch.cuda.max_memory_reserved(device) / gpu_memory.GIB
    runtime = gpu_memory.RUNTIME_BYTES / gpu_memory.GIB
    return (f"memory {strategy}: estimated peak {estimated:.2f} GiB of tensors (state "
            f"{memory.state_bytes / gpu_memory.GIB:.2f}, + {runtime:.0f} runtime), measured "
            f"{allocated:.2f} allocated, {reserved:.2f} reserved: measured/estimated "
            f"{allocated / estimated:.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    scratch = None
    if args.data_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="gpu_round"))
        args.data_dir = scratch / "data"
    block_len = max(args.seq_len, 64)
    started = time.perf_counter()
    try:
        data_dir = synthetic_data(args.data_dir, args.documents, block_len)
        print(f"data ready in {time.perf_counter() - started:.0f}s: {data_dir}", flush=True)
        for strategy in args.strategies:
            m = run_strategy(args, strategy, data_dir)
            print(f"{strategy:>8} {args.preset} R=2 on one {args.device} worker, round "
                  f"{m['round']}: {m['round_seconds']:.2f}s (inner {m['inner_seconds']:.2f}s, "
                  f"merge {m['outer_merge_seconds']:.3f}s, comm {m['outer_comm_seconds']:.3f}s)"
                  f" {m['tokens_per_s']:,.0f} tok/s, loss {m['loss']:.3f}", flush=True)
            print(m["memory"], flush=True)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
