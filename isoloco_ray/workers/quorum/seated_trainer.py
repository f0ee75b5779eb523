"""The Trainer of a worker with a quorum seat (scaling.fault_tolerance: replica).

The plain Trainer (loop.py) over a quorum instead of a fixed group of ranks: its outer step is
QuorumSync, its rounds QuorumRounds; it joins the quorum before its first round; the last
sync's writer (not rank 0, which may be gone) writes what every worker holds alike; it takes
part in no collective of its own (it scores the whole eval set, checks its own checkpoint
files); and it hands its state to a peer that fell behind, or takes a peer's (`quorum_state`,
`load_quorum_state`: the seat's healing callbacks, replica_mode.seated_trainer).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from isoloco_ray.workers.loop import Trainer
from isoloco_ray.workers.outer.step import OuterSync
from isoloco_ray.workers.quorum.rounds import QuorumRounds
from isoloco_ray.workers.quorum.sync import QuorumSync
from isoloco_ray.workers.rounds.data_parallel import DataParallelRounds
from isoloco_ray.workers.rounds.diloco import DiLoCoRounds
from isoloco_ray.workers.rounds.round_parts import RoundParts
from isoloco_ray.workers.state.checkpoint_manager import Roles

# How long the workers at a (re)start wait for each other before the first round goes on with
# those there (the others join later), and how often they look.
JOIN_WAIT_S = 60.0
JOIN_POLL_S = 0.2


class SeatedTrainer(Trainer):
    """A Trainer whose outer syncs go through its worker's quorum seat (env.seat)."""

    joined: bool  # whether `join` ran (not state: each process joins)
    syncs_through_seat = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.joined = False
        super().__init__(*args, **kwargs)

    def _outer_sync(self) -> OuterSync:
        return QuorumSync(self.cfg.outer, self.cfg.scaling.replicas, self.cfg.run.seed)

    def _round_runner(self, parts: RoundParts) -> DiLoCoRounds | DataParallelRounds:
        return QuorumRounds(parts)

    def writes_run_files(self) -> bool:
        """The last sync's writer (CommittedSync.writer: rank 0 may be gone)."""
        committed = self.runner.committed
        return committed is not None and committed.writer == self.env.rank

    def roles(self) -> Roles:
        """The writer writes the shared files and the momentum; every worker its replicas'."""
        return Roles.over_quorum(self.writes_run_files(), self.layout.hosted)

    def _collective_share(self) -> tuple[int, int]:
        """0 of 1: its peers may be gone, so it scores the whole eval set and checks its own
        checkpoint files."""
        return 0, 1

    def _before_rounds(self) -> None:
        if not self.joined:
            self.join()

    def quorum_state(self) -> dict[str, Any]:
        """What a peer that fell behind takes from this worker when torchft heals it: θ, the
        outer optimizer's state and the run's counters (replicas are not sent: `join`)."""
        return {"global": self.global_params, "outer": self.outer.state_dict(),
                "counters": self.checkpoints.counters.state_dict()}

    def load_quorum_state(self, state: dict[str, Any]) -> None:
        """Take a peer's `quorum_state`, θ copied into this worker's own tensors."""
        with torch.no_grad():
            for name, tensor in self.global_params.items():
                tensor.copy_(state["global"][name])
        self.outer.load_state_dict(state["outer"], {n: t.shape for n, t in
                                                    self.global_params.items()}, self.fragments)
        self.checkpoints.counters.load_state_dict(state["counters"])

    def join(self) -> bool:
        """A worker's first sync, with no Δ; returns whether the run is starting here (every
        worker in the sync is new: resume from storage, if at all, now).

        At a (re)start every worker's: repeated, for up to JOIN_WAIT_S, until every worker is
        in it, so that all take the first round (quorum/seat.py: the repeats apply nothing). For a
        worker that replaces a lost one (or starts late), the others' next sync, where it is
        healed (`load_quorum_state`, their state before that sync) and applies the committed
        update with them; its replicas then go on from θ as if they had taken the rounds so
        far (Replica.rejoin). The others record that round (CommittedSync.writer); if it is a
        checkpoint round this worker adds its replicas' files to the checkpoint, so that it is
        complete."""
        assert isinstance(self.runner, QuorumRounds) and isinstance(self.outer, QuorumSync)
        assert self.env.seat is not None
        deadline = time.monotonic() + JOIN_WAIT_S
        while True:
            _, committed = self.outer.quorum_step(self.global_params, {}, self.round,
                                                  self.env.seat, joining=True,
                                                  waiting=time.monotonic() < deadline)
            if not committed.again:
                break
            time.sleep(JOIN_POLL_S)
        self.joined = True
        self.runner.committed = committed
        if committed.round_taken:  # the others' round, completed here too
            self.round = committed.round + 1
        if committed.round_taken or committed.healed:
            for replica in self.replicas:
                replica.rejoin(self.round * self.cfg.inner.steps, self.global_params)
        if committed.round_taken and self._checkpoint_round():
            with tempfile.TemporaryDirectory() as directory:
                self.save(Path(directory))  # its replicas' files: it is not the writer
                self.env.report({"round": self.round}, Path(directory), False)
        return not (committed.healed or committed.round_taken)
