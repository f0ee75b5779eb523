"""The outer step: R pseudo-gradients in, one update of the global parameters out.

Each rank of the outer group hosts L = R / ranks replicas. One step (`OuterSync.step`), on
every rank:

1. which replicas are good (finite Δ_r and loss), agreed by all ranks;
2. the exchange (exchange.py, chosen once from the run's route): what this rank sends of its
   good replicas' Δ_r (their sum, or each one; pruned where hosted; error feedback), and what
   reaches it to merge: every payload (all-reduce, all-gather), or those of the tensors it owns;
3. the merge of what arrived (aggregators), then the outer momentum, which lives where the
   merge runs: with every rank, or only with the tensor's owner (as ZeRO-1 shards optimizer
   state);
4. the exchange again: each owner's updates to every rank (nothing, where every rank merged);
5. θ ← θ − lr·u for every tensor, so all ranks end bit-identical.

With a replica spread over G workers there are G outer groups, one per position within the
replicas, and each steps only its share of the tensors (plan.position_shares): the caller
then shares the new values within each replica (layout.ReplicaShard.share). Over a quorum
(scaling.fault_tolerance: replica), quorum/sync.py's QuorumSync sends the same payload through
the worker's seat and merges what the contributors sent, as `step` would have.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from isoloco_ray import aggregators
from isoloco_ray.aggregators.merge import implementation
from isoloco_ray.config import OuterConfig, settled
from isoloco_ray.strategies import OuterMerge, Route
from isoloco_ray.workers.outer.exchange import Exchange
from isoloco_ray.workers.outer.plan import OuterPlan, position_shares
from isoloco_ray.workers.outer.transport import Contributions
from isoloco_ray.workers.parallel.collectives import (
    Group,
    all_reduce_scalars,
    group_rank,
    group_size,
)


# The key prefix of an owner's update residual among a checkpoint's outer "buffers" (saved in
# the owner's outer momentum file, restored by the tensor's owner under the current plan).
UPDATE_RESIDUAL = "update_residual/"


@dataclass
class OuterStepStats:
    """Where one outer step's time went, what this rank received, and which replicas were left
    out (non-finite pseudo-gradient or inner loss)."""

    comm_seconds: float = 0.0
    merge_seconds: float = 0.0
    bytes_received: int = 0
    dropped: list[int] = field(default_factory=list)
    skipped: bool = False  # every replica was bad: no update this round
    # The training thread's seconds blocked on the sync: all of it, unless outer.delay hides
    # it behind inner steps.
    wait_seconds: float = 0.0

    def add(self, other: OuterStepStats) -> None:
        """Count `other` (another fragment's sync in the same round) in these figures."""
        self.comm_seconds += other.comm_seconds
        self.merge_seconds += other.merge_seconds
        self.bytes_received += other.bytes_received
        self.wait_seconds += other.wait_seconds
        self.dropped = sorted(set(self.dropped) | set(other.dropped))
        self.skipped = self.skipped or other.skipped


@contextmanager
def stopwatch(stats: OuterStepStats, field_name: str, device: torch.device) -> Iterator[None]:
    """Add the block's wall seconds to `stats.<field_name>`, counting the device's queued work
    (CUDA runs asynchronously: synchronize before reading the clock)."""
    def now() -> float:
        if device.type == "cuda":  # this thread's stream only: not a background sync's
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    started = now()
    yield
    setattr(stats, field_name, getattr(stats, field_name) + now() - started)


def outer_optimizer(outer: OuterConfig, orthogonalize_update: bool = False
                    ) -> aggregators.OuterOptimizer:
    """The outer optimizer of validated settings `outer` (its lr, momentum and Nesterov the
    strategy's where left unset)."""
    return aggregators.OuterOptimizer(
        lr=settled(outer.lr, "outer.lr"), momentum=settled(outer.momentum, "outer.momentum"),
        nesterov=settled(outer.nesterov, "outer.nesterov"),
        orthogonalize_update=orthogonalize_update)


class OuterSync:
    """Turns the hosted replicas' Δ_r into the global update; holds this rank's share of the
    outer optimizer state (momentum of the tensors it owns; all of them when replicated; with
    G positions, of its position's share only)."""

    optimizer: aggregators.OuterOptimizer

    def __init__(self, outer: OuterConfig, replicas: int, seed: int, group: Group = None,
                 positions: int = 1, position: int = 0) -> None:
        """`group`: the outer group (None: the default group); `positions`: G, the workers a
        replica is spread over, and `position` this worker's place among them."""
        self.outer = outer
        self.replicas = replicas
        self.group = group
        self.ranks, self.rank = group_size(group), group_rank(group)
        self.positions, self.position = positions, position
        if replicas % self.ranks:
            raise ValueError(f"{replicas} replicas cannot be spread evenly over an outer group "
                             f"of {self.ranks} ranks")
        self.hosted_per_rank = replicas // self.ranks
        self.resolved = OuterMerge.of(outer)
        self.merge = self.resolved.merge
        implementation(self.merge)  # a merge that cannot load fails here, not at round 1's end
        self.mean_only = self.resolved.of_mean  # the merge needs only the mean of the Δ_r
        self.route = Route.choose(outer, self.resolved)  # chosen once: strategies.Route
        self.exchange = Exchange.choose(outer, self.resolved, self.route, seed, group)
        self.optimizer = outer_optimizer(outer, self.resolved.orthogonalize_update)
        self._plans: dict[tuple[str, ...], OuterPlan] = {}
        self._shares: dict[tuple[str, ...], tuple[tuple[str, ...], ...]] = {}

    def shares(self, shapes: Mapping[str, torch.Size]) -> tuple[tuple[str, ...], ...]:
        """The tensors of `shapes` each position steps (plan.position_shares; all of them at
        position 0 when G = 1); built on first use, the same every round."""
        key = tuple(shapes)
        if key not in self._shares:
            self._shares[key] = position_shares(shapes, self.merge, self.replicas,
                                                self.positions,
                                                self.optimizer.orthogonalize_update)
        return self._shares[key]

    def plan(self, shapes: Mapping[str, torch.Size]) -> OuterPlan:
        """Owners of the tensors of `shapes` this position steps, of the whole model or one
        fragment of it (built on first use; the same every round)."""
        mine = self.shares(shapes)[self.position]
        if mine not in self._plans:
            self._plans[mine] = OuterPlan.build({name: shapes[name] for name in mine},
                                                self.merge, self.replicas, self.ranks,
                                                self.outer.placement,
                                                self.optimizer.orthogonalize_update)
        return self._plans[mine]

    def holds_momentum(self, name: str) -> bool:
        """Whether this rank keeps the momentum of tensor `name`."""
        if self.route.everyone_merges:
            return any(name in plan.owners for plan in self._plans.values())
        return any(plan.owners.get(name) == self.rank for plan in self._plans.values())

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state with the momentum buffers this rank holds and, among
        its "buffers" as UPDATE_RESIDUAL + name, the residuals of the updates it owns (owners
        on a chunked wire: exchange.OwnersMerge)."""
        state = self.optimizer.state_dict()
        state["buffers"].update({UPDATE_RESIDUAL + name: residual.detach().to("cpu", copy=True)
                                 for name, residual in self.exchange.residuals().items()})
        return state

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, torch.Size],
                        fragments: Sequence[Sequence[str]] | None = None) -> None:
        """Restore from a checkpoint's outer state whose "buffers" hold every saved buffer
        (all ranks' files together), keeping those this rank holds under the current plan of
        each of `fragments` (default: one, the whole model). Raises ValueError if momentum
        buffers are missing."""
        for names in fragments or [list(shapes)]:
            self.plan({name: shapes[name] for name in names})
        buffers = {name: buf for name, buf in state["buffers"].items()
                   if not name.startswith(UPDATE_RESIDUAL)}
        residuals = {name[len(UPDATE_RESIDUAL):]: buf for name, buf in state["buffers"].items()
                     if name.startswith(UPDATE_RESIDUAL)}
        if self.optimizer.momentum > 0 and state["step"] > 0:
            missing = sorted(set(shapes) - set(buffers))
            if missing:
                raise ValueError(f"the checkpoint lacks the outer momentum of {len(missing)} "
                                 f"tensors (e.g. {missing[0]!r}): a file is missing")
        self.optimizer.load_state_dict({**state, "buffers": {
            name: buf for name, buf in buffers.items() if self.holds_momentum(name)}})
        if self.exchange.keeps_residuals and state["step"] > 0 and not residuals:
            raise ValueError("the checkpoint lacks the owners' update residuals (outer "
                             "comm_dtype int2/int4 with owners): a file is missing")
        self.exchange.load_residuals({name: buf for name, buf in residuals.items()
                                      if self.holds_momentum(name)})  # what it owns now

    def step(self, global_params: dict[str, torch.Tensor],
             hosted: Mapping[int, Mapping[str, torch.Tensor]], round_index: int,
             diverged: Collection[int] = (),
             feedback: Mapping[int, dict[str, torch.Tensor]] | None = None,
             trained: Mapping[int, float] | None = None) -> OuterStepStats:
        """Apply one outer step to `global_params` in place from the hosted replicas' Δ_r
        (with G positions, to this position's share of them: see `shares`).

        Replicas in `diverged` (non-finite inner loss) or with a non-finite Δ_r are left out on
        every rank alike, and the merge uses the others (the mean divides by their number).
        With none left the round is skipped: parameters and momentum stay as they were.
        `feedback` (outer.error_feedback): each hosted replica's residual, added to its Δ_r
        before it is sent and replaced by what the transport loses of that (payload.py);
        a dropped replica's is kept as it was. `trained`: the share of the round each replica
        trained (partial rounds: aggregators/weights.py; none given, or all equal: a full
        round each), known alike on every rank.
        """
        stats = OuterStepStats()
        # Over every tensor of `hosted`, also those another position steps: the G outer
        # groups leave out the same replicas.
        good = self._good_replicas(hosted, diverged)
        stats.dropped = [r for r in range(self.replicas) if r not in good]
        if not good:
            stats.skipped = True
            return stats
        plan = self.plan({name: t.shape for name, t in global_params.items()})
        if self.positions > 1:  # this position's tensors only
            global_params = {name: global_params[name] for name in plan.owners}
            hosted = {r: {name: delta[name] for name in plan.owners}
                      for r, delta in hosted.items()}
            if not plan.owners:  # another position steps every tensor of this fragment
                self.optimizer.apply(global_params, {})  # counts the step, as they do
                return stats
        exchange, device = self.exchange, next(iter(global_params.values())).device
        with stopwatch(stats, "merge_seconds", device):  # what this rank sends of its Δ_r
            payload = exchange.pack(hosted, good, round_index, feedback, trained)
        with stopwatch(stats, "comm_seconds", device):  # what reaches it to merge
            arrived = exchange.send(payload, plan)
        with stopwatch(stats, "merge_seconds", device):  # residuals, merge, outer momentum
            exchange.settle(feedback, payload, arrived, hosted, good)
            updates = self._momentum_updates(self._merged(arrived, good, round_index, trained))
        with stopwatch(stats, "comm_seconds", device):  # every tensor's update, everywhere
            updates = exchange.bring_back(updates, global_params, plan)
        with stopwatch(stats, "merge_seconds", device):  # θ ← θ − lr·u
            self.optimizer.apply(global_params, updates)
        stats.bytes_received = exchange.take_bytes()
        return stats

    # -- what each rank contributes ------------------------------------------------------------

    @staticmethod
    def _finite_hosted(hosted: Mapping[int, Mapping[str, torch.Tensor]],
                       diverged: Collection[int]) -> list[int]:
        """The hosted replicas, ascending, whose Δ_r and loss are finite."""
        return sorted(replica for replica, delta in hosted.items() if replica not in diverged
                      and all(bool(torch.isfinite(t).all()) for t in delta.values()))

    def _good_replicas(self, hosted: Mapping[int, Mapping[str, torch.Tensor]],
                       diverged: Collection[int]) -> list[int]:
        """Indices of all replicas, on any rank, whose Δ_r and loss are finite."""
        flags = [0.0] * self.replicas
        for replica in self._finite_hosted(hosted, diverged):
            flags[replica] = 1.0
        device = next(iter(next(iter(hosted.values())).values())).device
        summed = all_reduce_scalars(flags, device, self.group)
        return [r for r, flag in enumerate(summed) if flag > 0.5]

    # -- merging -------------------------------------------------------------------------------

    def _merged(self, contributions: Contributions, good: Sequence[int], round_index: int,
                trained: Mapping[int, float] | None = None) -> dict[str, torch.Tensor]:
        """The merged direction of every tensor in `contributions`; each Δ_r weighted by the
        share of the round it `trained` (aggregators/weights.py; the sums were weighted by
        their senders: the mean divides by Σ f_r, which is the number of replicas when all
        are 1)."""
        weights = [1.0 if trained is None else trained.get(r, 1.0) for r in good]
        if self.route.sums:
            means = {}
            for name, sources in contributions.items():
                total = sources[0][0].to(torch.float32, copy=True)
                for source in sources[1:]:
                    total += source[0]
                means[name] = total / sum(weights)
            return self._merged_means(means)
        # Replica r is payload tensor r % L of rank r // L: ranks host contiguous replicas.
        per_rank = self.hosted_per_rank
        gathered = {name: aggregators.weighted(
                        [sources[r // per_rank][r % per_rank].float() for r in good], weights)
                    for name, sources in contributions.items()}
        if self.mean_only:  # every replica's (pruned) Δ_r came, not their sums
            means = {name: torch.stack(deltas).sum(dim=0) / len(good)
                     for name, deltas in gathered.items()}
            return self._merged_means(means)
        return self._merge_gathered(gathered, good, round_index)

    def _merged_means(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The merge of a strategy that needs only the mean Δ of each tensor."""
        if self.merge == "mean":
            return means
        return aggregators.merge_all(self.merge, {n: [m] for n, m in means.items()})

    def _momentum_updates(self, directions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outer update u of each tensor from its merged direction (momentum)."""
        return {name: self.optimizer.update(name, g) for name, g in directions.items()}

    def _merge_gathered(self, gathered: dict[str, list[torch.Tensor]], good: Sequence[int],
                        round_index: int) -> dict[str, torch.Tensor]:
        """The merge of every good replica's Δ_r (in replica order) of each tensor."""
        options = {key: self.outer.strategy_options[key] for key in self.resolved.options}
        if options.get("prune") == "random":
            # Each replica's mask from its own stream (see pruning_generator): tensor by tensor.
            return {name: aggregators.merge(
                self.merge, deltas, **options,
                generator=self.exchange.payloads.generators(round_index, good, name,
                                                            deltas[0].device))
                for name, deltas in gathered.items()}
        return aggregators.merge_all(self.merge, gathered, **options)
