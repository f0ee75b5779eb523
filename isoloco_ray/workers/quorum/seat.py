"""One worker's seat in a torchft quorum: the outer sync of `scaling.fault_tolerance: replica`
(issue 36, stage 1), where a lost worker costs its own round and not the run's.

Once per outer round every live worker (one torchft replica group each) calls `QuorumSeat.sync`
with its contribution: the sum of its good hosted replicas' pseudo-gradients (the all-reduce
route of the mean-only strategies) and their mean losses, or nothing (a worker that has just
joined). The seat

1. joins the round's quorum (`Manager.start_quorum`): the workers the lighthouse sees; a worker
   whose state is behind is healed there from a peer (θ, outer momentum, counters: whatever the
   `state_dict` callback returns), and a healed worker contributes nothing to this sync;
2. exchanges one header row per worker (rank, whether it brings a Δ, its good replicas, its
   loss sum, a fingerprint of its global parameters, its round, whether it is joining) by a
   float64 sum in which each row is non-zero only in its own slot, so the sum is exact and the
   same on every worker; workers whose parameters or rounds differ stop the run, all of them
   (they would merge into different models). Fingerprint and round are read after healing, so
   the round is the sync's own on every participant, whatever round a worker that fell behind
   was at: everything keyed by round (random masks) uses it;
3. gathers every worker's payload (an all-gather, not a sum: gloo would add in an order of its
   own, which a plain reference loop could not reproduce; each worker adds the contributors'
   payloads in rank order instead);
4. votes: a one-number sum over the quorum of whether each participant got every payload,
   and commits only if that sum is complete and counts everyone (then `Manager.should_commit`).
   torchft decides `should_commit` per replica group, that is per worker here, so without the
   vote a collective that failed on one survivor only would let the others commit a round it
   drops: with 5 or more workers, a majority of such survivors could then commit the round
   again without them, into another θ. A failure in steps 1-4 (a peer died, or one worker
   missed a payload) makes the vote fail or fall short on every survivor: each starts a new
   quorum with the survivors and the same contribution, so no inner step is redone. Only a
   peer lost inside the vote itself, a few bytes long, can still split the decision; then the
   workers that committed are a step ahead and heal the others at the next quorum, and
   workers that committed different θ at the same step meet the fingerprint check there.

Workers joining at a start sync with no Δ, again and again while each of them would rather
wait for workers still missing (`again`); those repeats are not committed, and the sync that
ends the wait is. So every worker that took part in the run's start has torchft step ≥ 1, and
one that comes later (a replacement) has step 0: torchft always heals it from a peer, which
is why a replacement never reads the state from storage (replica_mode.py).

Bounded everywhere: a collective waits at most `timeout`, a quorum at most `quorum_timeout`,
a sync at most `max_attempts` quorums; torchft raises past those.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from isoloco_ray.local_ray import is_loopback, loopback_store
from isoloco_ray.workers.agreement import TrainingStopped

# rank, brings a Δ (0/1), loss sum, waits for the others (0/1), the parameters' fingerprint
# (two 48-bit parts, exact in float64), the round, joining (0/1), seconds per inner step; then
# per replica the share of the round it trained (0: not in the payload; aggregators/weights.py),
# then why this worker stops the run (UTF-8 bytes, zero-padded; all zero: it does not)
HEADER_FIELDS = 9
ROUND, JOINING, STEP_SECONDS = 6, 7, 8
STOP_BYTES = 512
FINGERPRINT_DIGITS = 12  # hex digits per part


class QuorumError(RuntimeError):
    """The sync could not be committed in `max_attempts` quorums; the message says why."""


class WorkersDiffer(TrainingStopped):
    """The quorum's workers hold different global parameters: every one of them stops."""


@dataclass
class Contribution:
    """What one worker brings to a round's sync."""

    payload: torch.Tensor  # flat float32: Σ of its good hosted replicas' Δ_r, model order
    good: Sequence[int]  # the replicas (run-wide indices) whose Δ_r are in `payload`
    loss_sum: float  # Σ of those replicas' mean inner losses
    # The share of the round each of `good` trained (h_r / H), 1.0 where not given.
    shares: Mapping[int, float] = field(default_factory=dict)
    # This worker's wall seconds per inner step this round (0.0: not measured).
    step_seconds: float = 0.0


@dataclass
class CommittedSync:
    """A committed sync, the same on every participant."""

    participants: list[int]  # worker ranks in the quorum, ascending
    contributors: list[int]  # those that brought a Δ, ascending
    payloads: list[torch.Tensor]  # the contributors' payloads, in rank order
    # The replicas whose Δ_r are in the payloads, ascending, each with the share of the round
    # it trained (h_r / H).
    shares: dict[int, float]
    loss_sum: float  # Σ over the contributors' loss sums
    attempts: int  # quorums it took (1 when nobody failed)
    # The round every participant is at once healed: the sync's.
    round: int = 0
    # Participants syncing from SeatedTrainer.join: they took no inner steps of the round (a
    # replacement, or every worker at a start) and do not record it.
    joining: list[int] = field(default_factory=list)
    quorum_seconds: float = 0.0  # waiting for the quorums (and healing), all attempts
    committed_at: float = 0.0  # Unix time at which this worker saw the sync committed
    healed: bool = False  # this worker's state came from a peer in this sync
    # The contributors' seconds per inner step this round (rank order; 0.0: not measured).
    step_seconds: list[float] = field(default_factory=list)
    # A join without a Δ, not committed, in which every participant would rather wait for
    # the workers missing: sync again.
    again: bool = False

    @property
    def good(self) -> list[int]:
        """The replicas whose Δ_r are in the payloads, ascending."""
        return sorted(self.shares)

    @property
    def writer(self) -> int:
        """The worker that records this round (progress, a checkpoint's shared files, the
        run's result): the lowest rank of those that took the round, not a worker that only
        joined in it (it neither reports nor evaluates the round); at a start, the lowest."""
        took = [rank for rank in self.participants if rank not in self.joining]
        return (took or self.participants)[0]

    @property
    def round_taken(self) -> bool:
        """Whether some participant took the round's inner steps (not a start's join)."""
        return len(self.joining) < len(self.participants)


class QuorumSeat:
    """A worker's torchft Manager, used once per outer round (see the module's docstring).

    `state_dict` / `load_state_dict` give and take what a worker that fell behind needs to go
    on (torchft calls them while healing); `numel` is the payload's length; `fingerprint`
    gives a hex digest of the worker's global parameters (checkpoint.parameters_checksum),
    `current_round` the round it is at (Trainer.round): both read after healing and compared
    across the quorum in every sync."""

    def __init__(self, rank: int, workers: int, replicas: int, numel: int,
                 lighthouse_addr: str,
                 state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None], *,
                 min_workers: int, timeout: timedelta, quorum_timeout: timedelta,
                 host: str = "127.0.0.1", max_attempts: int = 5,
                 fingerprint: Callable[[], str] | None = None,
                 current_round: Callable[[], int] | None = None) -> None:
        from torch.distributed import TCPStore
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.rank, self.workers, self.replicas, self.numel = rank, workers, replicas, numel
        self.max_attempts = max_attempts
        self.fingerprint = fingerprint
        self.current_round = current_round
        self._healed = False

        def load(state: dict[str, Any]) -> None:
            self._healed = True
            load_state_dict(state)

        # The replica group's own rendezvous store (one worker per group), on `host` only
        # when that is loopback (TCPStore would listen on every interface).
        self._store = (loopback_store(host, wait_for_workers=False) if is_loopback(host)
                       else TCPStore(host, 0, is_master=True, wait_for_workers=False))
        self._pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self._pg, load_state_dict=load, state_dict=state_dict,
            min_replica_size=min_workers, use_async_quorum=False, timeout=timeout,
            quorum_timeout=quorum_timeout, rank=0, world_size=1, store_addr=host,
            store_port=self._store.port, lighthouse_addr=lighthouse_addr,
            # torchft appends ":<uuid>" to the id: a replacement is a new member.
            replica_id=f"isoloco-{rank:04d}", hostname=host,
            # θ starts alike everywhere (seeded): only a worker behind the others heals.
            init_sync=False,
            # Healing sends tensors over the group itself: no HTTP listener.
            checkpoint_transport=PGTransport(self._pg, timeout=timeout,
                                             device=torch.device("cpu")))

    def sync(self, contribution: Contribution | None, waiting: bool = False,
             joining: bool = False, round_index: int = 0,
             stopping: str | None = None) -> CommittedSync:
        """Run quorums until one commits this round's sync (see the module's docstring);
        `round_index`: the round this worker is at, where the seat has no `current_round`;
        `stopping`: why this worker stops the run (a data error): every participant then
        raises TrainingStopped with the lowest such worker's reason (as the workers of
        `restart` mode stop together), and nothing is committed;
        `joining`: this worker syncs from SeatedTrainer.join (it took none of the round's steps);
        `waiting`: this worker, joining, would rather sync again once the workers missing
        are there (CommittedSync.again: every participant would, and some are missing). Raises
        QuorumError after `max_attempts` quorums that could not commit, and torchft's
        TimeoutError when no quorum forms within `quorum_timeout`."""
        healed, waited = False, 0.0
        for attempt in range(1, self.max_attempts + 1):
            self._healed = False
            started = time.perf_counter()
            self.manager.start_quorum()
            waited += time.perf_counter() - started
            if self._healed:  # behind the others: its Δ was computed from another θ
                healed, contribution = True, None
            result = self._exchange(contribution, waiting, joining, round_index, stopping)
            if result is not None and result.again:
                result.attempts, result.healed, result.quorum_seconds = attempt, healed, waited
                return result  # to be repeated: not a step of torchft's
            if self.manager.should_commit():
                assert result is not None  # a committed exchange completed
                result.attempts, result.healed, result.quorum_seconds = attempt, healed, waited
                result.committed_at = time.time()
                return result
        raise QuorumError(f"worker {self.rank}: the outer sync was not committed in "
                          f"{self.max_attempts} quorums (workers kept failing during it)")

    def _exchange(self, contribution: Contribution | None, waiting: bool, joining: bool,
                  round_index: int, stopping: str | None) -> CommittedSync | None:
        """Headers, then payloads, through the quorum's process group; None when a collective
        failed (the Manager has recorded the error: should_commit is then False)."""
        from torchft.process_group import ReduceOp

        size, slot = self.manager.num_participants(), self.manager.participating_rank()
        assert slot is not None  # use_async_quorum=False: every member participates
        flags = HEADER_FIELDS + self.replicas  # where the stop message starts
        header = torch.zeros(size, flags + STOP_BYTES, dtype=torch.float64)
        if stopping:
            encoded = stopping.encode()[:STOP_BYTES]
            header[slot, flags:flags + len(encoded)] = torch.tensor(list(encoded),
                                                                    dtype=torch.float64)
        header[slot, 0] = self.rank
        header[slot, 3] = float(waiting)
        header[slot, JOINING] = float(joining)
        # After healing: a healed worker is at its peer's round.
        header[slot, ROUND] = (round_index if self.current_round is None
                               else self.current_round())
        if self.fingerprint is not None:  # after healing: a healed worker holds its peer's
            digest = self.fingerprint()
            header[slot, 4:6] = torch.tensor(
                [int(digest[i:i + FINGERPRINT_DIGITS], 16)
                 for i in (0, FINGERPRINT_DIGITS)], dtype=torch.float64)
        if contribution is not None:
            header[slot, 1] = 1.0
            header[slot, 2] = contribution.loss_sum
            header[slot, STEP_SECONDS] = contribution.step_seconds
            for replica in contribution.good:
                header[slot, HEADER_FIELDS + replica] = contribution.shares.get(replica, 1.0)
        self.manager.allreduce(header, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        ranks = [int(row[0]) for row in header]
        for _, row in sorted(zip(ranks, header), key=lambda pair: pair[0]):  # lowest first
            if row[flags:].any():
                raise TrainingStopped(bytes(int(b) for b in row[flags:] if b > 0)
                                      .decode(errors="replace"))
        prints = {rank: tuple(int(v) for v in row[4:6]) for rank, row in zip(ranks, header)}
        if self.fingerprint is not None and len(set(prints.values())) > 1:
            raise WorkersDiffer(
                "the workers' global parameters differ (fingerprints by rank: "
                + ", ".join(f"{rank}: {a:012x}{b:012x}" for rank, (a, b) in sorted(prints.items()))
                + "); the outer sync is not deterministic here")
        rounds = {rank: int(row[ROUND]) for rank, row in zip(ranks, header)}
        if len(set(rounds.values())) > 1:
            raise WorkersDiffer(
                "the workers are at different rounds (by rank: "
                + ", ".join(f"{rank}: {value}" for rank, value in sorted(rounds.items()))
                + "); a worker behind the others should have been healed")
        brings = [bool(row[1] > 0.5) for row in header]
        payload = (contribution.payload if contribution is not None
                   else torch.zeros(self.numel, dtype=torch.float32))
        gathered = self._all_gather(payload, size)
        if not self._everyone_got_everything(gathered is not None, size) or gathered is None:
            return None
        order = sorted(range(size), key=lambda i: ranks[i])
        contributors = [i for i in order if brings[i]]
        # A replica is one contributor's: its column holds that one's share, zeros elsewhere.
        shares = (header[contributors, HEADER_FIELDS:flags].sum(dim=0).tolist()
                  if contributors else [0.0] * self.replicas)
        return CommittedSync(
            participants=[ranks[i] for i in order],
            contributors=[ranks[i] for i in contributors],
            payloads=[gathered[i] for i in contributors],
            shares={r: shares[r] for r in range(self.replicas) if shares[r] > 0},
            step_seconds=[float(header[i, STEP_SECONDS]) for i in contributors],
            loss_sum=float(sum(header[i, 2] for i in contributors)),
            attempts=0, round=rounds[ranks[0]],
            joining=[ranks[i] for i in order if header[i, JOINING] > 0.5],
            again=(not contributors and bool((header[:, 3] > 0.5).all())
                               and size < self.workers))

    def _all_gather(self, payload: torch.Tensor, size: int) -> list[torch.Tensor] | None:
        """Every participant's payload, by slot; None when the collective failed."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        outputs = [torch.empty_like(payload) for _ in range(size)]
        work = self._pg.allgather([outputs], [payload], AllgatherOptions())
        self.manager.wrap_future(work.get_future(), default=None).wait()
        return None if self.manager.errored() is not None else outputs

    def _everyone_got_everything(self, got: bool, size: int) -> bool:
        """The commit vote (step 4 of the module's docstring): whether every participant got
        every payload. Through the process group itself, not the Manager, which skips its
        collectives once errored: a participant that missed a payload still votes, so the
        others learn it at once instead of after `timeout`. False has the Manager record why,
        so that `should_commit` is False on every participant."""
        from torch.distributed.distributed_c10d import AllreduceOptions
        from torchft.process_group import ReduceOp

        vote = torch.tensor([float(got)], dtype=torch.float64)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        try:
            work = self._pg.allreduce([vote], options)
        except Exception as exc:  # noqa: BLE001 - recorded: the sync is not committed
            self.manager.report_error(exc)
            return False
        if self.manager.wrap_future(work.get_future(), default=None).wait() is None:
            return False  # the vote failed here (a peer lost): recorded by wrap_future
        if int(vote.item()) != size:
            if self.manager.errored() is None:
                self.manager.report_error(RuntimeError(
                    f"{size - int(vote.item())} participant(s) of the quorum missed a payload"))
            return False
        return True

    def shutdown(self) -> None:
        """Leave: stop heartbeats and the Manager's server, and drop the process group, whose
        connections then close, so that peers inside a collective with this worker mostly
        fail at once rather than after `timeout` (survivors go on without it)."""
        self.manager.shutdown(wait=False)
        self._pg.abort(errored=False)
