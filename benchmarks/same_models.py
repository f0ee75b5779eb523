"""model_sha256 of every strategy's tiny run, to show a refactor changes no arithmetic.

    python benchmarks/same_models.py OUT.json [--compare BEFORE.json]

Each configuration (every strategy in the registry on one worker and on two gloo workers, and
streaming, G = 2 workers per replica, an int8 wire, top-k with error feedback) trains 3 rounds
of the tiny model in this process or a local gloo group (workers/local.py `run_local`, no Ray)
on the tests' synthetic data, and its final parameters' hash is written to OUT.json. With
--compare, the configurations whose hash differs from BEFORE.json are listed and the exit
status is 1. Run it on the commit before a refactor and after (a git worktree and PYTHONPATH
keep the two apart); hashes agree only on the same machine (BLAS kernels differ between CPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

BASE = ["--model.preset=tiny", "--data.seq_len=32", "--data.batch_size=2", "--inner.steps=2",
        "--run.rounds=3", "--run.eval_tokens=256", "--run.eval_every=3"]


def configurations() -> dict[str, list[str]]:
    """Each configuration's name and flags (besides BASE and the data path)."""
    from isoloco_ray.strategies import STRATEGIES

    out = {}
    for name in STRATEGIES:
        out[f"{name}-1w"] = [f"--outer.strategy={name}", "--scaling.replicas=2",
                             "--scaling.replicas_per_worker=2"]
        out[f"{name}-2w"] = [f"--outer.strategy={name}", "--scaling.replicas=4",
                             "--scaling.replicas_per_worker=2"]
    out["diloco-stream"] = ["--outer.strategy=diloco", "--scaling.replicas=2",
                            "--scaling.replicas_per_worker=2", "--outer.fragments=2",
                            "--outer.delay=1", "--outer.mix=0.5", "--inner.steps=4"]
    out["isoc-sharded-g2"] = ["--outer.strategy=isoc", "--scaling.replicas=1",
                              "--scaling.replicas_per_worker=1",
                              "--scaling.workers_per_replica=2"]
    out["tsv-int8"] = ["--outer.strategy=tsv", "--scaling.replicas=4",
                       "--scaling.replicas_per_worker=2", "--outer.comm_dtype=int8"]
    out["dare-topk-ef"] = ["--outer.strategy=dare", "--scaling.replicas=4",
                           "--scaling.replicas_per_worker=2", "--outer.topk=0.2",
                           "--outer.error_feedback=true"]
    out["ties-int2-ef"] = ["--outer.strategy=ties", "--scaling.replicas=4",
                           "--scaling.replicas_per_worker=2", "--outer.comm_dtype=int2",
                           "--outer.topk=0.25", "--outer.error_feedback=true",
                           "--outer.placement=replicated"]
    # Each merge option away from its default (the options travel from the config to the
    # merge by their names).
    for name, flags in {"ties-random": ["--outer.strategy=ties", "--outer.prune=random",
                                        "--outer.sparsity=0.3", "--outer.rescale=true"],
                        "ties-rows": ["--outer.strategy=ties", "--outer.prune_dim=row"],
                        "isoloco-update": ["--outer.strategy=isoloco",
                                           "--outer.orthogonalize=update"],
                        "tsv-options": ["--outer.strategy=tsv", "--outer.keep_fraction=0.3",
                                        "--outer.decorrelate=false"],
                        "isocts-common": ["--outer.strategy=isocts",
                                          "--outer.common_fraction=0.5"],
                        "dare-disjoint": ["--outer.strategy=dare", "--outer.disjoint=true"]
                        }.items():
        out[name] = [*flags, "--scaling.replicas=4", "--scaling.replicas_per_worker=2"]
    return out


def hashes(data: Path) -> dict[str, str]:
    """Each configuration's final parameters' sha256 (its first 16 hex digits)."""
    from isoloco_ray.config import load_config
    from isoloco_ray.workers.local import keep_processes, run_local
    from isoloco_ray.workers.state import checkpoint

    out = {}
    with keep_processes():
        for key, flags in configurations().items():
            cfg = load_config([*BASE, f"--data.path={data}", *flags])
            _, params = run_local(cfg, data)
            out[key] = checkpoint.parameters_sha256(params)[:16]
            print(key, out[key], flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, help="a BEFORE.json to compare with")
    args = parser.parse_args()
    from isoloco_ray.data.prepare.documents import prepare_dataset
    from isoloco_ray.testing import synthetic_documents

    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        prepare_dataset(synthetic_documents(600), data, vocab_size=384, block_len=64,
                        shard_blocks=16, valid_fraction=0.05, test_fraction=0.02, seed=0,
                        source_name="synthetic text")
        result = hashes(data)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = sorted(key for key in before.keys() | result.keys()
                    if before.get(key) != result.get(key))
    print(f"{len(result)} configurations; differ from {args.compare}: {differ or 'none'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
