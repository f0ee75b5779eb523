"""steady_cleaner.py: Ray Train's placement-group cleaner asks the GCS whether the run's
controller is alive, never the dashboard's state API (whose empty answers under load made it
remove a live run's placement group and every worker: benchmarks/soak.py)."""

from __future__ import annotations

import pytest
import ray
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)

from isoloco_ray.steady_cleaner import SteadyCleanerCallback, alive_in_gcs, steady_trainer


def test_the_trainer_launches_the_steady_cleaner_in_place_of_rays():
    trainer = steady_trainer(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1))
    kinds = [type(callback) for callback in trainer._create_default_callbacks()]
    assert kinds.count(SteadyCleanerCallback) == 1
    assert PlacementGroupCleanerCallback not in kinds


@pytest.mark.usefixtures("ray_cluster")
def test_an_actor_is_dead_to_the_cleaner_only_once_the_gcs_says_so():
    @ray.remote(num_cpus=0)
    class Controller:
        def ping(self) -> bool:
            return True

    controller = Controller.remote()
    ray.get(controller.ping.remote())
    actor_id = controller._actor_id.hex()
    assert alive_in_gcs(actor_id)
    assert alive_in_gcs("ff" * 16)  # unknown to the GCS: never taken for dead
    ray.kill(controller)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(controller.ping.remote())
    assert not alive_in_gcs(actor_id)
