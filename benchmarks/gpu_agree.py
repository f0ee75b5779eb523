"""What one device must agree with: the wire codecs, a background outer sync, a resume.

1. codecs: every wire format (bfloat16, int8, float8, and top-k over each) decodes on the
   device to exactly what it decodes to on the CPU (bit for bit), on rows of very different
   ranges and an all-zero row.
2. background: a streaming run (outer.fragments=2, outer.delay=1: each fragment's sync runs in
   the background, on a side CUDA stream on a GPU, while training goes on) twice on the device,
   bit for bit, and against the same run on the CPU (float32, autocast off: the difference is
   the kernels' rounding, which AdamW's normalised steps amplify for near-zero gradients, so it
   is measured against how far training moved the parameters; a missed stream handoff, a stale
   or half-written update, moves them by as much as the update itself).
3. resume: two rounds straight, and one round then a resume from its checkpoint: the same
   parameters bit for bit on the device.

Each check prints one line, "NAME: ok ..." or "NAME: FAILED ..."; with --json PATH the results
are written there too. Exit status 1 when a check failed. Deterministic kernels are asked for
(torch.use_deterministic_algorithms, warn only), as a bit-for-bit promise on a GPU needs.

    python benchmarks/gpu_agree.py                        # on a GPU (offline, about a minute)
    python benchmarks/gpu_agree.py --device cpu           # the same checks on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpu_round import synthetic_data
from isoloco_ray.config import TrainConfig
from isoloco_ray.strategies import WIRE_FORMATS
from isoloco_ray.workers.local import StopAfterRound, local_env
from isoloco_ray.workers.loop import Trainer
from isoloco_ray.workers.outer.codec import codec_for

# How far the background run may end from the CPU's, as a fraction of how far training moved
# the parameters (‖θ_device − θ_cpu‖ / ‖θ_cpu − θ_0‖): rounding stays far below. Measured on
# the CPU for scale: an update landing one step late (delay 0 against 1) is 0.19 off, a
# fragment kept half local (mix 0.5 against 0) 0.08.
CPU_AGREEMENT = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the synthetic data is kept (default: a temporary directory)")
    return p.parse_args(argv)


def check_codecs(device: torch.device) -> dict[str, Any]:
    """Every wire format's roundtrip on `device` against the CPU's, bit for bit (for
    SparseLoCo's int2 / int4, the decoding of the CPU's bytes)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(48, 40, generator=g) * torch.logspace(-6, 3, 48).unsqueeze(1)
    rows[7] = 0.0
    cases = {}
    for comm_dtype, spec in WIRE_FORMATS.items():
        for topk in (0.25,) if spec.chunked else (None, 0.25):
            codec = codec_for(comm_dtype, topk)
            if spec.chunked:
                # Its statistics per tensor are float sums, rounded in each device's own
                # order; what must agree is the receivers' decoding of the sender's bytes.
                wire = codec.encode([rows], torch.device("cpu"))
                on_cpu = codec.decode(wire, [rows.shape])[0]
                on_device = codec.decode(wire.to(device), [rows.shape])[0].cpu()
            else:
                on_cpu = codec.roundtrip(rows)
                on_device = codec.roundtrip(rows.to(device)).cpu()
            name = comm_dtype + ("" if topk is None else f"+topk{topk}")
            cases[name] = bool(torch.equal(on_cpu, on_device))
    differing = [name for name, same in cases.items() if not same]
    return {"ok": not differing, "cases": cases,
            "line": (f"{len(cases)} formats decode as on the CPU" if not differing else
                     f"{', '.join(differing)} decode otherwise than on the CPU")}


def tiny_config(data_dir: Path, device: torch.device, **outer: Any) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"preset": "tiny"},
        "data": {"path": str(data_dir), "seq_len": 64, "batch_size": 4},
        "scaling": {"replicas": 2, "replicas_per_worker": 2,
                    "use_gpu": device.type == "cuda"},
        "inner": {"steps": 4},
        "outer": {"strategy": "diloco", **outer},
        "run": {"rounds": 2, "eval_every": 10**6, "eval_tokens": 256, "checkpoint_every": 1,
                "autocast": "off"},
    })


def train(cfg: TrainConfig, data_dir: Path, device: torch.device, **env: Any
          ) -> dict[str, torch.Tensor]:
    """The global parameters after training `cfg` in this process on `device` (on the CPU)."""
    return trained(cfg, data_dir, device, **env)[1]


def trained(cfg: TrainConfig, data_dir: Path, device: torch.device, **env: Any
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The global parameters before and after training `cfg` on `device` (on the CPU)."""
    trainer = Trainer(cfg, data_dir, local_env(device=device, **env))
    start = {name: tensor.detach().cpu().clone() for name, tensor in
             trainer.global_params.items()}
    try:
        trainer.run()
    except StopAfterRound:
        pass
    return start, {name: tensor.detach().cpu() for name, tensor in
                   trainer.global_params.items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def norm_of_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ over every tensor together (float64)."""
    return float(sum(float((a[name].double() - b[name].double()).pow(2).sum())
                     for name in a) ** 0.5)


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def check_background(data_dir: Path, device: torch.device) -> dict[str, Any]:
    """A streaming run with a background sync: twice on `device`, and once on the CPU."""
    cfg = tiny_config(data_dir, device, fragments=2, delay=1)
    first, second = train(cfg, data_dir, device), train(cfg, data_dir, device)
    start, cpu = trained(tiny_config(data_dir, torch.device("cpu"), fragments=2, delay=1),
                         data_dir, torch.device("cpu"))
    repeatable = identical(first, second)
    off_cpu = norm_of_difference(first, cpu) / norm_of_difference(cpu, start)
    finite = all(bool(torch.isfinite(t).all()) for t in first.values())
    return {"ok": repeatable and finite and off_cpu <= CPU_AGREEMENT,
            "repeatable": repeatable, "relative_difference_from_cpu": off_cpu,
            "max_difference_from_cpu": max_difference(first, cpu),
            "line": (f"two runs {'bit-identical' if repeatable else 'DIFFER'}; off the CPU's "
                     f"by {off_cpu:.2e} of how far training moved θ (bound "
                     f"{CPU_AGREEMENT:g}; max |Δθ| {max_difference(first, cpu):.2e})")}


def check_resume(data_dir: Path, device: torch.device, scratch: Path) -> dict[str, Any]:
    """Two rounds straight against one round, then a resume from its checkpoint."""
    cfg = tiny_config(data_dir, device)
    straight = train(cfg, data_dir, device)
    checkpoints = scratch / "checkpoints"
    train(cfg, data_dir, device, checkpoints=checkpoints, stop_after=1)
    resumed = train(cfg, data_dir, device, restore_from=checkpoints / "round_000001")
    same = identical(straight, resumed)
    return {"ok": same, "line": ("resumed after round 1: bit-identical to the straight run"
                                 if same else "resumed after round 1: DIFFERS from the "
                                 f"straight run by {max_difference(straight, resumed):.2e}")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_agree"))
    try:
        data_dir = synthetic_data(args.data_dir or scratch / "data", 1500, 64)
        checks = {"codecs": lambda: check_codecs(device),
                  "background": lambda: check_background(data_dir, device),
                  "resume": lambda: check_resume(data_dir, device, scratch)}
        results: dict[str, dict[str, Any]] = {}
        for name, check in checks.items():
            started = time.perf_counter()
            try:
                results[name] = check()
            except Exception as exc:  # noqa: BLE001 - one failure skips nothing else
                results[name] = {"ok": False, "line": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds"] = round(time.perf_counter() - started, 1)
            verdict = "ok" if results[name]["ok"] else "FAILED"
            print(f"{name}: {verdict} {results[name]['line']} ({results[name]['seconds']}s)",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(device), "checks": results}, indent=1))
    failed = [name for name, result in results.items() if not result["ok"]]
    if failed:
        print(f"agreement: {len(failed)} of {len(results)} checks failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
