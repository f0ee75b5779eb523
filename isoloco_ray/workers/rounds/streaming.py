"""Streaming DiLoCo rounds (outer.fragments, outer.delay, outer.mix): the plain rounds'
inner steps and outer steps (rounds/diloco.py), in the order fragments.round_events gives: each
fragment's sync starts when its share of the round's steps is done, at once or in the
background (outer.delay), and lands `delay` steps later, mixed into the replicas (outer.mix).
Every sync has landed at a round's end, where evaluations and checkpoints are taken."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from isoloco_ray.workers.outer.step import OuterStepStats
from isoloco_ray.workers.rounds.diloco import DiLoCoRounds
from isoloco_ray.workers.rounds.fragments import round_events
from isoloco_ray.workers.rounds.overlap import Background
from isoloco_ray.workers.rounds.round_parts import RoundParts


class StreamingRounds(DiLoCoRounds):
    """A worker's streaming rounds (see the module's docstring)."""

    # Syncs started but not landed, by fragment (none at a round's end).
    in_flight: dict[int, Future[OuterStepStats] | OuterStepStats]
    background: Background | None  # the thread syncs run on with outer.delay

    def __init__(self, parts: RoundParts) -> None:
        super().__init__(parts)
        self.in_flight = {}
        self.background = (Background(parts.env.device) if parts.cfg.outer.delay > 0
                           else None)

    def run_round(self, round_index: int) -> tuple[float, float, OuterStepStats]:
        """Round `round_index` + 1, as DiLoCoRounds.run_round returns it (the stats of every
        sync that landed in it together)."""
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

    def _start_sync(self, fragment: int, sync_round: int,
                    losses: dict[int, list[torch.Tensor]], inner_seconds: float) -> None:
        """Take the hosted replicas' Δ_r of `fragment` and start its outer step: at once, or
        in the background with outer.delay."""
        outer = self.parts.cfg.outer
        # Without delay or mix, θ_r of the fragment is replaced by the global one right after
        # the step: its storage can hold Δ_r meanwhile.
        inputs = self._outer_inputs(fragment, in_place=outer.delay == 0 and outer.mix == 0)
        if self.background is None:
            self.in_flight[fragment] = self._sync(*inputs, sync_round, losses, inner_seconds)
            return
        self.in_flight[fragment] = self.background.start(
            lambda: self._sync(*inputs, sync_round, losses, inner_seconds))

    def _finish_sync(self, fragment: int) -> OuterStepStats:
        """Land `fragment`'s sync (DiLoCoRounds._finish), once it is done."""
        pending = self.in_flight.pop(fragment)
        if isinstance(pending, Future):
            assert self.background is not None
            waiting = time.perf_counter()
            stats = self.background.finish(pending)
            stats.wait_seconds = time.perf_counter() - waiting  # what training waited
        else:
            stats = pending
        return self._finish(fragment, stats)

    def _wait_for_syncs(self) -> None:
        """Let syncs still running end (the round stopped early: every rank started them, so
        they complete), without landing them."""
        for pending in self.in_flight.values():
            if isinstance(pending, Future):
                pending.exception()
        self.in_flight.clear()

    def close(self) -> None:
        """Stop the background thread, if any."""
        if self.background is not None:
            self.background.close()
