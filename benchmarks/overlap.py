"""Round wall time with the outer sync overlapped with training (outer.delay) and without.

    python benchmarks/overlap.py [--ratios 0.5 1.0] [--rounds N] [--threads T] [train flags ...]

The real trainer (workers/loop.py, one process, the replicas taking turns, no Ray) on the demo
data, with a slow link simulated: every outer sync also sleeps for its fragment's share of
`ratio` x the inner steps' time of a round (an all-reduce of the whole model at that
bandwidth would take that long). Sleeping holds no core, as waiting on a network does not, so
only the overlap can hide it. For each ratio the table shows, per round (medians over the
steady rounds, not the first or last): the inner steps' seconds, the syncs' seconds (in
whichever thread they ran), how long training waited for them, and the round's wall time against
max(inner, outer) (target with delay: <= 1.1) and inner + outer (what no overlap costs).

A last row pair runs a CPU-heavy merge (isocts) with no simulated link: on a CPU-only
machine the merge and the inner steps share the cores, so the overlap hides little there; on
GPU the merge runs on its own CUDA stream.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from isoloco_ray.config import load_config
from isoloco_ray.data.prepare.documents import ensure_demo_data
from isoloco_ray.workers.local import run_local
from isoloco_ray.workers.outer.step import OuterSync


@contextmanager
def slow_link(seconds_per_byte: float) -> Iterator[None]:
    """Every outer sync sleeps seconds_per_byte x its fragment's float32 bytes (counted as
    communication), in the thread it runs in."""
    original = OuterSync.step

    def step(self, global_params, *args, **kwargs):
        stats = original(self, global_params, *args, **kwargs)
        wait = seconds_per_byte * sum(4 * t.numel() for t in global_params.values())
        time.sleep(wait)
        stats.comm_seconds += wait
        return stats

    OuterSync.step = step
    try:
        yield
    finally:
        OuterSync.step = original


def measure(flags: list[str], data_dir, threads: int) -> dict[str, float]:
    """Medians of one run's round figures over its steady rounds: not the first (it starts
    the data streams, and with delay has no fragment 0 sync of a previous round), not the
    last (with delay, fragment 0's last sync lands there at once, with nothing to hide
    behind)."""
    reports: list[dict] = []
    cfg = load_config(flags)
    run_local(cfg, data_dir, threads_per_worker=threads, reports=reports)
    rounds = [m for m in reports if 1 < m["round"] < cfg.run.rounds]

    def median(key: str) -> float:
        return statistics.median(m[key] for m in rounds)

    return {"inner": median("inner_seconds"),
            "outer": statistics.median(m["outer_comm_seconds"] + m["outer_merge_seconds"]
                                       for m in rounds),
            "wait": median("outer_wait_seconds"), "round": median("round_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0],
                        help="whole-model sync time on the simulated link / inner time")
    parser.add_argument("--rounds", type=int, default=5, help="at least 3")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args, train_flags = parser.parse_known_args()
    steps = 20
    flags = ["--model.preset=demo", "--scaling.replicas=2", "--scaling.replicas_per_worker=2",
             f"--inner.steps={steps}", "--data.seq_len=128", "--data.batch_size=8",
             f"--run.rounds={args.rounds}", f"--run.eval_every={args.rounds}",
             f"--run.checkpoint_every={args.rounds}", "--run.eval_tokens=4096", *train_flags]
    data_dir = ensure_demo_data()
    settings = [(1, 0), (2, 0), (1, steps - 1), (2, steps // 2 - 1), (4, steps // 4 - 1)]

    base = measure(flags, data_dir, args.threads)
    model_bytes = 4 * sum(p.numel() for p in _parameters(flags, data_dir))
    print(f"demo model ({model_bytes / 1e6:.1f} MB float32), R=2 on one worker, H={steps}, "
          f"{args.threads} threads, {os.cpu_count()} cores; inner {base['inner']:.2f} s/round")
    print(f"{'outer sync':<26} {'P':>2} {'delay':>5} {'inner s':>8} {'outer s':>8} "
          f"{'wait s':>7} {'round s':>8} {'/max(i,o)':>9} {'/(i+o)':>7}")
    rows = [(f"link, outer = {ratio:g} x inner", ratio, [], fragments, delay)
            for ratio in args.ratios for fragments, delay in settings]
    rows += [("isocts merge on CPU", 0.0, ["--outer.strategy=isocts"], fragments, delay)
             for fragments, delay in [(1, 0), (2, steps // 2 - 1)]]
    for label, ratio, extra, fragments, delay in rows:
        with slow_link(ratio * base["inner"] / model_bytes):
            m = measure(flags + extra + [f"--outer.fragments={fragments}",
                                         f"--outer.delay={delay}"], data_dir, args.threads)
        print(f"{label:<26} {fragments:>2} {delay:>5} {m['inner']:>8.2f} {m['outer']:>8.2f} "
              f"{m['wait']:>7.2f} {m['round']:>8.2f} "
              f"{m['round'] / max(m['inner'], m['outer']):>9.2f} "
              f"{m['round'] / (m['inner'] + m['outer']):>7.2f}")


def _parameters(flags: list[str], data_dir):
    from isoloco_ray.data.format import DatasetMeta
    from isoloco_ray.workers.model import build_model

    cfg = load_config(flags)
    return build_model(cfg.model, DatasetMeta.load(data_dir).vocab_size, 0).parameters()


if __name__ == "__main__":
    main()
