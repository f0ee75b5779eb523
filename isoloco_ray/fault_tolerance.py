"""The driver's side of `scaling.fault_tolerance: replica` (docs/fault_tolerance.md): the
check that torchft is installed, and Ray Train's torchft backend for the run.

In this mode each Ray Train worker is one torchft replica group; a torchft lighthouse (a Ray
actor that Ray Train starts on the driver's node) forms one quorum per outer round from the
workers alive, and Ray Train replaces a lost worker alone while the others go on
(workers/quorum/seat.py is the workers' side).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from typing import Any

from isoloco_ray import run_files
from isoloco_ray.config import ConfigError, TrainConfig
from isoloco_ray.metrics import RoundMetrics, RunSummary

INSTALL_HINT = "pip install 'isoloco_ray[ft]' (pip install -e '.[ft]' in a checkout)"

# How long the lighthouse waits, once a worker asks for a round's quorum, for the live workers
# that have not asked yet (still in their inner steps): a straggler later than this misses the
# round (its replicas rejoin at the next). A lost worker is not waited for this long: it stops
# heartbeating (torchft's managers beat every 100 ms), and one silent for
# ISOLOCO_RAY_FT_HEARTBEAT_TIMEOUT_S (1 s unless set; torchft's default, 5 s, was each
# fault's whole stall in the soak: docs/fault_tolerance.md) is out.
JOIN_TIMEOUT_MS = 30_000


def timeouts() -> dict[str, float]:
    """The workers' bounds, in seconds (docs/fault_tolerance.md), read on the driver: a
    collective of the quorum fails after `collective`, a worker waits `quorum` for a quorum
    (longer than a round: a replacement waits for the others' next sync)."""
    from isoloco_ray.env_settings import read_env

    env = read_env()
    return {"collective": env.ft_timeout_s, "quorum": env.ft_quorum_timeout_s}


def check_torchft_available(cfg: TrainConfig) -> None:
    """ConfigError when `replica` is asked for and torchft is missing (before Ray starts)."""
    if (cfg.scaling.fault_tolerance == "replica"
            and importlib.util.find_spec("torchft") is None):
        raise ConfigError("scaling.fault_tolerance: replica needs torchft, which is not "
                          f"installed: {INSTALL_HINT}, or use scaling.fault_tolerance=restart")


def exposure_note(cfg: TrainConfig) -> str | None:
    """The line a replica-mode run prints once at its start: torchft's manager server (0.2.0,
    and the nightly of 2026-10-26 alike) listens on every interface with no option for the
    address and serves an unauthenticated Kill call; None in restart mode."""
    if cfg.scaling.fault_tolerance != "replica":
        return None
    return ("note: in scaling.fault_tolerance=replica each worker's torchft manager server "
            "listens on every interface (torchft offers no address to bind) and answers an "
            "unauthenticated Kill call: keep the machines' firewall closed to the outside "
            "(docs/fault_tolerance.md, \"Sockets and ports\")")


def min_quorum(workers: int) -> int:
    """The fewest workers a round's quorum may have: a majority, so that two halves of a split
    cluster can never both go on (and a straggler never commits a round alone)."""
    return workers // 2 + 1


def torchft_backend(cfg: TrainConfig, joined: bool) -> Any:
    """Ray Train's torchft backend (TorchTrainer's torch_config) for a `replica` run. The
    lighthouse listens on loopback on a local cluster; on a joined one the workers on other
    nodes must reach it (docs/fault_tolerance.md: ports). It drops a worker silent for
    ISOLOCO_RAY_FT_HEARTBEAT_TIMEOUT_S."""
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from isoloco_ray.env_settings import read_env

    heartbeat_ms = round(read_env().ft_heartbeat_timeout_s * 1000)
    return TorchftConfig(
        lighthouse_kwargs={"bind": "[::]:0" if joined else "127.0.0.1:0",
                           "min_replicas": min_quorum(cfg.scaling.num_workers),
                           "join_timeout_ms": JOIN_TIMEOUT_MS,
                           "heartbeat_timeout_ms": heartbeat_ms},
        backend="gloo")


def quorum_summary(lines: Iterable[str]) -> dict[str, Any]:
    """A replica-mode run's figures for summary.json from its metrics.jsonl lines (the last
    record of each round: a resumed run repeats the rounds after its checkpoint):
    `worker_losses`, the times a worker that brought a Δ to one round brought none to the
    next (lost, or stalled past the lighthouse's wait); `rounds_with_missing_workers`; and
    `rounds_missed_by_worker`, the rounds each worker (by rank) brought no Δ to (lost,
    replaced, or behind the others); `rounds_with_partial_replicas`, those in which a
    straggler's inner steps were cut short (scaling.straggler_deadline); and
    `max_quorum_wait_seconds`, the longest a round's writer waited for its quorum."""
    rounds: dict[int, RoundMetrics] = {}
    for line in lines:
        record = RoundMetrics.from_dict(json.loads(line))
        if record.round > 0 and record.contributors is not None:
            rounds[record.round] = record
    ordered = [rounds[index] for index in sorted(rounds)]
    losses = sum(len(set(before.contributors or ()) - set(after.contributors or ()))
                 for before, after in zip(ordered, ordered[1:]))
    workers = max((max([*(r.contributors or ()), *(r.missing_workers or ())], default=-1)
                   for r in ordered), default=-1) + 1
    return RunSummary(
        worker_losses=losses,
        rounds_with_missing_workers=sum(bool(r.missing_workers) for r in ordered),
        rounds_missed_by_worker=[sum(w not in (r.contributors or ()) for r in ordered)
                                 for w in range(workers)],
        rounds_with_partial_replicas=sum(bool(r.partial_replicas()) for r in ordered),
        max_quorum_wait_seconds=max((r.quorum_wait_seconds or 0.0 for r in ordered),
                                    default=0.0)).as_dict()


def absence_note(summary: dict[str, Any]) -> str | None:
    """The line that ends a replica-mode run in which some worker brought no Δ to some rounds
    (lost, replaced, or behind the others), naming each such worker and its rounds missed,
    in which a straggler's rounds were cut short (counted), or in which every worker started
    again from a checkpoint; None when every worker took part in every round in full (or for
    another mode)."""
    missed = summary.get("rounds_missed_by_worker") or []
    rounds = summary.get("rounds") or 0
    absent = [f"worker {w} missed {count} of {rounds} round(s)"
              for w, count in enumerate(missed) if count]
    notes = [f"{', '.join(absent)} (lost, replaced or behind the others; worker_losses "
             f"{summary.get('worker_losses', 0)}): see missing_workers in metrics.jsonl"
             ] if absent else []
    if summary.get("rounds_with_partial_replicas"):
        notes.append(f"{summary['rounds_with_partial_replicas']} of {rounds} round(s) merged a "
                     "straggler's partial round (scaling.straggler_deadline): see "
                     "replica_steps in metrics.jsonl")
    if summary.get("group_restarts"):
        notes.append(f"every worker started again from a checkpoint "
                     f"{summary['group_restarts']} time(s) (several workers lost at once)")
    return f"note: {'; '.join(notes)}" if notes else None


def read_end(run_dir: Any) -> dict[str, Any] | None:
    """The run's result as its workers left it (`ft_end.json`, written by
    workers/quorum/replica_mode.py's `write_end`: rank 0 may be the lost one), or None."""
    path = run_dir / run_files.FT_END
    return json.loads(path.read_text()) if path.exists() else None
