"""When a straggler's inner steps stop (scaling.straggler_deadline, replica mode).

Without a deadline a worker slower than the others (a busy or throttled machine, a slow link
to its data) makes every round wait for it. With one, each worker measures how long the
fastest contributor of recent syncs took per inner step (every contributor sends its own in
the sync's header: CommittedSync.step_seconds) and takes no inner step of a round that, as
long as its last, would end past `factor` times what the fastest needs for H steps (one step at
least): a live straggler arrives at the sync about when the others do, and its replicas' Δ_r
count by the steps they took (aggregators/weights.py). The fastest worker itself is never cut
short in a round no slower than its usual ones.

Not checkpointed: a worker that starts (or resumes) takes all H steps until its first sync
gives it a measurement.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from isoloco_ray.workers.quorum.seat import CommittedSync

# The recent syncs whose fastest contributor sets the budget (their median: one round slowed
# by a checkpoint or a hiccup moves it little).
WINDOW = 5


class StragglerDeadline:
    """A worker's deadline for its inner steps each round (see the module's docstring)."""

    # The fastest contributor's seconds per inner step in each of the last WINDOW syncs.
    fastest: deque[float]

    def __init__(self, factor: float, window: int = WINDOW) -> None:
        self.factor = factor
        self.fastest = deque(maxlen=window)

    def note(self, committed: CommittedSync) -> None:
        """Take a committed sync's measurements (the contributors' seconds per step)."""
        measured = [seconds for seconds in committed.step_seconds if seconds > 0]
        if measured:
            self.fastest.append(min(measured))

    def replica_budget(self, steps: int) -> float | None:
        """The seconds one replica's `steps` inner steps may take this round, or None (no
        measurement yet: no deadline)."""
        if not self.fastest:
            return None
        return self.factor * steps * statistics.median(self.fastest)

    def round_deadlines(self, steps: int, turns: int) -> list[float] | None:
        """At a round's start: for each of the `turns` replicas a worker runs one after
        another, the time.perf_counter() after which its inner steps stop (its budget and
        whatever the turns before it left of theirs), or None (no measurement yet)."""
        budget = self.replica_budget(steps)
        if budget is None:
            return None
        started = time.perf_counter()
        return [started + (turn + 1) * budget for turn in range(turns)]
