"""Checkpoint size and save/restore seconds: measured on the demo, computed for the paper's sizes.

    python benchmarks/checkpoint.py [--replicas 4]

Measures one worker hosting every replica of the demo run (what all workers write together),
after one round so AdamW's moments exist. The 178M / 512M rows are computed from the parameter
count: global parameters + outer momentum (diloco) + every replica's two AdamW moments, float32.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from isoloco_ray.config import MODEL_PRESETS, load_config
from isoloco_ray.data.prepare.documents import ensure_demo_data
from isoloco_ray.workers.local import local_env
from isoloco_ray.workers.loop import Trainer


def llama_parameters(preset: str, vocab: int = 32000) -> int:
    """Parameters of an untied Llama of the preset (embeddings, attention, MLP, norms)."""
    p = MODEL_PRESETS[preset]
    h, layers, inter = p["hidden_size"], p["num_layers"], p["intermediate_size"]
    kv = h * p["num_kv_heads"] // p["num_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return 2 * vocab * h + layers * per_layer + h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    data_dir = ensure_demo_data()
    cfg = load_config([f"--scaling.replicas={args.replicas}",
                       f"--scaling.replicas_per_worker={args.replicas}", "--inner.steps=1",
                       "--run.rounds=1", "--run.eval_tokens=128"])
    trainer = Trainer(cfg, data_dir, local_env())
    trainer.run()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        started = time.perf_counter()
        trainer.save(directory)
        save_seconds = time.perf_counter() - started
        size = sum(f.stat().st_size for f in directory.iterdir())
        started = time.perf_counter()
        Trainer(cfg, data_dir, local_env(restore_from=directory))
        restore_seconds = time.perf_counter() - started

    print(f"{'model':<8}{'R':>4}{'checkpoint MB':>16}{'save s':>9}{'restore s':>11}")
    print(f"{'demo':<8}{args.replicas:>4}{size / 1e6:>16,.1f}{save_seconds:>9.2f}"
          f"{restore_seconds:>11.2f}   (measured; restore includes building the model)")
    for preset in ("178M", "512M"):
        params = llama_parameters(preset)
        total = 4 * params * (2 + 2 * 8)
        print(f"{preset:<8}{8:>4}{total / 1e6:>16,.0f}{'':>9}{'':>11}   (computed: "
              f"{params / 1e6:.0f}M parameters x 4 B x (θ + momentum + 8 x 2 AdamW moments))")


if __name__ == "__main__":
    main()
