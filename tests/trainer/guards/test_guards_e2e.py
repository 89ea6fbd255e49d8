"""The guards in a real tiny GRPO run (2 CPU Ray workers): a flat reward triggers its alarm, which stops the run
after saving the step's checkpoint (the alarms' patience is in `test_alarms.py`); every step logs the workers' memory and the guards' cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.trainer.checkpoint_dirs import list_steps
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.guards import AlarmError
from hybridflow.trainer.run import run_ppo
from tests.tiny_runs import build_workspace
from tests.trainer.e2e_runs import GRPO, by_step, overrides

FLAT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
'''


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, ray_cluster):
    root = build_workspace(tmp_path_factory.mktemp("guards"), train_size=16, test_size=4)
    (root / "reward.py").write_text(FLAT_REWARD)
    return root


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_a_flat_reward_stops_the_run_after_its_checkpoint(workspace):
    run_dir = workspace / "flat"
    args = overrides(workspace, run_dir, *GRPO, "trainer.val_before_train=False",
                     "trainer.guards.alarms.patience_steps=1", "trainer.guards.alarms.stop_on=[reward_flatline]")
    config = load_config(args)
    assert config.trainer.save_freq == 2 and config.trainer.total_training_steps == 3
    with pytest.raises(AlarmError, match=r"(?s)reward_flatline at step 1.*guards/flat_reward_group_frac.*\[1\]"):
        run_ppo(config, validate_config(config))
    records = by_step([json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()])
    assert sorted(records) == [1], "the run stopped after step 1"
    assert records[1]["alarms/reward_flatline"] == 1.0 and records[1]["alarms/logprob_mismatch"] == 0.0
    assert records[1]["guards/flat_reward_group_frac"] == 1.0 and records[1]["guards/zero_adv_group_frac"] == 1.0
    assert list_steps(run_dir) == [1], "the step that raised was checkpointed (save_freq=2 was not due)"
    for step in (1,):
        assert records[step]["memory/peak_rss_gb/max"] > 0.1  # a worker process with torch and a model
        # the actor is sharded over 2 ranks, so the rollout holds a copy: each hand-over is verified
        assert records[step]["rollout/weights_checked"] == 8 and records[step]["rollout/weights_version"] == step - 1
        assert 0 < records[step]["timing_s/guards"] < records[step]["timing_s/step"]
        print(f"step {step}: guards {records[step]['timing_s/guards']:.4f} s of a {records[step]['timing_s/step']:.2f} s "
              f"step ({records[step]['timing_s/guards'] / records[step]['timing_s/step']:.2%})")
