"""Training metrics (verl keys) on a small hand-built batch."""

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    compute_data_metrics,
    compute_stage_throughput_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)


def make_batch():
    # 2 samples, prompt width 2, response width 3.
    # row 0: prompt [pad, tok] (length 1), response length 3 (= max, clipped)
    # row 1: prompt length 2 (= max), response length 1
    return {
        "responses": torch.zeros(2, 3, dtype=torch.long),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]),  # scores 1, 0.5
        "token_level_rewards": torch.tensor([[-0.1, 0.0, 1.0], [0.4, 0.0, 0.0]]),  # rewards 0.9, 0.4
        "advantages": torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]]),  # valid 1 2 3 4
        "returns": torch.tensor([[1.0, 1.0, 1.0], [2.0, 7.0, 7.0]]),  # valid 1 1 1 2
        "values": torch.tensor([[1.0, 1.0, 1.0], [1.5, 5.0, 5.0]]),  # valid 1 1 1 1.5
    }


def test_data_metrics_by_hand():
    m = compute_data_metrics(make_batch(), use_critic=True)
    expected = {
        "critic/score/mean": 0.75, "critic/score/max": 1.0, "critic/score/min": 0.5,
        "critic/rewards/mean": 0.65, "critic/rewards/max": 0.9, "critic/rewards/min": 0.4,
        "critic/advantages/mean": 2.5, "critic/advantages/max": 4.0, "critic/advantages/min": 1.0,
        "critic/returns/mean": 1.25, "critic/returns/max": 2.0, "critic/returns/min": 1.0,
        "critic/values/mean": 1.125, "critic/values/max": 1.5, "critic/values/min": 1.0,
        # R - V = 0 0 0 0.5 -> unbiased var 0.0625; Var(R) = 0.25 -> 1 - 0.0625 / (0.25 + 1e-5)
        "critic/vf_explained_var": 1 - 0.0625 / (0.25 + 1e-5),
        "response_length/mean": 2.0, "response_length/max": 3.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,
        "response_length_non_aborted/mean": 2.0, "response_length_non_aborted/clip_ratio": 0.5,
        "response/aborted_ratio": 0.0,
        "prompt_length/mean": 1.5, "prompt_length/max": 2.0, "prompt_length/min": 1.0,
        "prompt_length/clip_ratio": 0.5,
    }  # fmt: skip
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-6), key
    assert all(isinstance(v, float) for v in m.values())


def test_data_metrics_without_critic_and_with_turns():
    batch = make_batch()
    del batch["values"]
    batch["__num_turns__"] = np.array([2, 4])
    m = compute_data_metrics(batch, use_critic=False)
    assert not any(k.startswith("critic/values") for k in m) and "critic/vf_explained_var" not in m
    assert (m["num_turns/min"], m["num_turns/max"], m["num_turns/mean"]) == (2.0, 4.0, 3.0)


def test_aborted_samples_are_left_out_of_score_statistics():
    batch = make_batch()
    batch["attention_mask"][1, 2:] = 0  # row 1 has an empty response
    batch["response_mask"][1] = 0
    m = compute_data_metrics(batch, use_critic=False)
    assert m["response/aborted_ratio"] == 0.5
    assert m["critic/score/mean"] == 1.0  # only row 0
    assert m["response_length/mean"] == 1.5 and m["response_length_non_aborted/mean"] == 3.0
    # everything aborted: NaN statistics, not a crash
    batch["attention_mask"][0, 2:] = 0
    batch["response_mask"][0] = 0
    m = compute_data_metrics(batch, use_critic=False)
    assert math.isnan(m["critic/score/mean"]) and math.isnan(m["critic/advantages/mean"])


def test_timing_metrics():
    # response tokens 3 + 1 = 4; all tokens 4 + 3 = 7
    timing = {"gen": 2.0, "update_actor": 3.5, "step": 10.0}
    m = compute_timing_metrics(make_batch(), timing)
    assert m == {
        "timing_s/gen": 2.0,
        "timing_s/update_actor": 3.5,
        "timing_s/step": 10.0,
        "timing_per_token_ms/gen": pytest.approx(2000 / 4),
        "timing_per_token_ms/update_actor": pytest.approx(3500 / 7),
    }


def test_throughput_metrics():
    # 400 tokens in 10 s on 4 workers -> 10 tokens / s / worker
    m = compute_throughput_metrics([100, 300], {"step": 10.0}, num_workers=4)
    assert m == {"perf/total_num_tokens": 400.0, "perf/time_per_step": 10.0, "perf/throughput": 10.0}


def test_stage_throughput_metrics():
    # response tokens 3 + 1 = 4 (generation); all tokens 4 + 3 = 7 (the other stages); untimed stages are left out
    timing = {"gen": 2.0, "old_log_prob": 0.5, "update_actor": 3.5, "adv": 0.1, "step": 10.0}
    assert compute_stage_throughput_metrics(make_batch(), timing) == {
        "perf/tokens_per_s/gen": pytest.approx(2.0),
        "perf/tokens_per_s/old_log_prob": pytest.approx(14.0),
        "perf/tokens_per_s/update_actor": pytest.approx(2.0),
    }
