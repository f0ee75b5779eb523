"""The same worker failures in `restart` and `replica` mode, and a run without failures.

    python benchmarks/chaos.py OUT_DIR [--failures 3] [--rounds 30] [--seed 0] [--json PATH]
        [--modes restart,replica] [--nodes] [train flags, e.g. --data.path=DIR]
    python benchmarks/chaos.py OUT_DIR --soak [...]: the long replica-mode soak (soak.py)

Three runs of one configuration (default: the demo model, R = 4 on 4 workers, H = 10; the demo
data unless --data.path is given), each a `python -m isoloco_ray.train` process on its own
local Ray cluster: one without failures, then for each mode the same K worker processes
SIGKILLed at seeded random times (mid-round: after one replica's inner steps of a round drawn
from the middle of the run, at least 3 rounds apart). With --nodes each run has a
`ray.cluster_utils.Cluster` of its own instead (a head of 1 CPU for the driver, the lighthouse
and Ray Data; a node of 1 CPU per worker and a spare one), and a failure removes the node of a
worker (drawn by the seed) while that round runs, a new node joining at once. Printed as a
table; with --json the figures of each mode:

- `failures_injected`, `failures_survived` (kills that happened in a run that then completed),
  `run_completed`, `final_eval_loss`, `failure_free_eval_loss`, `wall_seconds`;
- `survivor_stall_seconds`, one per failure: the gap between the progress lines around it, less
  the run's median gap between rounds (what the failure cost those who went on);
- `rounds_recomputed`: rounds that reported more than once (restart mode runs the rounds since
  its last checkpoint again; replica mode none, no survivor redoes an inner step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from isoloco_ray import run_files

ROUND_LINE = re.compile(r"^round +(\d+)/")
# Every command gets a bound: a hang costs minutes, not the session.
RUN_TIMEOUT_S = 1800


def plan_failures(count: int, rounds: int, replicas: int, seed: int) -> list[tuple[int, int]]:
    """`count` (round, replica) kills: rounds (0-based) from the middle of the run, at least 3
    apart (a replacement is back before the next), replicas uniform; fixed by `seed`."""
    rng = random.Random(seed)
    candidates = list(range(2, rounds - 3))
    for _ in range(1000):
        chosen = sorted(rng.sample(candidates, count))
        if all(b - a >= 3 for a, b in zip(chosen, chosen[1:])):
            return [(r, rng.randrange(replicas)) for r in chosen]
    raise SystemExit(f"cannot place {count} failures 3 rounds apart in {rounds} rounds")


def run(name: str, flags: list[str], out: Path, kills: list[tuple[int, int]]) -> dict[str, Any]:
    """One training process; its exit status, progress lines (arrival time, round), kill times
    and summary."""
    markers = [out / f"{name}-killed-{i}" for i in range(len(kills))]
    env = dict(os.environ)
    if kills:
        env["ISOLOCO_RAY_KILL_AT"] = ",".join(f"{r}:{p}:{m}" for (r, p), m in zip(kills, markers))
    command = [sys.executable, "-m", "isoloco_ray.train", *flags, f"--run.name={name}",
               f"--run.storage_path={out}"]
    print("$", " ".join(command), flush=True)
    started = time.time()
    lines: list[tuple[float, int]] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as process:
        # Killed after RUN_TIMEOUT_S even when it prints nothing more (a hang).
        bound = threading.Timer(RUN_TIMEOUT_S, process.kill)
        bound.start()
        assert process.stdout is not None
        for line in process.stdout:
            print(f"  {line}", end="", flush=True)
            match = ROUND_LINE.match(line)
            if match:
                lines.append((time.time(), int(match.group(1))))
        status = process.wait()
        bound.cancel()
    summary_path = out / name / run_files.SUMMARY
    return {"status": status, "wall_seconds": time.time() - started, "lines": lines,
            "kill_times": [m.stat().st_mtime for m in markers if m.exists()],
            "summary": json.loads(summary_path.read_text()) if summary_path.exists() else {}}


def run_on_nodes(name: str, flags: list[str], out: Path, kills: list[tuple[int, int]]
                 ) -> dict[str, Any]:
    """`run` with node removals instead of kills, on a cluster of its own: this script again,
    in a process of its own (`--one-run-on-nodes`), which prints the result as JSON."""
    command = [sys.executable, __file__, str(out), "--one-run-on-nodes", name,
               "--kills", json.dumps(kills), *flags]
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=RUN_TIMEOUT_S)
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_run_on_nodes(name: str, flags: list[str], out: Path, kills: list[tuple[int, int]],
                     seed: int) -> None:
    """The body of `run_on_nodes`: train in this process on a simulated multi-node cluster,
    removing a worker's node while each round of `kills` runs (the node is drawn by `seed`
    among those with a worker; the replica part is not used) and adding a fresh node at once.
    Prints the result as one JSON line."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from isoloco_ray import train
    from isoloco_ray.testing import exit_after

    exit_after(RUN_TIMEOUT_S)
    workers = next(int(f.split("=")[1]) for f in reversed(flags)
                   if f.startswith("--scaling.replicas="))  # one replica per worker here
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(workers + 1)]
    cluster.wait_for_nodes()
    for key, value in train.LOCAL_TRAIN_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["RAY_ADDRESS"] = cluster.address
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    argv = [f for f in flags if not f.startswith("--run.num_cpus")]  # the cluster's own
    argv += [f"--run.name={name}", f"--run.storage_path={out}"]
    status: list[int] = []
    started = time.time()
    runner = threading.Thread(target=lambda: status.append(train.main(argv)))
    runner.start()
    metrics = out / name / run_files.METRICS
    lines: list[tuple[float, int]] = []
    kill_times: list[float] = []
    rng = random.Random(seed)
    pending = sorted(r for r, _ in kills)
    while runner.is_alive():
        records = metrics.read_text().splitlines() if metrics.exists() else []
        for record in records[len(lines):]:
            lines.append((time.time(), json.loads(record)["round"]))
            # Round r (0-based) runs once the round before it has reported.
            if pending and lines[-1][1] == pending[0]:
                pending.pop(0)
                hosting = {actor.node_id for actor in list_actors(
                    filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])}
                candidates = [node for node in nodes if node.node_id in hosting]
                if candidates:
                    time.sleep(1.0)  # into the round's inner steps
                    lost = rng.choice(candidates)
                    cluster.remove_node(lost)
                    nodes.remove(lost)
                    kill_times.append(time.time())
                    nodes.append(cluster.add_node(num_cpus=1))
        time.sleep(0.2)
    runner.join()
    summary_path = out / name / run_files.SUMMARY
    print(json.dumps({"status": status[0] if status else None,
                      "wall_seconds": time.time() - started, "lines": lines,
                      "kill_times": kill_times,
                      "summary": json.loads(summary_path.read_text())
                      if summary_path.exists() else {}}), flush=True)
    ray.shutdown()
    cluster.shutdown()


def figures(result: dict[str, Any], mode: str, injected: int,
            failure_free_loss: float | None) -> dict[str, Any]:
    """The figures of one mode's run (the module's docstring)."""
    times = [t for t, _ in result["lines"]]
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # after round 1 (data streams start)
    typical = statistics.median(gaps) if gaps else 0.0
    stalls = []
    for killed in result["kill_times"]:
        before = max((t for t in times if t <= killed), default=None)
        after = min((t for t in times if t > killed), default=None)
        if before is not None and after is not None:
            stalls.append(round(after - before - typical, 2))
    seen: set[int] = set()
    recomputed = 0
    for _, round_index in result["lines"]:
        recomputed += round_index in seen and round_index > 0
        seen.add(round_index)
    completed = result["status"] == 0
    return {"mode": mode, "failures_injected": injected,
            "failures_survived": len(result["kill_times"]) if completed else 0,
            "run_completed": completed,
            "final_eval_loss": result["summary"].get("final_eval_loss"),
            "failure_free_eval_loss": failure_free_loss,
            "survivor_stall_seconds": stalls, "rounds_recomputed": recomputed,
            "wall_seconds": round(result["wall_seconds"], 1),
            "median_round_seconds": round(typical, 2)}


def main() -> None:
    if "--soak" in sys.argv[1:]:
        import soak  # benchmarks/soak.py, beside this script

        soak.main([arg for arg in sys.argv[1:] if arg != "--soak"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--failures", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--modes", default="restart,replica")
    parser.add_argument("--nodes", action="store_true", help="remove nodes, not processes")
    parser.add_argument("--one-run-on-nodes", help=argparse.SUPPRESS)  # run_on_nodes' child
    parser.add_argument("--kills", help=argparse.SUPPRESS)
    args, train_flags = parser.parse_known_args()
    if args.one_run_on_nodes:
        one_run_on_nodes(args.one_run_on_nodes, train_flags, args.out,
                         [tuple(k) for k in json.loads(args.kills)], args.seed)
        return
    replicas = 4
    flags = ["--model.preset=demo", f"--scaling.replicas={replicas}",
             "--scaling.replicas_per_worker=1", "--scaling.cpus_per_worker=1",
             "--inner.steps=10", f"--run.rounds={args.rounds}", "--run.checkpoint_every=5",
             "--run.eval_every=10", "--run.max_failures=10", "--run.num_cpus=6", *train_flags]
    args.out.mkdir(parents=True, exist_ok=True)
    kills = plan_failures(args.failures, args.rounds, replicas, args.seed)
    print(f"failures (round, replica), 0-based: {kills}", flush=True)
    runner = run_on_nodes if args.nodes else run
    free = runner("failure-free", flags + ["--scaling.fault_tolerance=restart"], args.out, [])
    free_loss = free["summary"].get("final_eval_loss")
    rows = [figures(free, "none", 0, free_loss)]
    for mode in args.modes.split(","):
        result = runner(mode, flags + [f"--scaling.fault_tolerance={mode}"], args.out, kills)
        rows.append(figures(result, mode, len(kills), free_loss))
    print(f"\n{'mode':<8} {'done':>5} {'failures':>9} {'eval loss':>10} {'Δ vs free':>10} "
          f"{'rounds again':>13} {'stall s (each)':>22} {'wall s':>8}")
    for row in rows:
        loss = row["final_eval_loss"]
        delta = "" if loss is None or free_loss is None else f"{loss - free_loss:+.4f}"
        print(f"{row['mode']:<8} {str(row['run_completed']):>5} "
              f"{row['failures_survived']:>4}/{row['failures_injected']:<4} "
              f"{'' if loss is None else f'{loss:.4f}':>10} {delta:>10} "
              f"{row['rounds_recomputed']:>13} {str(row['survivor_stall_seconds']):>22} "
              f"{row['wall_seconds']:>8}")
    if args.json is not None:
        args.json.write_text(json.dumps({"failures": kills, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
