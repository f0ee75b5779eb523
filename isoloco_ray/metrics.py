"""What a run measures, named once.

`RoundMetrics` is one outer round's line of `metrics.jsonl` (and of Ray Train's report, Tune's
result, W&B's log); `RunSummary` is `summary.json`. Their fields are the metric names: the
console's progress line, the grid's choices of metric (`grids/spec.py`) and the report's
columns (`report.py`) derive from them, and a name that is not a field is refused when a record
is built. On the wire and on disk both are plain JSON objects without the unset (None) fields;
reading one back ignores names it does not know (Tune adds its own to a result).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

_Record = TypeVar("_Record", bound="_JsonRecord")


def _judged(default: Any = None) -> Any:
    """A round figure a grid's scheduler may judge a running trial by (lower is better)."""
    return field(default=default, metadata={"judged": True})


def _ranked(*, diverged_if_not_finite: bool = False) -> Any:
    """A summary figure a grid or a report may rank runs by (`diverged_if_not_finite`: a
    finished run whose value is not a finite number diverged)."""
    return field(default=None, metadata={"ranked": True,
                                         "diverged_if_not_finite": diverged_if_not_finite})


class _JsonRecord:
    """The JSON object of a record: its set fields, in declaration order."""

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (not None), as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls: type[_Record], values: dict[str, Any]) -> _Record:
        """The record of a JSON object written by `as_dict`; names it does not know (Tune's, a
        newer version's) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{key: value for key, value in values.items() if key in names})

    @classmethod
    def names(cls, flag: str) -> tuple[str, ...]:
        """The fields marked `flag` in their metadata, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                     if f.metadata.get(flag))


@dataclass
class RoundMetrics(_JsonRecord):
    """One outer round's figures (round 0: the initial evaluation only), the same on every
    rank. The outer-sync figures are the slowest or busiest rank's: the round waits for it."""

    round: int
    tokens: int  # trained so far, all replicas together
    eval_loss: float | None = _judged()  # evaluation rounds only (run.eval_every, the last)
    eval_perplexity: float | None = _judged()
    loss: float | None = _judged()  # mean inner loss of the round's finite replicas
    tokens_per_s: float | None = None
    round_seconds: float | None = None
    inner_seconds: float | None = None  # the local steps, all replicas of the slowest rank
    outer_comm_seconds: float | None = None
    outer_merge_seconds: float | None = None
    outer_wait_seconds: float | None = None  # training blocked on outer syncs (outer.delay)
    outer_bytes_received: int | None = None
    outer_bytes_by_rank: list[int] | None = None
    dropped_replicas: list[int] | None = None  # diverged this round: left out of the merge
    # The workers' agreement on θ (workers/agreement.py): a full hash on checkpoint rounds.
    state_sha256: str | None = None
    state_checksum: str | None = None
    # scaling.fault_tolerance=replica: who took part in the round's sync (rounds/diloco.py).
    quorum: list[int] | None = None
    contributors: list[int] | None = None
    missing_workers: list[int] | None = None
    sync_attempts: int | None = None
    quorum_wait_seconds: float | None = None
    committed_at: float | None = None  # Unix time the writer saw the sync committed
    # The inner steps each replica's Δ_r in the merge took (0: not in it); fewer than H for
    # a straggler's partial round (scaling.straggler_deadline).
    replica_steps: list[int] | None = None
    round_steps: int | None = None  # H: the inner steps of a round taken in full

    def partial_replicas(self) -> dict[int, int]:
        """The replicas in the merge that took fewer inner steps than a full round's H (a
        straggler's partial round), with their steps. (A record without `round_steps`, of an
        earlier version, compares with the round's most steps instead.)"""
        steps = self.replica_steps or []
        full = self.round_steps or max(steps, default=0)
        return {r: taken for r, taken in enumerate(steps) if 0 < taken < full}

    def progress_line(self, rounds: int, overlapped: bool = False) -> str:
        """The console's line for this round; with `overlapped` (outer.delay > 0) it adds how
        long training waited for the outer syncs."""
        parts = [f"round {self.round:>4}/{rounds}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f} (ppl {self.eval_perplexity:.1f})")
        if self.missing_workers:
            parts.append(f"without workers {self.missing_workers}")
        if self.dropped_replicas:
            parts.append(f"dropped replicas {self.dropped_replicas}")
        partial = self.partial_replicas()
        if partial:
            parts.append("partial " + ", ".join(f"replica {r} {steps} steps"
                                                for r, steps in partial.items()))
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
            parts.append(f"inner {self.inner_seconds:.1f}s comm "
                         f"{self.outer_comm_seconds:.2f}s merge "
                         f"{self.outer_merge_seconds:.2f}s "
                         f"{self.outer_bytes_received / 2**20:,.1f} MiB in")
            if overlapped:
                parts.append(f"waited {self.outer_wait_seconds:.2f}s")
        return " | ".join(parts)


def format_progress(metrics: dict[str, Any], rounds: int, overlapped: bool = False) -> str:
    """The console's line for a round's report (a metrics.jsonl line, a Tune result)."""
    return RoundMetrics.from_dict(metrics).progress_line(rounds, overlapped)


@dataclass
class RunSummary(_JsonRecord):
    """A finished run's figures: `summary.json`. The workers set the training's figures, the
    driver what only it knows (where things are, wall time, fault-tolerance counts), and
    `python -m isoloco_ray.evaluate` adds `evaluations`."""

    status: str | None = None  # done, or diverged (then `diverged` says why)
    diverged: str | None = None
    strategy: str | None = None
    replicas: int | None = None
    rounds: int | None = None
    tokens: int | None = None
    num_parameters: int | None = None
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = _ranked(diverged_if_not_finite=True)
    final_eval_perplexity: float | None = _ranked(diverged_if_not_finite=True)
    tokens_per_s: float | None = _ranked()  # after the first round (it starts the streams)
    seconds: float | None = _ranked()  # the driver's wall time, Ray's start included
    train_seconds: float | None = _ranked()
    first_round_seconds: float | None = None
    outer_bytes_per_round: float | None = _ranked()  # the busiest rank's, per round
    model_sha256: str | None = None  # of the final global parameters
    resume_warning: str | None = None  # a damaged checkpoint was skipped at resume
    # Where it ran (workers/loop.py, replica_mode.py): Ray workers and nodes, threads each.
    workers: int | None = None
    nodes: int | None = None
    torch_threads: int | None = None
    placement_warning: str | None = None  # a replica's ranks spread over nodes
    # scaling.fault_tolerance=replica (fault_tolerance.quorum_summary)
    worker_losses: int | None = None
    rounds_with_missing_workers: int | None = None
    rounds_missed_by_worker: list[int] | None = None  # rounds without each worker's Δ, by rank
    rounds_with_partial_replicas: int | None = None  # a straggler's Δ cut short (deadline)
    max_quorum_wait_seconds: float | None = None
    # Times every worker started again from a checkpoint (Ray Train's controller failed:
    # driver.restarting_on_controller_errors).
    group_restarts: int | None = None
    ray_start_seconds: float | None = None
    model_dir: str | None = None
    run_dir: str | None = None
    data_dir: str | None = None
    evaluations: dict[str, Any] | None = None


# What a grid may rank its trials by and a report sort its table by; what a scheduler may judge
# a running trial by; and which summary figures mark a run diverged when they are not finite.
SUMMARY_METRICS = RunSummary.names("ranked")
ROUND_METRICS = RoundMetrics.names("judged")
DIVERGED_IF_NOT_FINITE = RunSummary.names("diverged_if_not_finite")
