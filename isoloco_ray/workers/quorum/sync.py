"""The outer step over a quorum (scaling.fault_tolerance: replica): the workers alive this
round, whoever they are, instead of a fixed outer group.

`QuorumSync` is an OuterSync whose payloads travel through the worker's quorum seat
(workers/quorum/seat.py) instead of the outer group's collectives: each worker packs the payload
`OuterSync.step` would send (its exchange's `pack`, as one flat tensor on the wire), the seat
all-gathers the contributors' payloads, and every participant merges them exactly as `step`
merges the replicas it has (placement replicated: every worker merges every tensor). The plain
outer step (step.py) knows nothing of quorums.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from isoloco_ray.config import OuterConfig
from isoloco_ray.strategies import OuterMerge, Route
from isoloco_ray.workers.outer.codec import codec_for, wire_bytes
from isoloco_ray.workers.outer.step import OuterStepStats, OuterSync, stopwatch
from isoloco_ray.workers.outer.transport import Contributions
from isoloco_ray.workers.quorum.seat import CommittedSync, Contribution, QuorumSeat


def quorum_numel(outer: OuterConfig, shapes: Sequence[torch.Size], hosted_per_worker: int
                 ) -> int:
    """The length of one worker's payload to the quorum (QuorumSeat's `numel`) with the outer
    settings `outer` (as the quorum runs them: OuterConfig.quorum_outer) and a model of
    parameters of `shapes`: float32 elements of its sum or of each of its `hosted_per_worker`
    replicas' Δ_r, or on a lossy wire the codec's bytes of them in whole float32 words
    (Exchange.to_quorum_wire)."""
    copies = 1 if Route.choose(outer, OuterMerge.of(outer)).sums else hosted_per_worker
    if not outer.lossy_wire:
        return copies * sum(shape.numel() for shape in shapes)
    return -(-copies * wire_bytes(codec_for(outer.comm_dtype, outer.topk), shapes) // 4)


class QuorumSync(OuterSync):
    """The outer step of a worker with a quorum seat: `quorum_step` (`step`, over a fixed
    outer group, is the one-process reference it is tested against)."""

    def __init__(self, outer: OuterConfig, replicas: int, seed: int) -> None:
        """`outer`: the run's settings; the quorum runs them with placement replicated
        (OuterConfig.quorum_outer: every worker merges what the quorum gathered)."""
        super().__init__(outer.quorum_outer(), replicas, seed)

    def quorum_step(self, global_params: dict[str, torch.Tensor],
                    hosted: Mapping[int, Mapping[str, torch.Tensor]], round_index: int,
                    seat: QuorumSeat, diverged: Collection[int] = (),
                    losses: Mapping[int, float] | None = None, waiting: bool = False,
                    joining: bool = False, trained: Mapping[int, float] | None = None,
                    step_seconds: float = 0.0,
                    feedback: Mapping[int, dict[str, torch.Tensor]] | None = None
                    ) -> tuple[OuterStepStats, CommittedSync]:
        """The outer step over the workers alive this round (scaling.fault_tolerance:
        replica). This worker's payload goes to the round's quorum (quorum/seat.py): the sum of its
        good hosted Δ_r when the merge needs only their mean, else each hosted Δ_r (pruned
        where hosted, as `step` sends them). Every participant then merges what the
        contributors sent, in rank order, exactly as `step` merges the replicas it has: the
        mean divides by the good replicas in it, a per-replica merge gets their Δ_r in replica
        order, and the replicas of a worker that sent nothing are left out like diverged ones.
        `losses` (each hosted replica's mean inner loss) are summed over the good ones into
        the quorum's loss sum; `waiting`, `joining`: see QuorumSeat.sync; `trained`: the share
        of the round each hosted replica trained (partial rounds, aggregators/weights.py: the
        merge weights every contributor's Δ_r by the shares all of them sent),
        `step_seconds` this worker's seconds per inner step (both into the sync's header).
        `global_params` and
        the outer state may be replaced by a peer's inside the sync (this worker was behind: it
        brings no Δ), and the merge is keyed by the sync's round (CommittedSync.round), which
        is `round_index` only on a worker that was not behind. On a lossy wire (outer.comm_dtype,
        outer.topk) each payload travels as the codec's bytes and every participant merges the
        decoded ones, as `step` does; `feedback` (outer.error_feedback): the hosted replicas'
        residuals, as for `step` (a replacement's replicas start without one)."""
        stats = OuterStepStats()
        device = next(iter(global_params.values())).device
        names = list(global_params)
        good = self._finite_hosted(hosted, diverged)
        contribution = None
        if good:
            with stopwatch(stats, "merge_seconds", device):
                payload = self.exchange.pack(hosted, good, round_index, feedback, trained)
                flat = self.exchange.to_quorum_wire(payload, names)
                self.exchange.settle_from_quorum_wire(feedback, payload, flat, names, hosted,
                                                      good)
            contribution = Contribution(
                flat, good, sum((losses or {}).get(r, 0.0) for r in good),
                shares={r: (trained or {}).get(r, 1.0) for r in good},
                step_seconds=step_seconds)
        with stopwatch(stats, "comm_seconds", device):
            committed = seat.sync(contribution, waiting, joining, round_index)
        stats.dropped = [r for r in range(self.replicas) if r not in committed.good]
        # The other participants' payloads (the all-gather; headers are a few bytes).
        stats.bytes_received = (len(committed.participants) - 1) * 4 * seat.numel
        if not committed.good:
            stats.skipped = True
            return stats, committed
        with stopwatch(stats, "merge_seconds", device):
            hosted_per_worker = seat.replicas // seat.workers
            arrived = self._quorum_contributions(committed, global_params, hosted_per_worker)
            directions = self._merged(arrived, committed.good, committed.round,
                                      committed.shares)
            self.optimizer.apply(global_params, self._momentum_updates(directions))
        return stats, committed

    def _quorum_contributions(self, committed: CommittedSync,
                              global_params: Mapping[str, torch.Tensor],
                              hosted_per_worker: int) -> Contributions:
        """The committed payloads as `_merged` takes them. Sums: each contributor is a
        source that sent one sum per tensor, in rank order. Each Δ_r: one source holding
        every replica's (this group has one rank), worker w's V payloads as replicas
        wV … wV+V−1 (the layout); only the good ones are read."""
        names = list(global_params)
        shapes = [global_params[name].shape for name in names]
        copies = 1 if self.route.sums else hosted_per_worker
        received: list[dict[str, torch.Tensor]] = []  # rank order; each rank's copies in order
        for payload in committed.payloads:
            tensors = self.exchange.from_quorum_wire(payload, shapes * copies)
            received += [dict(zip(names, tensors[copy * len(names):(copy + 1) * len(names)]))
                         for copy in range(copies)]
        if self.route.sums:
            return {name: [[parts[name]] for parts in received] for name in names}
        slots: list[dict[str, torch.Tensor]] = [{} for _ in range(self.replicas)]
        for index, parts in enumerate(received):
            rank, copy = committed.contributors[index // copies], index % copies
            slots[rank * copies + copy] = parts
        return {name: [[slot.get(name) for slot in slots]]  # type: ignore[misc]
                for name in names}
