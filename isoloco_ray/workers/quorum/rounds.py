"""DiLoCo rounds over a quorum (scaling.fault_tolerance: replica): the plain rounds
(rounds/diloco.py) with each sync taken by the workers alive in it (QuorumSync through the
worker's seat), a straggler deadline on the inner steps, a data error stopping every worker of
the quorum, and a worker healed in a sync going on as a replacement does. The Trainer runs these
rounds when its worker has a seat; the plain rounds know nothing of quorums."""

from __future__ import annotations

import time
from typing import Any

import torch

from isoloco_ray.workers.agreement import TrainingStopped
from isoloco_ray.workers.outer.step import OuterStepStats
from isoloco_ray.workers.quorum.seat import CommittedSync
from isoloco_ray.workers.quorum.straggler_deadline import StragglerDeadline
from isoloco_ray.workers.quorum.sync import QuorumSync
from isoloco_ray.workers.rounds.diloco import DiLoCoRounds
from isoloco_ray.workers.rounds.round_parts import RoundParts


class QuorumRounds(DiLoCoRounds):
    """A seated worker's DiLoCo rounds (see the module's docstring)."""

    committed: CommittedSync | None  # the last sync this worker took part in
    # With scaling.straggler_deadline: when the inner steps stop (rebuilt from the syncs'
    # measurements, not saved).
    deadline: StragglerDeadline | None

    def __init__(self, parts: RoundParts) -> None:
        if parts.cfg.outer.streaming:
            raise ValueError("the quorum's outer step runs without outer.fragments, delay and "
                             "mix: leave them at their defaults")
        if parts.env.seat is None or not isinstance(parts.outer, QuorumSync):
            raise ValueError("QuorumRounds needs a worker with a quorum seat and its QuorumSync")
        super().__init__(parts)
        self.committed = None
        factor = parts.cfg.scaling.straggler_deadline
        self.deadline = StragglerDeadline(factor) if factor is not None else None

    def _loss_sum(self, losses: dict[int, list[torch.Tensor]], stats: OuterStepStats) -> float:
        """Every contributing worker's, from the quorum."""
        assert self.committed is not None
        return self.committed.loss_sum

    def _stop_if_any_failed(self, round_index: int, data_error: str | None) -> None:
        """TrainingStopped on every worker, with one message, when any worker's data failed
        this round: the failing worker's sync carries the message to the others' syncs."""
        env = self.parts.env
        if data_error is not None:
            assert env.seat is not None
            reason = f"worker {env.rank} in round {round_index + 1}: {data_error}"
            env.seat.sync(None, round_index=round_index, stopping=reason)  # raises everywhere
            raise TrainingStopped(reason)

    def _round_deadlines(self, steps: int) -> list[float] | None:
        if self.deadline is None:
            return None
        return self.deadline.round_deadlines(steps, len(self.parts.replicas))

    def _sync(self, target: dict[str, torch.Tensor],
              deltas: dict[int, dict[str, torch.Tensor]], diverged: list[int],
              feedback: dict[int, dict[str, torch.Tensor]] | None, sync_round: int,
              losses: dict[int, list[torch.Tensor]], inner_seconds: float) -> OuterStepStats:
        """The round's outer step over its quorum (`losses`: each hosted replica's inner losses
        this round, for the quorum's loss sum and the share of the round each took, whose
        `inner_seconds` this worker's header carries per step)."""
        parts = self.parts
        assert isinstance(parts.outer, QuorumSync) and parts.env.seat is not None
        steps = {r.index: len(losses[r.index]) for r in parts.replicas}
        started = time.perf_counter()
        stats, committed = parts.outer.quorum_step(
            target, deltas, sync_round, parts.env.seat, diverged, self._mean_losses(losses),
            trained={r: taken / parts.cfg.inner.steps for r, taken in steps.items()},
            step_seconds=inner_seconds / max(1, sum(steps.values())), feedback=feedback)
        stats.wait_seconds = time.perf_counter() - started
        self.committed = committed
        if self.deadline is not None:
            self.deadline.note(committed)
        return stats

    def _land(self, fragment: int, stats: OuterStepStats) -> None:
        """Healed in the sync: this worker fell behind (paused, slow) and the others went on.
        Its replicas go on as a replacement's do, from where the sync's round puts them (not
        this worker's own round before it was healed). Otherwise as the plain rounds land."""
        parts = self.parts
        if self.committed is not None and self.committed.healed:
            for replica in parts.replicas:
                replica.rejoin((self.committed.round + 1) * parts.cfg.inner.steps,
                               parts.global_params)
            return
        super()._land(fragment, stats)

    def quorum_metrics(self) -> dict[str, Any]:
        """With a quorum seat, who took part in the round's sync: the workers in its quorum,
        those that brought a Δ, those that did not (`missing_workers`: lost, or just
        healed; at the join before round 1, those not in it), the quorums it took (1 when
        nobody failed), the seconds this worker waited for them and when it saw the sync
        committed (a fault's stall is measured to it: benchmarks/soak.py), and the inner steps
        each replica's Δ_r in the merge took (0: not in it; fewer than H, `round_steps`: a
        straggler's partial round, which plain_loop.run_over_quorums replays): RoundMetrics' quorum
        fields (a name that is not one is refused when the record is built)."""
        if self.committed is None:
            return {}
        contributors = self.committed.contributors
        present = contributors or self.committed.participants
        steps = self.parts.cfg.inner.steps
        return {"quorum": self.committed.participants, "contributors": contributors,
                "missing_workers": [w for w in range(self.parts.env.world)
                                    if w not in present],
                "sync_attempts": self.committed.attempts,
                "replica_steps": [round(self.committed.shares.get(r, 0.0) * steps)
                                  for r in range(self.parts.cfg.scaling.replicas)],
                "round_steps": steps,
                "quorum_wait_seconds": self.committed.quorum_seconds,
                "committed_at": self.committed.committed_at}
