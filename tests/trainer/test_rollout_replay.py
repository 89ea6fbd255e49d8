"""verl's rollout.skip_rollout: the first training generation is dumped, later ones (and later runs) replay it whole;
validation generates; the settings it cannot stand for are refused before Ray."""

from __future__ import annotations

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.rollout_replay import RolloutReplay, replay_name
from tests.helpers import grpo_overrides, nothing_started, write_rows
from tests.trainer.e2e_runs import GRPO, by_step, overrides, run, workspace  # noqa: F401  (fixtures)


def test_the_first_generation_is_dumped_and_then_replayed_whole(tmp_path):
    calls = []

    def generate():
        calls.append(1)
        batch = DataProto.from_dict({"responses": torch.full((2, 3), len(calls))},
                                    non_tensors={"data_source": ["a", "b"]})
        return batch, {"gen/metric": 1.0}

    name = replay_name("p", "e", 2, 1)
    first, metrics = RolloutReplay(str(tmp_path / "dumps"), name).generate(generate)
    assert metrics == {"gen/metric": 1.0, "rollout_skip/replayed": 0.0} and (tmp_path / "dumps" / name).is_file()
    again, metrics = RolloutReplay(str(tmp_path / "dumps"), name).generate(generate)  # a later run: no generation
    assert calls == [1] and metrics == {"rollout_skip/replayed": 1.0}
    assert torch.equal(again.batch["responses"], first.batch["responses"])
    assert list(again.non_tensor_batch["data_source"]) == ["a", "b"]


@pytest.mark.parametrize("extra, message", [
    (("algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"), "filter_groups.enable=True"),
    (("algorithm.adv_estimator=remax",), "adv_estimator='remax'"),
])
def test_what_a_replay_cannot_stand_for_is_refused(tmp_path, extra, message):
    train = write_rows(tmp_path / "train.parquet", ["gsm8k"] * 16)
    with nothing_started(), pytest.raises(ValueError, match=f"skip_rollout=True with .*{message}"):
        validate_config(load_config(grpo_overrides(train, "actor_rollout_ref.rollout.skip_rollout=True", *extra)))


@pytest.mark.slow  # two end-to-end runs
def test_a_run_replays_its_first_generation_and_a_second_run_generates_nothing(workspace, tmp_path):  # noqa: F811
    dumps = tmp_path / "dumps"
    skip = ("actor_rollout_ref.rollout.skip_rollout=True", f"actor_rollout_ref.rollout.skip_dump_dir={dumps}",
            "trainer.save_freq=-1")
    first = by_step(run(overrides(workspace, tmp_path / "first", *GRPO, *skip)))
    assert [first[step]["rollout_skip/replayed"] for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert first[2]["response_length/mean"] == first[1]["response_length/mean"] == first[3]["response_length/mean"]
    assert "val-core/reasoning_gym/basic_arithmetic/acc/mean@1" in first[3]  # validation still generates
    second = by_step(run(overrides(workspace, tmp_path / "second", *GRPO, *skip)))
    assert [second[step]["rollout_skip/replayed"] for step in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert second[1]["critic/score/mean"] == first[1]["critic/score/mean"]
