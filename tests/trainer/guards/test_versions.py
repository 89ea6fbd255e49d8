"""The weight-version guards: on-policy, one version per step and a newer one after every actor update; off-policy,
each generation from the version the trainer synced to the rollout before launching it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.trainer.guards import StaleWeightsError, WeightVersionWatch, check_served_version


def versions(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_versions_that_advance_after_each_update_pass_and_are_logged():
    watch = WeightVersionWatch()
    assert watch.observe(1, versions(0, 0, 0)) == {"rollout/weight_version": 0.0}
    watch.mark_update()
    assert watch.observe(2, versions(3, 3)) == {"rollout/weight_version": 3.0}  # several optimizer steps per update
    assert watch.observe(3, versions(3, 3)) == {"rollout/weight_version": 3.0}  # no update between (critic warm-up)


def test_a_rollout_that_keeps_the_old_weights_after_an_update_stops_the_run():
    watch = WeightVersionWatch()
    watch.observe(1, versions(2, 2))
    watch.mark_update()
    with pytest.raises(StaleWeightsError, match=r"step 2: the rollout still served weight version 2 after the actor"):
        watch.observe(2, versions(2, 2))


def test_one_step_from_two_versions_names_them():
    with pytest.raises(StaleWeightsError, match="weight versions 4 to 5"):
        WeightVersionWatch().observe(7, versions(5, 4, 5))


def test_a_rollout_path_without_versions_is_not_checked():
    watch = WeightVersionWatch()
    assert watch.observe(1, None) == {} and watch.observe(2, versions()) == {}
    watch.mark_update()
    assert watch.observe(3, versions(1)) == {"rollout/weight_version": 1.0}


def test_an_off_policy_generation_must_come_from_the_version_synced_before_its_launch():
    check_served_version("step 3", versions(2, 2, 2), expected=2)
    check_served_version("step 3", None, expected=2)  # a rollout path that stamps nothing
    with pytest.raises(StaleWeightsError, match=r"step 3: the rollout served weight version 1, but the trainer synced "
                                                 r"version 2"):
        check_served_version("step 3", versions(1, 1), expected=2)
    with pytest.raises(StaleWeightsError, match="served weight version 1 to 2"):
        check_served_version("chunk 0", versions(2, 1), expected=2)
