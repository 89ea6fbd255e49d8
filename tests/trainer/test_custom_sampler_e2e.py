"""verl's curriculum sampler (data.sampler.class_path) in a GRPO run on Ray: the prompts come in its order, it is
handed each trained batch, and its state is in the checkpoint a resumed run continues from."""

from __future__ import annotations

import json

import pytest

from tests.data import curriculum_sampler
from tests.tiny_runs import start_from_checkpoint
from tests.trainer.e2e_runs import GRPO, by_step, overrides, run, workspace  # noqa: F401  (fixtures)

SAMPLER = ("data.sampler.class_path=pkg://tests.data.curriculum_sampler",
           "data.sampler.class_name=ReverseCurriculumSampler", "trainer.n_gpus_per_node=1",
           "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=False")


@pytest.mark.slow  # two short GRPO runs on Ray, outside the default suite's time budget: `make test-all`
def test_a_curriculum_sampler_orders_sees_and_resumes_the_run(workspace):
    curriculum_sampler.UPDATES.clear()
    run_dir = workspace / "curriculum"
    records = by_step(run(overrides(workspace, run_dir, *GRPO, *SAMPLER)))
    assert sorted(records) == [1, 2]
    assert curriculum_sampler.UPDATES == [16, 16]  # 4 prompts x n=4 trained per step, handed over after each
    state = json.loads((run_dir / "global_step_1" / "driver_state.json").read_text())["sampler"]
    assert state == {"epoch": 0, "position": 4, "finished": False, "sampler": {"updates": 1, "given": 4}}

    curriculum_sampler.UPDATES.clear()
    resumed_dir = start_from_checkpoint(run_dir / "global_step_1", workspace / "curriculum_resumed")
    resumed = by_step(run(overrides(workspace, resumed_dir, *GRPO, *SAMPLER)))
    assert sorted(resumed) == [2] and curriculum_sampler.UPDATES == [16]
    assert resumed[2]["critic/score/mean"] == records[2]["critic/score/mean"]
