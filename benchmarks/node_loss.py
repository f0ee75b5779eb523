"""Lose a node mid-run on a multi-node Ray cluster simulated on this machine, and go on.

    python benchmarks/node_loss.py DATA_DIR OUT_DIR [--grow | --shrink-then-grow] [train flags]

A `ray.cluster_utils.Cluster`: a head node without CPUs and two nodes of one CPU each, a
worker on each (Ray Data's read tasks reserve no CPU). An elastic run (R = 2, scaling.min_workers
1, one replica per worker, a checkpoint every round) starts on two workers; once its second
checkpoint is written the node of one worker is removed. Ray Train restarts from the latest
checkpoint it registered with the one worker left, hosting both replicas.

With --grow the other way round: the run starts on one node (one worker hosting both
replicas), a second node joins after the second checkpoint, and at its next resize check
(every 5 s here, 60 s by default) Ray Train restarts the run from its latest checkpoint on two
workers. --shrink-then-grow does both in one run: a node is lost, and two rounds after the
recovery a new node joins.

Prints one JSON line: the exit status, the run's summary and, for each change, the seconds
from the change to the next progress report (`recovery_seconds`), the rounds run again and the
node-id placement before and after. Run by tests/test_multinode.py, which compares the model
with an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from isoloco_ray import run_files

# Ray Train decides a restart's size from a view of the cluster that may still hold the lost
# node, then waits this long for its placement group before it looks again (60 s by default;
# placing a group on this machine's nodes takes milliseconds). Read by Ray Train when it starts.
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")
os.environ.setdefault("ISOLOCO_RAY_RESIZE_CHECK_SECONDS", "5")  # isoloco_ray.elastic


def free_port() -> int:
    """A TCP port free on loopback now (the dashboard's default may be another cluster's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def refresh_cluster_view_often() -> None:
    """Run in every Ray worker process of this job (a `worker_process_setup_hook`): Ray Train's
    elastic policy sees nodes come and go through Ray Data's autoscaling coordinator actor,
    which looks at the cluster every 20 s, most of a recovery on this small cluster; here every
    second. Ray 2.60's private class attribute: if a later Ray drops it, this does nothing and
    the benchmark only gets slower."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            _AutoscalingCoordinatorActor as coordinator)
    except ImportError:
        return
    if hasattr(coordinator, "TICK_INTERVAL_S"):
        coordinator.TICK_INTERVAL_S = 1


def worker_nodes() -> dict[str, int]:
    """Ray node id -> count of live Ray Train workers on it (Ray's state API)."""
    from ray.util.state import list_actors

    nodes: dict[str, int] = {}
    for actor in list_actors(filters=[("class_name", "=", "RayTrainWorker"),
                                      ("state", "=", "ALIVE")]):
        nodes[actor.node_id] = nodes.get(actor.node_id, 0) + 1
    return nodes


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from isoloco_ray import train
    from isoloco_ray.testing import exit_after

    data_dir, out_dir, *options = sys.argv[1:]
    # A hang ends with the stacks after ISOLOCO_RAY_BENCH_TIMEOUT seconds (default 15 min).
    exit_after(float(os.environ.get("ISOLOCO_RAY_BENCH_TIMEOUT", 900)))
    changes = {"--grow": ["add"], "--shrink-then-grow": ["remove", "add"]}.get(
        next((o for o in options if o in ("--grow", "--shrink-then-grow")), ""), ["remove"])
    options = [option for option in options if option not in ("--grow", "--shrink-then-grow")]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_port": free_port()})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(1 if changes[0] == "add" else 2)]
    cluster.wait_for_nodes()
    # A cluster of this machine: Ray Train's controller may poll its workers often. The run
    # joins it through RAY_ADDRESS, where train.py keeps Ray's default, so it is set here.
    for key, value in train.LOCAL_TRAIN_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR",
             runtime_env={"worker_process_setup_hook": refresh_cluster_view_often})
    run_dir = Path(out_dir) / "node-loss"
    argv = [f"--data.path={data_dir}", f"--run.storage_path={out_dir}", "--run.name=node-loss",
            "--scaling.replicas=2", "--scaling.replicas_per_worker=1",
            "--scaling.min_workers=1", "--scaling.cpus_per_worker=1",
            "--run.checkpoint_every=1", "--run.max_failures=2", *options]
    status: list[int] = []
    runner = threading.Thread(target=lambda: status.append(train.main(argv)))
    started = time.monotonic()
    runner.start()
    metrics = run_dir / run_files.METRICS

    def reports() -> list[dict]:
        return [json.loads(line) for line in metrics.read_text().splitlines()] \
            if metrics.exists() else []

    results = []
    wait_from = 0  # each change comes 2 rounds (each checkpointed) after the last recovery
    for kind in changes:
        while len(reports()) < wait_from + 3 and runner.is_alive():  # + the initial eval
            time.sleep(0.2)
        before = worker_nodes()
        reported = len(reports())
        last_round = max((m["round"] for m in reports()), default=0)
        if kind == "add":
            changed = cluster.add_node(num_cpus=1)
            nodes.append(changed)
        else:
            changed = next(node for node in nodes if node.node_id in before)
            cluster.remove_node(changed)
            nodes.remove(changed)
        change_time = time.monotonic()
        recovery, resumed_round, after = None, None, {}
        while runner.is_alive() and recovery is None:
            if kind == "add" and not after and sum(worker_nodes().values()) > 1:
                # The grown group is up (Ray stopped the old one first): its reports come next.
                after, reported = worker_nodes(), len(reports())
                last_round = max((m["round"] for m in reports()), default=0)
            now = reports()
            if (after or kind == "remove") and len(now) > reported \
                    and time.monotonic() - change_time > 1:
                recovery = time.monotonic() - change_time
                resumed_round = now[-1]["round"]
                after = after or worker_nodes()
                wait_from = len(now) - 1
            time.sleep(0.2)
        results.append({
            "change": kind, "node": changed.node_id, "recovery_seconds": recovery,
            "rounds_redone": None if recovery is None else last_round - resumed_round + 1,
            "workers_before": sum(before.values()), "nodes_before": len(before),
            "workers_after": sum(after.values()), "placement_before": before,
            "placement_after": after})
    runner.join()
    summary = json.loads((run_dir / run_files.SUMMARY).read_text()) \
        if (run_dir / run_files.SUMMARY).exists() else None
    print(json.dumps({"status": status[0] if status else None,
                      "seconds": time.monotonic() - started, "changes": results,
                      "summary": summary}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
