"""The one way a worker's state goes into a checkpoint and comes back (torchtitan's
CheckpointManager): the parts of the state, the file each part goes to, and which worker writes
which file (`Roles`). checkpoint.py holds the files' formats, what a stored checkpoint needs
to be complete (`needed_files`) and the checks of a checkpoint read back.

    part of the state                  file                       written by
    counters, config, round's record   state.json                 the writer (`Roles.shared`):
    outer optimizer's step, settings   state.json "outer"         rank 0; over a quorum the
    θ, the global parameters           global.safetensors         last sync's writer
    adamw_ddp's AdamW and schedule     data_parallel.pt
    outer momentum buffers             outer_NNNN.safetensors     `Roles.momentum_file`
    replica r: AdamW, schedule,        replica_NNNN.pt            its host, the first of its
      stream, residual (θ_r streaming)                            G workers (they hold it alike)

Every part is an object with `state_dict` and `load_state_dict` (the counters through
`AttributeState`); the replicas' and the outer optimizer's load also take what the rest of
the restored state decides for them (θ, and the tensors each rank holds momentum of).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from isoloco_ray.config import TrainConfig, config_differences
from isoloco_ray.workers.outer.step import OuterSync
from isoloco_ray.workers.parallel.layout import WorkerLayout
from isoloco_ray.workers.replica import Replica
from isoloco_ray.workers.rounds.round_metrics import Metrics
from isoloco_ray.workers.state import checkpoint


class Stateful(Protocol):
    """A part of the state a checkpoint holds (torch.distributed.checkpoint's Stateful)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class AttributeState:
    """Named attributes of an object as a Stateful part: the Trainer's counters
    (checkpoint.COUNTERS), which it keeps as attributes declared at its top."""

    def __init__(self, owner: object, names: Collection[str]) -> None:
        self.owner, self.names = owner, tuple(names)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.owner, name) for name in self.names}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in self.names:
            setattr(self.owner, name, state[name])


@dataclass(frozen=True)
class Roles:
    """Which files of a checkpoint one worker writes. Over every worker of a run the files
    written are all a checkpoint needs, each by one worker (tests/workers/test_checkpoint.py
    checks every layout)."""

    shared: bool  # state.json, global.safetensors and data_parallel.pt: held alike by all
    momentum_file: int | None  # the number of the outer momentum file it writes, or None
    replicas: tuple[int, ...]  # the replicas whose files it writes

    @classmethod
    def in_group(cls, layout: WorkerLayout, everyone_merges: bool) -> Roles:
        """A worker's roles in a run over a fixed group of ranks (`restart` mode): rank 0
        writes the shared files; in each of the G outer groups (the workers at one position
        of every replica) the worker of the first replica writes the momentum of that
        position's tensors when every worker holds all of it (everyone merges), else each
        worker its own share; a replica's first worker writes its file. Momentum file NNNN is
        the writer's rank: unique."""
        outer_rank = layout.rank // layout.workers_per_replica  # its rank in its outer group
        momentum = outer_rank == 0 or not everyone_merges
        return cls(shared=layout.rank == 0, momentum_file=layout.rank if momentum else None,
                   replicas=tuple(layout.hosted) if layout.saves_replicas else ())

    @classmethod
    def over_quorum(cls, writer: bool, hosted: Sequence[int]) -> Roles:
        """A seated worker's roles (`replica` mode): the sync's writer writes what every
        worker holds alike, the outer momentum (every worker holds all of it) included; every
        worker in the sync writes its replicas' files."""
        return cls(shared=writer, momentum_file=0 if writer else None, replicas=tuple(hosted))


class CheckpointManager:
    """Writes a worker's part of a checkpoint (`save`) and restores the whole of one
    (`restore`). The parts, declared here, are the Trainer's own objects: restoring one
    changes the Trainer's state in place."""

    counters: Stateful  # round, eval losses, seconds, bytes, bad rounds (checkpoint.COUNTERS)
    global_params: dict[str, torch.Tensor]  # θ: loaded in place (the runner holds the dict)
    outer: OuterSync  # step and settings (state.json), momentum buffers (outer files)
    replicas: list[Replica]  # the hosted replicas
    runner: Stateful | None  # adamw_ddp's AdamW and schedule; None for DiLoCo's rounds

    def __init__(self, cfg: TrainConfig, counters: Stateful,
                 global_params: dict[str, torch.Tensor], outer: OuterSync,
                 replicas: list[Replica], runner: Stateful | None,
                 fragments: Sequence[Sequence[str]]) -> None:
        self.cfg = cfg
        self.counters, self.global_params, self.outer = counters, global_params, outer
        self.replicas, self.runner = replicas, runner
        self.fragments = fragments  # the tensors synced together: they decide momentum owners

    def save(self, directory: Path, roles: Roles, record: Metrics | None = None) -> None:
        """Write the files of a checkpoint of the state now that `roles` gives this worker;
        `record`: the round's metrics line, kept with it (checkpoint.saved_record)."""
        outer_state = self.outer.state_dict()
        if roles.shared:
            checkpoint.save_shared(directory, self.global_params, outer_state,
                                   {**self.counters.state_dict(),
                                    "config": self.cfg.model_dump(mode="json"),
                                    "record": record})
            if self.runner is not None:
                checkpoint.save_data_parallel(directory, self.runner.state_dict())
        if roles.momentum_file is not None:
            checkpoint.save_outer_momentum(directory, roles.momentum_file,
                                           outer_state["buffers"])
        for replica in self.replicas:
            if replica.index in roles.replicas:
                checkpoint.save_replica(directory, replica.index, replica.state_dict())

    def restore(self, directory: Path) -> None:
        """Continue from the checkpoint in `directory` exactly where the saved run stood.
        Raises checkpoint.CheckpointError, naming the files, for a damaged checkpoint (every
        file is checked first: never half-restored) or one written with other settings."""
        problems = checkpoint.checkpoint_problems(directory)
        if problems:
            raise checkpoint.CheckpointError(checkpoint.damage_report(directory, problems))
        params, outer_state, state = checkpoint.load_shared(directory)
        differing = config_differences(state["config"], self.cfg)
        if differing:
            raise checkpoint.CheckpointError(
                f"the checkpoint in {directory} was written with different settings: "
                f"{', '.join(differing)}; resume with the same configuration or use a new "
                "run.name")
        with torch.no_grad():
            for name, tensor in self.global_params.items():
                tensor.copy_(params[name])
        shapes = {name: tensor.shape for name, tensor in self.global_params.items()}
        self.outer.load_state_dict(outer_state, shapes, self.fragments)
        self.counters.load_state_dict(
            checkpoint.read_counters(state, directory / checkpoint.STATE_FILE))
        rejoining = checkpoint.rejoining_replicas(directory, state)
        steps_done = state["round"] * self.cfg.inner.steps
        for replica in self.replicas:
            if replica.index in rejoining:
                # Its worker missed the round: it goes on as it would once healed or replaced.
                replica.rejoin(steps_done, self.global_params)
            else:
                replica.load_state_dict(checkpoint.load_replica(directory, replica.index),
                                        self.global_params)
        if self.runner is not None:
            self.runner.load_state_dict(checkpoint.load_data_parallel(directory))
