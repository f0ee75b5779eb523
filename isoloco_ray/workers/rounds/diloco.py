"""One DiLoCo round of a worker: H inner steps on every hosted replica, then the outer step of
every tensor, landed into the replicas. Streaming (outer.fragments, delay, mix) runs these
rounds' steps in another order (rounds/streaming.py); over a quorum their sync goes through the
worker's seat (quorum/rounds.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from isoloco_ray.data.format import DataError
from isoloco_ray.workers.agreement import stop_if_any_rank_failed
from isoloco_ray.workers.outer.step import OuterStepStats, stopwatch
from isoloco_ray.workers.quorum.seat import CommittedSync
from isoloco_ray.workers.rounds.round_parts import RoundParts

# The hosted replicas' Δ_r of one fragment, as an outer step takes them: the global tensors it
# updates, each replica's Δ_r, the replicas that diverged, their error-feedback residuals.
OuterInputs = tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]], list[int],
                    dict[int, dict[str, torch.Tensor]] | None]


class DiLoCoRounds:
    """Runs a worker's DiLoCo rounds on the Trainer's parts (round_parts.py). Holds no
    checkpointed state: every sync has landed at a round's end, where checkpoints are taken."""

    committed: CommittedSync | None = None  # a quorum's sync: never here (QuorumRounds)

    def __init__(self, parts: RoundParts) -> None:
        self.parts = parts

    def run_round(self, round_index: int) -> tuple[float, float, OuterStepStats]:
        """Round `round_index` + 1 (`round_index` rounds are done). Returns (sum of the finite
        replicas' mean losses on this rank, counted by the first worker of each replica only,
        inner seconds, the round's sync's stats)."""
        parts = self.parts
        losses: dict[int, list[torch.Tensor]] = {r.index: [] for r in parts.replicas}
        inner_seconds, data_error = self._inner_steps(round_index, parts.cfg.inner.steps,
                                                      losses, True, None)
        self._stop_if_any_failed(round_index, data_error)  # every rank, before the sync
        inputs = self._outer_inputs(0, in_place=True)
        stats = self._finish(0, self._sync(*inputs, round_index, losses, inner_seconds))
        return self._loss_sum(losses, stats), inner_seconds, stats

    def _loss_sum(self, losses: dict[int, list[torch.Tensor]], stats: OuterStepStats) -> float:
        """The sum of the finite replicas' mean losses on this rank, counted by the first
        worker of each replica only."""
        counted = self.parts.layout.position == 0
        return sum((loss for replica, loss in self._mean_losses(losses).items()
                    if replica not in stats.dropped and counted), 0.0)

    def _stop_if_any_failed(self, round_index: int, data_error: str | None) -> None:
        """TrainingStopped on every rank, with one message, when any rank's data failed this
        round."""
        stop_if_any_rank_failed(data_error, round_index)

    def _mean_losses(self, losses: dict[int, list[torch.Tensor]]) -> dict[int, float]:
        """Each hosted replica's mean inner loss this round (over its G workers' rows: every
        worker of the replica calls this)."""
        parts = self.parts
        means = {}
        for replica in parts.replicas:
            loss = torch.stack(losses[replica.index]).mean().item()
            if parts.layout.shard is not None:
                loss = parts.layout.shard.mean(loss, parts.env.device)
            means[replica.index] = loss
        return means

    def _inner_steps(self, round_index: int, steps: int, losses: dict[int, list[torch.Tensor]],
                     ends_round: bool, data_error: str | None) -> tuple[float, str | None]:
        """`steps` inner steps of every hosted replica, in turn (with a straggler deadline
        each stops at its own: straggler_deadline.py); after a data error, none (the ranks
        stop together at the next check). Returns (seconds, the data error if any)."""
        parts = self.parts
        started = time.perf_counter()
        deadlines = self._round_deadlines(steps)
        for turn, replica in enumerate(parts.replicas):
            if data_error is not None:
                break
            try:
                losses[replica.index] += replica.run_inner_steps(
                    parts.model, parts.runtime, steps, parts.cfg.resolved.micro_batch_size,
                    parts.layout.shard,
                    self._after_step(round_index, replica.index,
                                     None if deadlines is None else deadlines[turn]))
            except DataError as exc:  # a replica's G workers read the same rows: all stop
                data_error = str(exc)
                break
            if ends_round and parts.env.after_replica is not None:
                parts.env.after_replica(round_index, replica.index)
        return time.perf_counter() - started, data_error

    def _round_deadlines(self, steps: int) -> list[float] | None:
        """When each hosted replica's inner steps stop this round: never here (a straggler
        deadline needs a quorum: QuorumRounds)."""
        return None

    def _after_step(self, round_index: int, replica: int, deadline: float | None
                    ) -> Callable[[], bool] | None:
        """What Replica.run_inner_steps calls after each step: the test hook, then whether
        to stop: another step as long as the last one would end past the deadline (a
        time.perf_counter()), so that a straggler reaches the sync by it."""
        hook = self.parts.env.after_step
        if hook is None and deadline is None:
            return None
        previous = time.perf_counter()

        def after_step() -> bool:
            nonlocal previous
            if hook is not None:
                hook(round_index, replica)
            now = time.perf_counter()
            step, previous = now - previous, now
            return deadline is not None and now + step > deadline

        return after_step

    def _outer_inputs(self, fragment: int, in_place: bool) -> OuterInputs:
        """Take the hosted replicas' Δ_r of `fragment` (`in_place`: in θ_r's storage, which
        the global values replace right after the step)."""
        parts = self.parts
        names = parts.fragments[fragment]
        diverged = [r.index for r in parts.replicas if not r.losses_finite]
        for replica in parts.replicas:
            replica.losses_finite = True
        deltas = {r.index: r.pseudo_gradient(parts.global_params, names, in_place)
                  for r in parts.replicas}
        feedback = ({r.index: r.feedback for r in parts.replicas}
                    if parts.cfg.outer.error_feedback else None)
        target = {name: parts.global_params[name] for name in names}
        return target, deltas, diverged, feedback

    def _sync(self, target: dict[str, torch.Tensor],
              deltas: dict[int, dict[str, torch.Tensor]], diverged: list[int],
              feedback: dict[int, dict[str, torch.Tensor]] | None, sync_round: int,
              losses: dict[int, list[torch.Tensor]], inner_seconds: float) -> OuterStepStats:
        """The outer step of the tensors `target` (the training thread waits for all of it;
        `losses` and `inner_seconds` are the quorum's: QuorumRounds)."""
        started = time.perf_counter()
        stats = self.parts.outer.step(target, deltas, sync_round, diverged, feedback)
        stats.wait_seconds = time.perf_counter() - started
        return stats

    def _finish(self, fragment: int, stats: OuterStepStats) -> OuterStepStats:
        """Land `fragment`'s sync: its global tensors hold the new values (with G workers per
        replica, shared among them first); each replica takes them (`_land`)."""
        parts = self.parts
        shard = parts.layout.shard
        if shard is not None and not stats.skipped:
            # Each position stepped its share of the fragment's tensors (outer/step.py): here,
            # in the training thread like the gradient all-reduce, the replica's workers share
            # them, and what error feedback kept of each.
            names = parts.fragments[fragment]
            shares = parts.outer.shares({name: parts.global_params[name].shape
                                           for name in names})
            before = stats.comm_seconds
            with stopwatch(stats, "comm_seconds", parts.env.device):
                shard.share(shares, parts.global_params, parts.global_params)
                if parts.cfg.outer.error_feedback:
                    for replica in parts.replicas:
                        if replica.index not in stats.dropped:
                            shard.share(shares, replica.feedback, parts.global_params)
            stats.wait_seconds += stats.comm_seconds - before  # training waits for it
        self._land(fragment, stats)
        return stats

    def _land(self, fragment: int, stats: OuterStepStats) -> None:
        """Each replica takes the new global values of `fragment` (mixed with its own by
        outer.mix), or starts again from the global parameters if it was left out."""
        parts = self.parts
        for replica in parts.replicas:
            if replica.index in stats.dropped:
                replica.reset(parts.global_params)
            else:
                replica.take_global(parts.global_params, parts.fragments[fragment],
                                    parts.cfg.outer.mix)

    def quorum_metrics(self) -> dict[str, Any]:
        """Who took part in the round's sync: nothing to say without a quorum."""
        return {}

    def close(self) -> None:
        """Nothing to stop (a streaming run's background thread: StreamingRounds)."""
