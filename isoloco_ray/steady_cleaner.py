"""Ray Train 2.60's placement-group cleaner, asking the GCS whether the run's controller is
alive instead of the dashboard's state API.

Ray Train starts a detached `PlacementGroupCleaner` beside each run's controller: once the
controller is dead it removes the run's placement group. It asks the state API
(`ray.util.state.get_actor`), and takes an empty answer for a death. Under load, or with no
dashboard (a local `train` cluster has none), that API fails every second ("Failed to query
Ray Train Controller actor state"), and now and then answers empty: the cleaner then removes
the placement group of a live run, and every worker with it (measured in
benchmarks/soak.py's first runs: a replica-mode run lost all five workers at once and stopped
with no complete checkpoint). The GCS, which Ray's own actor bookkeeping uses, answers without
the dashboard and names a dead actor DEAD: `steady_trainer` builds a TorchTrainer whose
cleaner's liveness check asks it. Process-local patches of two module globals of Ray 2.60 (pinned in
pyproject.toml), made in the controller's and the cleaner's own processes only.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.execution.controller.placement_group_cleaner import (
    PlacementGroupCleaner,
)


def alive_in_gcs(actor_id: str, timeout: float = 0.0) -> bool:
    """Whether the GCS does not know actor `actor_id` (hex) as DEAD: an actor it has no
    record of is not taken for dead (the cleaner only acts on a death)."""
    import ray._private.state

    info = ray._private.state.actors(actor_id=actor_id)
    return not info or info.get("State") != "DEAD"


class SteadyPlacementGroupCleaner(PlacementGroupCleaner):
    """Ray's cleaner, whose liveness check asks the GCS (the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from ray.train.v2._internal.execution.controller import placement_group_cleaner

        placement_group_cleaner.is_actor_alive = alive_in_gcs  # this actor's process only
        super().__init__(*args, **kwargs)


class SteadyCleanerCallback(PlacementGroupCleanerCallback):
    """Ray's cleaner callback, launching `SteadyPlacementGroupCleaner`."""

    def after_controller_start(self, train_run_context: Any) -> None:
        from ray.train.v2._internal.callbacks import placement_group_callback

        # The controller's process only: the callback launches the cleaner class it names.
        placement_group_callback.PlacementGroupCleaner = SteadyPlacementGroupCleaner
        super().after_controller_start(train_run_context)


def steady_trainer(*args: Any, **kwargs: Any) -> Any:
    """A TorchTrainer (its arguments) whose placement-group cleaner asks the GCS (the
    module's docstring). TorchTrainer is imported here, not with the module, which the
    cleaner's process imports (it needs no torch)."""
    from ray.train.torch import TorchTrainer

    class SteadyTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            return [SteadyCleanerCallback() if type(callback) is PlacementGroupCleanerCallback
                    else callback for callback in super()._create_default_callbacks()]

    return SteadyTrainer(*args, **kwargs)
