"""A long `scaling.fault_tolerance: replica` soak: many seeded faults, every merge, the weights
checked against the plain reference (issue 46, stage 4).

    python benchmarks/chaos.py OUT_DIR --soak [--faults 100] [--workers 5] [--seed 0]
        [--strategies diloco,diloco_sgd,isoc,isoloco,isocts,tsv,ties-random,dare,sparseloco]
        [--kill-share 0.4] [--slow-share 0] [--fault-gap 2] [--nodes [--node-share 0.5]]
        [--json PATH] [train flags]

One run per strategy (tiny model, one replica per worker, H = 8; each worker's step padded to
an eighth of a second by sleeping, as a worker waiting on its accelerator, `--round-floor`:
five workers computing without it share this machine's two cores, and goodput would measure
their contention), each a `python -m isoloco_ray.train` process on its own local Ray cluster,
with its share of the faults, mixed and seeded (workers/ray_entry.py FaultHooks): SIGKILL of a
worker (rank 0 included: the first fault of the soak is rank 0's), SIGSTOP for 5-60 s then
SIGCONT, or (`--slow-share`) a slowdown of 2-10x for 5-60 s, in which the straggler deadline
cuts the worker's rounds short (scaling.straggler_deadline); with `--nodes` each run is on a
simulated multi-node cluster (SimulatedNodes) and `--node-share` of the kills remove the
worker's node instead, a fresh node joining at once. Faults are placed a few rounds
apart, at most W - ⌊W/2⌋ - 1 workers out at once (a majority stays) and no two SIGKILLs within
a replacement's start of each other (Ray 2.60 restarts every worker then:
docs/fault_tolerance.md); a fault planned for a worker that is still out (or slowed) when its
round comes does not fire, and only those that fired count.

Per run (JSON, and a table):
- `faults_injected` (kills, stops, slowdowns, node removals), `faults_survived` (injected in
  a run that completed);
- `rounds_reported_once`: metrics.jsonl holds rounds 0..N, each exactly once;
- `survivor_restarts`: times every worker started again from a checkpoint (must be 0);
- `stall_seconds`, one per fault: from the fault's time to the next sync the survivors
  committed (`committed_at` of metrics.jsonl);
- `final_eval_loss` against `failure_free_eval_loss`: the θ of the plain loop with every
  worker in every round (workers/plain_loop.py `run_over_quorums`, which a run without
  faults equals bit for bit), scored on the same validation tokens;
- `weights_equal_reference`: the run's `model_sha256` equals `run_over_quorums` over the
  contributors and replica steps metrics.jsonl recorded, bit for bit;
- `rounds_with_partial_replicas`: rounds in which a straggler's steps were cut short;
- `goodput`: the tokens that went into committed syncs (each replica's steps) over the
  tokens all W workers would have trained between round 1's and the last committed sync at
  their failure-free rate (the run's median rate over rounds every worker took in full and no
  fault touched), and `goodput_bound`, the most these faults allow (pauses, and what a
  slowdown leaves untrained), and goodput over it (`goodput()`).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from isoloco_ray import run_files

STRATEGIES = {"diloco": [], "diloco_sgd": [], "isoc": [], "isoloco": [], "isocts": [],
              "tsv": [], "ties-random": ["--outer.strategy=ties", "--outer.prune=random"],
              "dare": [], "sparseloco": []}
RUN_TIMEOUT_S = 3600  # each training process; a hang costs this, not the session
PAUSE_S = (5.0, 60.0)  # SIGSTOP durations and slowdowns' lengths, uniform
SLOW_FACTOR = (2.0, 10.0)  # how many times slower a slowed worker is, uniform
KILL_SHARE = 0.4  # the rest are SIGSTOPs
FAULT_GAP_S = 2.0  # between two faults
# How long a worker is out after a fault, beyond a pause: a SIGKILLed one until Ray Train has
# started its replacement and the others have healed it (about 10 s on 2 cores), a stopped one
# until it has been healed.
KILL_OUT_S, STOP_EXTRA_S = 15.0, 3.0
# --nodes: a node's removal keeps its worker out longer than a kill (Ray sees the node gone,
# then starts the replacement on another); the stopped worker is continued after NODE_STOP_S
# if its node was never removed.
NODE_OUT_S, NODE_STOP_S = 25.0, 120.0
WARMUP_ROUNDS, TAIL_S = 4, 5.0  # without faults, at the start and the end of a run
CHECKPOINT_EVERY = 20  # rounds: checkpoints are taken between faults, and across them
INNER_STEPS = 8  # H: a straggler's partial round takes 1 to 7 of them


@dataclass
class Fault:
    """One planned fault: after worker `worker`'s inner steps of round `round` (0-based)."""

    round: int
    worker: int
    pause: float | None  # SIGSTOP for this many seconds; None: SIGKILL
    # A slowdown instead: the worker this many times slower for `slow_seconds` (alive,
    # heartbeating: a throttled or shared machine).
    slow: float | None = None
    slow_seconds: float | None = None
    node: bool = False  # --nodes: the worker's Ray node is removed instead of a SIGKILL

    def spec(self, marker: Path) -> str:
        """Its ISOLOCO_RAY_KILL_AT item (one replica per worker: replica = worker)."""
        if self.slow is not None:
            action = f"slow={self.slow:g}/{self.slow_seconds:g}:"
        elif self.node:
            action = f"node={NODE_STOP_S:g}:"
        else:
            action = "" if self.pause is None else f"stop={self.pause:g}:"
        return f"{self.round}:{self.worker}:{action}{marker}"

    @property
    def label(self) -> str:
        """kill, node, stop S or slow FxS, for the plan's printout."""
        if self.slow is not None:
            return f"slow {self.slow:g}x{self.slow_seconds:g}s"
        return self.kind if self.pause is None else f"stop {self.pause:g}s"

    @property
    def kind(self) -> str:
        """kill, node, stop or slow."""
        if self.slow is not None:
            return "slow"
        return ("node" if self.node else "kill") if self.pause is None else "stop"

    @property
    def lost_seconds(self) -> float:
        """Worker-seconds of training this fault takes at the least (goodput_bound): a pause's
        length, a slowdown's (1 − 1/F) of its length; a kill or a node's loss none (a
        replacement could be up at once)."""
        if self.slow is not None:
            assert self.slow_seconds is not None
            return self.slow_seconds * (1 - 1 / self.slow)
        return self.pause or 0.0


def plan_faults(count: int, workers: int, round_seconds: float, rng: random.Random,
                rank_0_first: bool, slow_share: float = 0.0, gap_s: float = FAULT_GAP_S,
                kill_share: float = KILL_SHARE, node_share: float = 0.0
                ) -> tuple[list[Fault], int]:
    """`count` faults placed as the module's docstring says, in rounds of `round_seconds`
    (the 5 s that the survivors wait for a faulted worker's heartbeat aside), `kill_share` of
    them SIGKILLs (`node_share` of those the removal of the worker's node instead),
    `slow_share` slowdowns, the rest SIGSTOPs, at least `gap_s` apart; returns
    them and the rounds the run needs. A slowed worker is not out (it takes part), but gets no
    other fault while slowed."""
    def rounds(seconds: float) -> int:
        return math.ceil(seconds / round_seconds)

    most_out = workers - (workers // 2 + 1)
    back_at = [0] * workers  # the round each worker is expected back by
    slowed_until = [0] * workers
    next_kill = 0
    faults: list[Fault] = []
    cursor = WARMUP_ROUNDS
    while len(faults) < count:
        draw = rng.random()
        kill = (rank_0_first and not faults) or draw < kill_share
        slow = not kill and draw >= 1 - slow_share  # slow_share <= 1 - kill_share
        out = sum(back_at[w] > cursor for w in range(workers))
        free = [w for w in range(workers) if back_at[w] <= cursor and slowed_until[w] <= cursor]
        if (not free or (not slow and out >= most_out)
                or (kill and cursor < next_kill)):
            cursor += 1
            continue
        worker = 0 if rank_0_first and not faults else rng.choice(free)
        if slow:
            seconds = round(rng.uniform(*PAUSE_S), 1)
            faults.append(Fault(cursor, worker, None, slow=round(rng.uniform(*SLOW_FACTOR), 1),
                                slow_seconds=seconds))
            slowed_until[worker] = cursor + rounds(seconds)
        elif kill:
            node = node_share > 0 and rng.random() < node_share  # no draw: plans as before
            faults.append(Fault(cursor, worker, None, node=node))
            back_at[worker] = next_kill = cursor + rounds(NODE_OUT_S if node else KILL_OUT_S)
        else:
            pause = round(rng.uniform(*PAUSE_S), 1)
            faults.append(Fault(cursor, worker, pause))
            back_at[worker] = cursor + rounds(pause + STOP_EXTRA_S)
        cursor += rounds(gap_s)
    return faults, max(cursor, max(back_at), max(slowed_until)) + rounds(TAIL_S)


def train_flags(workers: int, rounds: int, data: Path, extra: list[str]) -> list[str]:
    """The soak's configuration (tiny model, one replica per worker), then `extra`."""
    return ["--model.preset=tiny", f"--data.path={data}", "--data.seq_len=32",
            "--data.batch_size=2", f"--scaling.replicas={workers}",
            "--scaling.replicas_per_worker=1", "--scaling.fault_tolerance=replica",
            "--scaling.cpus_per_worker=1", f"--run.num_cpus={workers + 2}",
            f"--inner.steps={INNER_STEPS}",
            f"--run.rounds={rounds}", f"--run.checkpoint_every={CHECKPOINT_EVERY}",
            f"--run.eval_every={rounds}",
            "--run.eval_tokens=2048", "--run.max_failures=-1", *extra]


def prepare_data(out: Path) -> Path:
    """A synthetic dataset (no download), once."""
    from isoloco_ray.data.prepare.documents import prepare_dataset
    from isoloco_ray.testing import synthetic_documents

    data = out / "data"
    if not (data / "meta.json").exists():
        # About 1.5M train tokens: a soak run of 8 workers reads them about once. On the
        # tests' 58k tokens it read them 26 times (eval loss 3.7 against a train loss of
        # 2.1), and the failure-free θ and a faulted run's ended 0.2 apart.
        prepare_dataset(synthetic_documents(15_000), data, vocab_size=384, block_len=64,
                        shard_blocks=256, valid_fraction=0.05, test_fraction=0.02, seed=0,
                        source_name="synthetic soak text")
    return data


NODE_STORE = 100 * 1024**2  # object store bytes of each simulated node


class SimulatedNodes:
    """--nodes: a `ray.cluster_utils.Cluster` on this machine for one training run, which joins
    it (RAY_ADDRESS): a head of 1 CPU (the driver's side: Ray Train's controller, the
    lighthouse and Ray Data's coordinator are pinned to it) and a node of 1 CPU for each worker
    and two more (Ray Data's readers, a replacement's place). `remove_as_asked` removes the
    node a node fault names (its MARKER.node), every process on it with it, and adds a fresh
    node at once; a worker the placement put on the head is SIGKILLed instead (the head is
    not removed), and counted apart (`kills_on_head`)."""

    def __init__(self, workers: int) -> None:
        from ray.cluster_utils import Cluster

        from isoloco_ray.train import LOCAL_TRAIN_ENV

        # Read by the cluster's processes, which the Cluster starts from this one (unless
        # this environment says otherwise, as train.py's local clusters).
        for key, value in LOCAL_TRAIN_ENV.items():
            os.environ.setdefault(key, value)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": NODE_STORE})
        self.nodes = [self._add() for _ in range(workers + 2)]
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address
        self.removed = self.kills_on_head = 0

    def _add(self) -> Any:
        return self.cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)

    def remove_as_asked(self, out: Path, name: str, running: Callable[[], bool]) -> None:
        """Until `running()` is false: the node each of `name`'s node faults names is removed
        and a fresh one added."""
        while running():
            for asked in sorted(out.glob(f"{name}-fault-*.node")):
                node_id, pid = asked.read_text().split()
                asked.unlink()
                lost = next((node for node in self.nodes if node.node_id == node_id), None)
                if lost is None:  # the head
                    os.kill(int(pid), signal.SIGKILL)
                    self.kills_on_head += 1
                    continue
                self.cluster.remove_node(lost)
                self.nodes.remove(lost)
                self.removed += 1
                self.nodes.append(self._add())
            time.sleep(0.2)

    def shutdown(self) -> None:
        self.cluster.shutdown()


def train(name: str, flags: list[str], out: Path, faults: list[Fault],
          round_floor: float, nodes_for: int = 0) -> dict[str, Any]:
    """One training process with `faults` armed and each worker's rounds padded to
    `round_floor` seconds (each of its H steps to 1/H of it), on a local cluster of its own
    (`nodes_for` W workers: joining a `SimulatedNodes` cluster); its exit status, wall time
    and fault times."""
    markers = [out / f"{name}-fault-{i}" for i in range(len(faults))]
    env = dict(os.environ, ISOLOCO_RAY_KILL_AT=",".join(
        [f"floor={round_floor / INNER_STEPS:g}"] * (round_floor > 0)
        + [fault.spec(marker) for fault, marker in zip(faults, markers)]))
    command = [sys.executable, "-m", "isoloco_ray.train", *flags, f"--run.name={name}",
               f"--run.storage_path={out}"]
    cluster = None
    if nodes_for:
        cluster = SimulatedNodes(nodes_for)
        env["RAY_ADDRESS"] = cluster.address
        command = [f for f in command if not f.startswith("--run.num_cpus")]  # the cluster's
    print("$", " ".join(command), flush=True)
    started = time.time()
    try:
        with (out / f"{name}.log").open("w") as log, subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env) as process:
            bound = threading.Timer(RUN_TIMEOUT_S, process.kill)
            bound.start()
            if cluster is not None:  # here: Ray starts a node from the main thread only
                cluster.remove_as_asked(out, name, lambda: process.poll() is None)
            status = process.wait()
            bound.cancel()
    finally:
        if cluster is not None:
            cluster.shutdown()
    nodes = {} if cluster is None else {"nodes_removed": cluster.removed,
                                        "kills_on_head": cluster.kills_on_head}
    return {"status": status, "wall_seconds": time.time() - started, **nodes,
            "fault_times": [m.stat().st_mtime if m.exists() else None for m in markers]}


def scored_loss(cfg: Any, data: Path, theta: dict[str, Any]) -> float:
    """The validation loss of `theta` as a run scores it (every eval token, one process)."""
    import torch

    from isoloco_ray.data.format import Dataset
    from isoloco_ray.workers.evaluate import eval_sequences, evaluate
    from isoloco_ray.workers.model import Runtime, build_model
    from isoloco_ray.workers.replica import load_parameters

    dataset = Dataset.open(data)
    model = build_model(cfg.model, dataset.meta.vocab_size, cfg.run.seed)
    load_parameters(model, theta)
    runtime = Runtime.create(model, torch.device("cpu"), cfg.run.autocast, cfg.run.compile)
    sequences = eval_sequences(dataset.split_files("valid"), cfg.data.seq_len,
                               cfg.run.eval_tokens)
    return evaluate(runtime, sequences, 0, 1, cfg.resolved.micro_batch_size)


def figures(name: str, flags: list[str], data: Path, run_dir: Path, result: dict[str, Any],
            faults: list[Fault], workers: int) -> dict[str, Any]:
    """The run's figures (the module's docstring)."""
    from isoloco_ray.config import load_config

    cfg = load_config(flags)
    rounds = cfg.resolved.rounds
    metrics_path = run_dir / run_files.METRICS
    records = ([json.loads(line) for line in metrics_path.read_text().splitlines()]
               if metrics_path.exists() else [])
    summary_path = run_dir / run_files.SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    completed = result["status"] == 0 and summary.get("status") == "done"
    fired = [(fault, at) for fault, at in zip(faults, result["fault_times"]) if at is not None]
    commits = sorted(r["committed_at"] for r in records if r.get("committed_at"))
    stalls = [round(min((c for c in commits if c > at), default=math.nan) - at, 2)
              for _, at in fired]
    by_round = {r["round"]: r for r in records}
    contributors = [by_round[j]["contributors"] for j in range(1, rounds + 1) if j in by_round]
    row: dict[str, Any] = {
        "strategy": name, "rounds": rounds, "workers": workers, "run_completed": completed,
        "faults_planned": len(faults),
        "faults_injected": {kind: sum(f.kind == kind for f, _ in fired)
                            for kind in ("kill", "stop", "slow", "node")},
        "faults_survived": len(fired) if completed else 0,
        "faults": [{**asdict(f), "at": at} for f, at in fired],
        "rounds_reported_once": [r["round"] for r in records] == list(range(rounds + 1)),
        "survivor_restarts": summary.get("group_restarts", 0),
        "worker_losses": summary.get("worker_losses"),
        "stall_seconds": stalls,
        "final_eval_loss": summary.get("final_eval_loss"),
        "wall_seconds": round(result["wall_seconds"], 1),
        **{key: result[key] for key in ("nodes_removed", "kills_on_head") if key in result}}
    if len(contributors) == rounds and len(commits) > 1:
        row.update(goodput(row, [by_round[j] for j in range(rounds + 1)],
                           cfg.data.batch_size * cfg.data.seq_len, cfg.inner.steps, fired))
        steps = [by_round[j]["replica_steps"] for j in range(1, rounds + 1)]
        row["rounds_with_partial_replicas"] = sum(
            any(0 < taken < cfg.inner.steps for taken in s) for s in steps)
        # The plain loop over the recorded quorums, and without faults: one process each, at
        # once (the run is over; each takes minutes of a core for a few hundred rounds).
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            recorded = pool.submit(reference_loop, flags, data, contributors, steps)
            failure_free = pool.submit(reference_loop, flags, data,
                                       [list(range(workers))] * rounds, None)
            (sha256, row["reference_eval_loss"]), (_, row["failure_free_eval_loss"]) = (
                recorded.result(), failure_free.result())
        row["weights_equal_reference"] = summary.get("model_sha256") == sha256
        if row["final_eval_loss"] is not None:
            row["loss_vs_failure_free"] = round(row["final_eval_loss"]
                                                - row["failure_free_eval_loss"], 4)
    return row


def reference_loop(flags: list[str], data: Path, contributors: list[list[int]],
                   steps: list[list[int]] | None) -> tuple[str, float]:
    """`run_over_quorums` over `contributors` (and `steps`): its θ's sha256 and its eval loss
    (scored as the run scores its own θ)."""
    import torch

    from isoloco_ray.config import load_config
    from isoloco_ray.workers import plain_loop
    from isoloco_ray.workers.state import checkpoint

    cfg = load_config(flags)
    # On the workers' thread count: float64 merges (tsv, isocts) depend on it on some CPUs'
    # MKL.
    torch.set_num_threads(cfg.scaling.torch_threads)
    theta = plain_loop.run_over_quorums(cfg, data, contributors, steps)
    return checkpoint.parameters_sha256(theta), scored_loss(cfg, data, theta)


def goodput(row: dict[str, Any], records: list[dict[str, Any]], tokens_per_step: int,
            steps: int, fired: list[tuple[Fault, float]]) -> dict[str, float]:
    """`failure_free_tokens_per_s`, `goodput`, `goodput_bound` and their ratio from a run's
    `records` (metrics.jsonl, rounds 0..N) and its `fired` faults with their times. The window
    runs from round 1's commit to the last: round 0 is the workers' first join and round 1
    holds the start of the data pipeline, which a run without faults pays alike. The
    failure-free rate is the median over rounds every worker took in full (H steps each) after
    one they all took, no pause or slowdown active in either (a slowed round is slow, and a
    cut one short). The bound: a stopped worker trains nothing while stopped, but a lost one
    could be replaced at once and nobody need wait, so only the pauses count, and of a
    slowdown by F what it leaves untrained, 1 - (Σ pauses + Σ (1 - 1/F)·length) / (W x the
    window). The tokens committed are each round's replicas' steps (a straggler's partial
    round: fewer than H) x the tokens of a step."""
    workers = row["workers"]
    active = [(at, at + (fault.slow_seconds or fault.pause or 0.0) + 1.0)
              for fault, at in fired if fault.kind in ("stop", "slow")]

    def clean(j: int) -> bool:
        start, end = records[j - 1]["committed_at"], records[j]["committed_at"]
        return (len(records[j]["contributors"]) == workers
                and all(taken == steps for taken in records[j]["replica_steps"])
                and not any(begin < end and start < finish for begin, finish in active))

    rates = [workers * steps * tokens_per_step
             / (records[j]["committed_at"] - records[j - 1]["committed_at"])
             for j in range(3, len(records)) if clean(j) and clean(j - 1)]
    rate = statistics.median(rates) if rates else math.nan
    seconds = records[-1]["committed_at"] - records[1]["committed_at"]
    committed = sum(sum(r["replica_steps"]) for r in records[2:]) * tokens_per_step
    lost = sum(fault.lost_seconds for fault, _ in fired)
    achieved, bound = committed / (rate * seconds), 1 - lost / (workers * seconds)
    return {"failure_free_tokens_per_s": round(rate, 1), "goodput": round(achieved, 4),
            "goodput_bound": round(bound, 4), "goodput_of_bound": round(achieved / bound, 4)}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'strategy':<12} {'done':>5} {'k+s+slow':>10} {'once':>5} {'restarts':>8} "
          f"{'Δ loss':>8} {'same θ':>7} {'goodput':>8} {'bound':>6} {'of it':>6} "
          f"{'median stall s':>15} "
          f"{'wall s':>7}")
    for row in rows:
        injected = row["faults_injected"]
        stalls = [s for s in row["stall_seconds"] if not math.isnan(s)]
        print(f"{row['strategy']:<12} {str(row['run_completed']):>5} "
              f"{injected['kill'] + injected.get('node', 0):>3}+{injected['stop']}"
              f"+{injected.get('slow', 0):<3} "
              f"{str(row['rounds_reported_once']):>5} {row['survivor_restarts']:>8} "
              f"{row.get('loss_vs_failure_free', float('nan')):>+8.4f} "
              f"{str(row.get('weights_equal_reference')):>7} "
              f"{row.get('goodput', float('nan')):>8.3f} "
              f"{row.get('goodput_bound', float('nan')):>6.3f} "
              f"{row.get('goodput_of_bound', float('nan')):>6.3f} "
              f"{statistics.median(stalls) if stalls else float('nan'):>15.2f} "
              f"{row['wall_seconds']:>7}")
    total = sum(r["faults_survived"] for r in rows)
    print(f"faults survived in all: {total}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--faults", type=int, default=100, help="across all runs")
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round-floor", type=float, default=1.0,
                        help="seconds; each worker's round lasts at least this (it sleeps the "
                             "rest, as a worker waiting on its accelerator): 0 lets five "
                             "workers share the CPU cores")
    parser.add_argument("--round-seconds", type=float,
                        help="a round's expected length, to plan how long a fault keeps a "
                             "worker out (the floor + 0.1 s; 0.18 s without a floor)")
    parser.add_argument("--kill-share", type=float, default=KILL_SHARE,
                        help="the share of faults that are SIGKILLs (the soak's first fault, "
                             "rank 0's, always is)")
    parser.add_argument("--slow-share", type=float, default=0.0,
                        help="the share of faults that are slowdowns (2-10x for 5-60 s); the "
                             "rest, after the kills, are SIGSTOPs")
    parser.add_argument("--fault-gap", type=float, default=FAULT_GAP_S,
                        help="seconds at least between two faults")
    parser.add_argument("--nodes", action="store_true",
                        help="each run on a simulated multi-node cluster (ray.cluster_utils), "
                             "where --node-share of the kills remove the worker's node instead")
    parser.add_argument("--node-share", type=float, default=0.5,
                        help="with --nodes: the share of the kills that are node removals")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", type=Path)
    args, extra = parser.parse_known_args(argv)
    if not 0 <= args.kill_share <= 1 or not 0 <= args.slow_share <= 1 - args.kill_share:
        raise SystemExit("--kill-share and --slow-share: each in [0, 1], together at most 1")
    round_seconds = args.round_seconds or (args.round_floor + 0.1 if args.round_floor else 0.18)
    names = args.strategies.split(",")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"--strategies: unknown {unknown}; choose from {list(STRATEGIES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.out)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        share = args.faults // len(names) + (index < args.faults % len(names))
        faults, rounds = plan_faults(share, args.workers, round_seconds, rng,
                                     rank_0_first=index == 0 and args.slow_share < 1,
                                     slow_share=args.slow_share, gap_s=args.fault_gap,
                                     kill_share=args.kill_share,
                                     node_share=args.node_share if args.nodes else 0.0)
        flags = train_flags(args.workers, rounds, data,
                            STRATEGIES[name] or [f"--outer.strategy={name}"]) + extra
        print(f"{name}: {rounds} rounds, faults (round, worker, what): "
              f"{[(f.round, f.worker, f.label) for f in faults]}", flush=True)
        result = train(name, flags, args.out, faults, args.round_floor,
                       args.workers if args.nodes else 0)
        rows.append(figures(name, flags, data, args.out / name, result, faults, args.workers))
        print(json.dumps(rows[-1]), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps({"seed": args.seed, "round_floor": args.round_floor,
                                             "runs": rows}, indent=2) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
