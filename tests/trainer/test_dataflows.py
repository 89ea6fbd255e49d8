"""The experience stage of the driver for ReMax, DAPO's dynamic sampling and a reward model, run against a
scripted generator and reward function (no Ray, no model): what is generated, scored, kept and merged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import RewardResult
from hybridflow.trainer.config import load_config
from hybridflow.trainer.dynamic_sampling import (
    GroupFilter,
    TooManyGenerationBatches,
    filter_metric_values,
    informative_rows,
    merge_generation_metrics,
)
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.reward_stage import build_reward_stage

RESPONSE_LEN = 3
PROMPT_LEN = 2


class ScriptedGenerator:
    """Responses whose first token encodes the prompt id and the sample: greedy calls answer token 0 + prompt id."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.calls.append(dict(prompts.meta_info, rows=len(prompts)))
        prompt_ids = prompts.batch["input_ids"][:, 0]
        greedy = prompts.meta_info.get("do_sample", True) is False
        responses = torch.zeros(len(prompts), RESPONSE_LEN, dtype=torch.long)
        for row, prompt_id in enumerate(prompt_ids.tolist()):
            responses[row, 0] = 100 * prompt_id + (0 if greedy else row % 4 + 1)
        mask = torch.ones(len(prompts), RESPONSE_LEN, dtype=torch.long)
        input_ids = torch.cat([prompts.batch["input_ids"], responses], dim=1)
        attention_mask = torch.cat([prompts.batch["attention_mask"], mask], dim=1)
        return DataProto.from_dict({
            "input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
            "response_mask": mask,
        }, meta_info={"metrics": {"gen/rows": float(len(prompts))}})


def rule_reward(scores_of_response) -> callable:
    """A reward manager scoring each sample with `scores_of_response(first response token)`; `acc` = score > 0."""

    def reward_fn(batch: DataProto) -> RewardResult:
        first = batch.batch["responses"][:, 0].tolist()
        scores = torch.tensor([float(scores_of_response(token)) for token in first])
        tensor = torch.zeros(len(batch), RESPONSE_LEN)
        tensor[:, -1] = scores
        return RewardResult(
            reward_tensor=tensor, extra_info={"acc": [float(s > 0) for s in scores.tolist()]},
            metrics={"reward/errors": 1.0},
        )

    return reward_fn


def prompt_batches(prompt_ids_per_batch: list[list[int]]):
    for ids in prompt_ids_per_batch:
        ids_tensor = torch.tensor(ids)[:, None].repeat(1, PROMPT_LEN)
        yield {
            "input_ids": ids_tensor, "attention_mask": torch.ones_like(ids_tensor),
            "position_ids": torch.arange(PROMPT_LEN).repeat(len(ids), 1),
            "data_source": np.array(["t"] * len(ids), dtype=object),
        }


def make_trainer(overrides: list[str], reward_fn, reward_model=None) -> RayPPOTrainer:
    config = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", *overrides])
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config, trainer.reward_fn = config, reward_fn
    trainer.generator = ScriptedGenerator()
    trainer.pass_rows = False
    trainer.replay = None  # rollout.skip_rollout off
    trainer.workers = SimpleNamespace(reward_model=reward_model)
    trainer.rewards = build_reward_stage(config, reward_fn, reward_model)  # as init_workers does
    return trainer


def test_remax_baseline_is_the_greedy_responses_score():
    # Greedy responses start with token 100 * prompt id: score = that token; samples add 1..4.
    trainer = make_trainer(["algorithm.adv_estimator=remax"], rule_reward(lambda token: token))
    metrics, timing = {}, {}
    batch = trainer.sample(prompt_batches([[1, 2]]), metrics, timing)
    sampled, greedy = trainer.generator.calls
    assert sampled["rows"] == 8 and "do_sample" not in sampled
    assert greedy["do_sample"] is False and greedy["rows"] == 2 and greedy["validate"] is False
    assert batch.batch["reward_baselines"].tolist() == [100.0] * 4 + [200.0] * 4
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [101, 102, 103, 104, 201, 202, 203, 204]
    assert timing["gen_max"] > 0 and timing["gen"] > 0
    # Only the sampled batch's reward metrics are logged: the baseline's scoring is not double-counted.
    assert metrics["reward/errors"] == 1.0


def test_informative_rows_keeps_groups_that_disagree_and_singletons():
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    values = np.array([1.0, 1.0, 0.0, 1.0, 5.0, 0.0, 0.0])
    rows, kept, dropped = informative_rows(uids, values)
    assert rows.tolist() == [2, 3, 4]
    assert (kept, dropped) == (2, 2)


def test_filter_metric_values_reads_sequence_sums_or_reward_columns():
    scores = torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.0, 2.0]])
    assert filter_metric_values("seq_reward", scores, {}).tolist() == [1.5, 2.0]
    assert filter_metric_values("acc", scores, {"acc": [1, 0]}).tolist() == [1.0, 0.0]
    with pytest.raises(KeyError, match="filter_groups.metric='score'.*available"):
        filter_metric_values("score", scores, {"acc": [1, 0]})


def test_dynamic_sampling_draws_until_enough_groups_disagree():
    # Even prompt ids: all four samples score 1 (agree, dropped); odd ids: samples 1, 3 score 1, 2, 4 score 0.
    def score(token: int) -> float:
        prompt, sample = divmod(token, 100)
        return 1.0 if prompt % 2 == 0 or sample % 2 == 1 else 0.0

    trainer = make_trainer(
        ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc", "data.train_batch_size=3",
         "data.gen_batch_size=4"],
        rule_reward(score),
    )
    metrics, timing = {}, {}
    batches = prompt_batches([[2, 4, 6, 1], [8, 3, 10, 12], [5, 7, 9, 11], [13, 15, 17, 19]])
    batch = trainer.sample(batches, metrics, timing)
    # Batch 1 keeps prompt 1, batch 2 keeps 3, batch 3 keeps 5, 7, 9, 11: full after 3 batches, 3 groups surplus.
    assert len(trainer.generator.calls) == 3
    assert len(batch) == 3 * 4
    assert batch.batch["input_ids"][::4, 0].tolist() == [1, 3, 5]
    assert metrics["train/num_gen_batches"] == 3
    assert metrics["filter_groups/kept_groups"] == 6
    assert metrics["filter_groups/dropped_groups"] == 6
    assert metrics["filter_groups/kept_fraction"] == 0.5
    assert metrics["filter_groups/surplus_groups"] == 3
    assert metrics["reward/errors"] == 3.0  # one per generation batch, summed
    assert metrics["gen/rows"] == 16.0  # averaged over generation batches
    assert len(set(batch.non_tensor_batch["uid"].tolist())) == 3


def test_dynamic_sampling_stops_at_max_num_gen_batches():
    trainer = make_trainer(
        ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=2",
         "data.train_batch_size=2"],
        rule_reward(lambda token: 1.0),  # every group agrees
    )
    with pytest.raises(TooManyGenerationBatches, match="2 generation batches gave 0 prompt groups"):
        trainer.sample(prompt_batches([[1, 2], [3, 4], [5, 6]]), {}, {})
    assert len(trainer.generator.calls) == 2


def test_group_filter_take_before_full_is_refused():
    groups = GroupFilter("acc", num_prompts=2, n=2, max_num_gen_batches=0)
    with pytest.raises(RuntimeError, match="only 0 of 2"):
        groups.take()


def test_merge_generation_metrics_sums_counts_and_averages_the_rest():
    merged = merge_generation_metrics([
        {"reward/errors": 1.0, "reward/timeouts": 0.0, "gen/x": 2.0},
        {"reward/errors": 2.0, "gen/x": 4.0},
    ])
    assert merged == {"reward/errors": 3.0, "reward/timeouts": 0.0, "gen/x": 3.0}


class ScriptedRewardModel:
    def __init__(self) -> None:
        self.rows = 0

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        self.rows += len(batch)
        scores = torch.zeros(len(batch), RESPONSE_LEN)
        scores[:, -1] = 10.0
        return DataProto.from_dict({"rm_scores": scores})


def test_reward_model_score_alone_or_joined_with_rules():
    rm = ScriptedRewardModel()
    trainer = make_trainer(["reward_model.enable=True"], rule_reward(lambda token: 1.0), reward_model=rm)
    metrics, timing = {}, {}
    batch = trainer.sample(prompt_batches([[1]]), metrics, timing)
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [10.0] * 4
    assert rm.rows == 4 and "reward" not in timing and timing["rm"] > 0
    assert metrics["reward/rm_score/mean"] == 10.0

    trainer = make_trainer(
        ["reward_model.enable=True", "reward_model.rule_reward_coef=0.5"], rule_reward(lambda token: 1.0),
        reward_model=ScriptedRewardModel(),
    )
    metrics = {}
    batch = trainer.sample(prompt_batches([[1]]), metrics, {})
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [10.5] * 4
    assert metrics["reward/rule_score/mean"] == 1.0 and metrics["reward/errors"] == 1.0
