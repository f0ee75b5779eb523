"""One DiLoCo round of a worker: H inner steps on every hosted replica, and the outer syncs of
the round's fragments (fragments.round_events; with one fragment and no delay, the outer step
at the end), started at once or in the background (outer.delay) and landed into the replicas."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from isoloco_ray.data.format import DataError
from isoloco_ray.workers.agreement import stop_if_any_rank_failed
from isoloco_ray.workers.fragments import round_events
from isoloco_ray.workers.outer.step import OuterStepStats, stopwatch
from isoloco_ray.workers.overlap import Background
from isoloco_ray.workers.quorum import CommittedSync
from isoloco_ray.workers.round_parts import RoundParts


class DiLoCoRounds:
    """Runs a worker's DiLoCo rounds on the Trainer's parts (round_parts.py). Holds no
    checkpointed state: every sync has landed at a round's end, where checkpoints are taken.
    With a quorum seat the Trainer runs QuorumRounds (quorum_rounds.py) instead."""

    # Syncs started but not landed, by fragment (none at a round's end).
    in_flight: dict[int, Future[OuterStepStats] | OuterStepStats]
    background: Background | None  # the thread syncs run on with outer.delay
    committed: CommittedSync | None = None  # a quorum's sync: never here (QuorumRounds)

    def __init__(self, parts: RoundParts) -> None:
        self.parts = parts
        self.in_flight = {}
        self.background = (Background(parts.env.device) if parts.cfg.outer.delay > 0
                           else None)

    def run_round(self, round_index: int) -> tuple[float, float, OuterStepStats]:
        """Round `round_index` + 1 (`round_index` rounds are done). Returns (sum of the finite
        replicas' mean losses on this rank, counted by the first worker of each replica only,
        inner seconds, the round's syncs' stats together)."""
        parts = self.parts
        cfg = parts.cfg
        steps = cfg.inner.steps
        stats = OuterStepStats()
        losses: dict[int, list[torch.Tensor]] = {r.index: [] for r in parts.replicas}
        inner_seconds, done, checked = 0.0, 0, False
        data_error = None
        try:
            for event in round_events(round_index, cfg.resolved.rounds, steps,
                                      cfg.outer.fragments, cfg.outer.delay):
                if event.step > done:
                    seconds, data_error = self._inner_steps(round_index, event.step - done,
                                                            losses, event.step == steps,
                                                            data_error)
                    inner_seconds += seconds
                    done, checked = event.step, False
                if event.starts:
                    # Every rank stops together before a sync when any rank's data failed.
                    self._stop_if_any_failed(round_index, data_error)
                    checked = True
                    self._start_sync(event.fragment, event.sync_round, losses,
                                     inner_seconds)
                else:
                    stats.add(self._finish_sync(event.fragment))
            if done < steps:
                seconds, data_error = self._inner_steps(round_index, steps - done, losses, True,
                                                        data_error)
                inner_seconds += seconds
                checked = False
            if not checked:
                self._stop_if_any_failed(round_index, data_error)
        finally:
            self._wait_for_syncs()
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

    def _start_sync(self, fragment: int, sync_round: int,
                    losses: dict[int, list[torch.Tensor]], inner_seconds: float) -> None:
        """Take the hosted replicas' Δ_r of `fragment` and start its outer step: at once, or
        in the background with outer.delay, or over the round's quorum (`losses`: each hosted
        replica's inner losses this round, for the quorum's loss sum and the share of the
        round each took, whose `inner_seconds` this worker's header carries per step)."""
        parts = self.parts
        outer = parts.cfg.outer
        names = parts.fragments[fragment]
        diverged = [r.index for r in parts.replicas if not r.losses_finite]
        for replica in parts.replicas:
            replica.losses_finite = True
        # Without delay or mix, θ_r of the fragment is replaced by the global one right after
        # the step: its storage can hold Δ_r meanwhile.
        in_place = outer.delay == 0 and outer.mix == 0
        deltas = {r.index: r.pseudo_gradient(parts.global_params, names, in_place)
                  for r in parts.replicas}
        feedback = ({r.index: r.feedback for r in parts.replicas} if outer.error_feedback
                    else None)
        target = {name: parts.global_params[name] for name in names}
        self.in_flight[fragment] = self._sync(target, deltas, sync_round, diverged, feedback,
                                              losses, inner_seconds)

    def _sync(self, target: dict[str, torch.Tensor],
              deltas: dict[int, dict[str, torch.Tensor]], sync_round: int, diverged: list[int],
              feedback: dict[int, dict[str, torch.Tensor]] | None,
              losses: dict[int, list[torch.Tensor]], inner_seconds: float
              ) -> Future[OuterStepStats] | OuterStepStats:
        """The outer step of the tensors `target`: done, or started in the background."""
        parts = self.parts

        def step() -> OuterStepStats:
            return parts.outer.step(target, deltas, sync_round, diverged, feedback)

        if self.background is not None:
            return self.background.start(step)
        started = time.perf_counter()
        stats = step()
        stats.wait_seconds = time.perf_counter() - started  # training waited for all of it
        return stats

    def _finish_sync(self, fragment: int) -> OuterStepStats:
        """Land `fragment`'s sync: its global tensors hold the new values; each replica takes
        them (mixed with its own by outer.mix), or starts again from the global parameters if
        it was left out."""
        parts = self.parts
        pending = self.in_flight.pop(fragment)
        if isinstance(pending, Future):
            assert self.background is not None
            waiting = time.perf_counter()
            stats = self.background.finish(pending)
            stats.wait_seconds = time.perf_counter() - waiting
        else:
            stats = pending
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

    def _wait_for_syncs(self) -> None:
        """Let syncs still running end (the round stopped early: every rank started them, so
        they complete), without landing them."""
        for pending in self.in_flight.values():
            if isinstance(pending, Future):
                pending.exception()
        self.in_flight.clear()

    def quorum_metrics(self) -> dict[str, Any]:
        """Who took part in the round's sync: nothing to say without a quorum."""
        return {}

    def save(self, directory: Path) -> None:
        """Nothing of its own to save: every sync has landed at a round's end."""

    def restore(self, directory: Path) -> None:
        """Nothing of its own to restore (see `save`)."""

    def close(self) -> None:
        """Stop the background thread, if any."""
        if self.background is not None:
            self.background.close()
