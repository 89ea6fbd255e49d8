"""Reward managers: the score lands on each response's last valid token; failures score 0 and are counted."""

from __future__ import annotations

import dataclasses

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards.config import SandboxFusionConfig
from hybridflow.rewards import (
    BatchRewardManager, DAPORewardManager, NaiveRewardManager, OverlongBufferConfig, RewardResult, ScoringConfig,
    compute_overlong_penalty, get_reward_manager_cls, load_custom_reward_fn)

PAD, EOS = 0, 1
PROMPT_LEN, RESPONSE_LEN = 4, 8
FAST = ScoringConfig(timeout_s=1.0, num_workers=2)


class CharTokenizer:
    """One token per character (id = code point); 0 is padding and 1 is eos, both special."""

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(chr(t) for t in seq if not (skip_special_tokens and t in (PAD, EOS))) for seq in sequences]


def make_batch(samples: list[tuple[str, str, str, Any]]) -> DataProto:
    """samples: (prompt, response, data_source, ground_truth). Prompts left-padded, responses right-padded
    (a response gets eos after it when there is room, as a rollout would)."""
    prompts = torch.full((len(samples), PROMPT_LEN), PAD)
    responses = torch.full((len(samples), RESPONSE_LEN), PAD)
    mask = torch.zeros(len(samples), PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    for i, (prompt, response, _, _) in enumerate(samples):
        prompts[i, PROMPT_LEN - len(prompt):] = torch.tensor([ord(c) for c in prompt])
        tokens = [ord(c) for c in response] + ([EOS] if len(response) < RESPONSE_LEN else [])
        responses[i, :len(tokens)] = torch.tensor(tokens)
        mask[i, PROMPT_LEN - len(prompt):PROMPT_LEN] = 1
        mask[i, PROMPT_LEN:PROMPT_LEN + len(tokens)] = 1
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={
            "data_source": [s[2] for s in samples],
            "reward_model": [{"style": "rule", "ground_truth": s[3]} for s in samples],
            "extra_info": [{"index": i} for i in range(len(samples))],
        },
    )


@pytest.fixture
def managers() -> Iterator[list]:
    created: list = []
    yield created
    for manager in created:
        manager.close()


SAMPLES = [
    ("q1", "#### 42", "openai/gsm8k", "42"),              # 7 chars + eos -> last valid index 7
    ("q22", "#### 7", "openai/gsm8k", "8"),               # wrong: format score at index 6
    ("q", "\\boxed 1", "lighteval/MATH", "1"),                     # 8 chars, no room for eos -> index 7
    ("qq", "(3+5)*2", "countdown", {"target": 16, "numbers": [2, 3, 5]}),
]


def test_naive_puts_scores_on_the_last_valid_token(managers: list) -> None:
    manager = NaiveRewardManager(CharTokenizer(), num_examine=1, format_score=0.1, scoring=FAST)
    managers.append(manager)
    result = manager(make_batch(SAMPLES))
    assert isinstance(result, RewardResult)
    rewards = result.reward_tensor
    assert rewards.shape == (4, RESPONSE_LEN) and rewards.dtype == torch.float32
    expected = torch.zeros(4, RESPONSE_LEN)
    expected[0, 7], expected[1, 6], expected[2, 7], expected[3, 7] = 1.0, 0.1, 1.0, 1.0
    torch.testing.assert_close(rewards, expected)
    assert result.extra_info["score"] == pytest.approx([1.0, 0.1, 1.0, 1.0])
    assert result.extra_info["acc"] == [1.0, 0.0, 1.0, 1.0]
    assert result.metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0}


def test_full_length_response_and_empty_response(managers: list) -> None:
    manager = NaiveRewardManager(CharTokenizer(), scoring=FAST)
    managers.append(manager)
    batch = make_batch([("q", "#### 123", "openai/gsm8k", "123"), ("q", "", "openai/gsm8k", "1")])
    batch.batch["attention_mask"][1, PROMPT_LEN:] = 0  # no response token at all
    rewards = manager(batch).reward_tensor
    assert rewards[0].tolist() == [0.0] * 7 + [1.0]  # 8 tokens, no eos: the reward is on index 7
    assert rewards[1].abs().sum() == 0


SCORER_FILE = '''
def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str.startswith("hang"):
        while True:
            pass
    if solution_str.startswith("boom"):
        raise ValueError("bad scorer")
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth, "pred": solution_str}
'''


def test_errors_and_timeouts_score_zero_and_are_counted(tmp_path: Path, managers: list,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "reward.py"
    path.write_text(SCORER_FILE)
    manager = NaiveRewardManager(CharTokenizer(), compute_score=load_custom_reward_fn(path, "score"), scoring=FAST)
    managers.append(manager)
    samples = [("q", "yes", "any", "yes"), ("q", "boom1", "any", "x"), ("q", "hang", "any", "x"),
               ("q", "boom2", "any", "x"), ("q", "no", "any", "yes")]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.pool"):
        result = manager(make_batch(samples))
    assert time.monotonic() - start < 6.0
    assert result.reward_tensor.sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.metrics == {"reward/errors": 2.0, "reward/timeouts": 1.0}
    info = result.extra_info
    assert info["pred"] == ["yes", None, None, None, "no"]
    assert info["acc"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    tracebacks = [r for r in caplog.records if "First error" in r.getMessage()]
    assert len(tracebacks) == 1 and "ValueError: bad scorer" in tracebacks[0].getMessage()


HOSTILE_SCORES_FILE = '''
import math
import time
time.sleep(3.0)  # a slow import (a reward file importing torch on a loaded machine): it is not a call's time
def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "nan":
        return float("nan")
    if solution_str == "inf":
        return {"score": math.inf}
    if solution_str == "slow":
        while True:
            pass
    return 1.0
'''


def test_a_slow_import_is_not_a_timeout_and_non_finite_scores_are_errors(tmp_path: Path, managers: list) -> None:
    """The user's file is imported when the scorer processes start, not inside the first calls' 1 s timeouts
    (which made every call of the run time out, silently scoring 0); NaN and inf score 0 as errors (one NaN made
    every advantage and gradient of the batch NaN, and each optimizer step was skipped)."""
    path = tmp_path / "reward.py"
    path.write_text(HOSTILE_SCORES_FILE)
    # forkserver, as in a run's driver (connected to Ray, never forked): the workers import the file themselves
    scoring = dataclasses.replace(FAST, mp_context="forkserver")
    manager = NaiveRewardManager(CharTokenizer(), compute_score=load_custom_reward_fn(path, "score"), scoring=scoring)
    managers.append(manager)
    result = manager(make_batch([("q", "ok", "any", "x"), ("q", "nan", "any", "x"), ("q", "inf", "any", "x"),
                                 ("q", "ok", "any", "x")]))
    assert result.reward_tensor.sum(-1).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert result.metrics == {"reward/errors": 2.0, "reward/timeouts": 0.0}
    # a batch whose calls nearly all time out is a scorer too slow for its timeout: the run stops, saying so
    with pytest.raises(RuntimeError, match=r"4 of 4 reward scorer calls failed in this batch \(any: 4/4: 0 raised "
                                           r"or returned no finite score, 4 ran past reward_model.scoring.timeout_s\)"):
        manager(make_batch([("q", "slow", "any", "x")] * 4))


def test_unknown_data_source_fails_in_the_driver(managers: list) -> None:
    manager = NaiveRewardManager(CharTokenizer(), scoring=FAST)
    managers.append(manager)
    with pytest.raises(ValueError, match="no reward scorer for data_source 'mystery'"):
        manager(make_batch([("q", "1", "mystery", "1")]))


def test_batch_manager(tmp_path: Path, managers: list) -> None:
    manager = BatchRewardManager(CharTokenizer(), scoring=FAST)
    managers.append(manager)
    rewards = manager(make_batch(SAMPLES)).reward_tensor
    assert rewards.sum(-1).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert rewards[0, 7] == 1.0

    path = tmp_path / "batched.py"
    path.write_text("def score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                    "    if len(solution_strs) > 3:\n        raise RuntimeError('too many')\n"
                    "    return [len(s) / 10 for s in solution_strs]\n")
    custom = BatchRewardManager(CharTokenizer(), compute_score=load_custom_reward_fn(path, "score"), scoring=FAST)
    managers.append(custom)
    result = custom(make_batch(SAMPLES[:2]))
    assert result.reward_tensor[0, 7].item() == pytest.approx(0.7)
    assert result.reward_tensor[1, 6].item() == pytest.approx(0.6)
    # Every call failing is a broken scorer, not a bad sample: the run stops, naming the data sources...
    with pytest.raises(RuntimeError, match=r"4 of 4 reward scorer calls failed .*openai/gsm8k: 2/2.*max_error_fraction"):
        custom(make_batch(SAMPLES))
    # ...unless asked to go on: then the samples score 0 and are counted.
    tolerant = BatchRewardManager(CharTokenizer(), compute_score=load_custom_reward_fn(path, "score"),
                                  scoring=dataclasses.replace(FAST, max_error_fraction=1.0))
    managers.append(tolerant)
    failed = tolerant(make_batch(SAMPLES))
    assert failed.reward_tensor.abs().sum() == 0
    assert failed.metrics["reward/errors"] == 4.0


def test_overlong_penalty_values() -> None:
    # max 8, buffer 4: no penalty up to 4 tokens, then -0.25 per token (factor 1.0)
    assert compute_overlong_penalty([3, 4, 5, 7, 8], max_resp_len=8, buffer_len=4, penalty_factor=1.0) == \
        [0.0, 0.0, -0.25, -0.75, -1.0]


def test_dapo_adds_the_overlong_penalty(managers: list) -> None:
    config = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True)
    manager = DAPORewardManager(CharTokenizer(), max_resp_len=RESPONSE_LEN, overlong_buffer_cfg=config, scoring=FAST)
    managers.append(manager)
    batch = make_batch([("q", "#### 42", "openai/gsm8k", "42"), ("q", "#### 4", "openai/gsm8k", "4"),
                        ("q", "####", "openai/gsm8k", "4")])
    result = manager(batch)
    # valid lengths (with eos) 8, 7, 5 -> penalties -1.0, -0.75, -0.25
    rewards = result.reward_tensor
    assert rewards[0, 7].item() == pytest.approx(0.0)
    assert rewards[1, 6].item() == pytest.approx(0.25)
    assert rewards[2, 4].item() == pytest.approx(-0.25)
    info = result.extra_info
    assert info["score"] == [1.0, 1.0, 0.0]
    assert info["overlong_reward"] == pytest.approx([-1.0, -0.75, -0.25])
    assert info["overlong"] == [True, True, True]


def test_dapo_config_is_checked() -> None:
    with pytest.raises(ValueError, match="needs max_resp_len"):
        DAPORewardManager(CharTokenizer(), overlong_buffer_cfg=OverlongBufferConfig(enable=True, len=4))
    with pytest.raises(ValueError, match="overlong_buffer.len=8 must be in 1..max_resp_len-1"):
        DAPORewardManager(CharTokenizer(), max_resp_len=8, overlong_buffer_cfg=OverlongBufferConfig(enable=True, len=8))


@pytest.mark.parametrize("manager_cls", [NaiveRewardManager, BatchRewardManager, DAPORewardManager])
def test_precomputed_rm_scores_pass_through(manager_cls: type, managers: list) -> None:
    manager = manager_cls(CharTokenizer(), scoring=FAST)
    managers.append(manager)
    batch = make_batch(SAMPLES[:1])
    batch.batch["rm_scores"] = torch.full((1, RESPONSE_LEN), 0.5)
    result = manager(batch)
    assert result.reward_tensor.eq(0.5).all() and result.extra_info == {} and result.metrics == {}


def test_registry() -> None:
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("batch") is BatchRewardManager
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    assert get_reward_manager_cls("prime") is NaiveRewardManager  # verl's name for pooled per-sample scoring
    with pytest.raises(KeyError, match=r"unknown reward manager 'prim'; known: \['batch', 'dapo', 'naive', 'prime'\]"):
        get_reward_manager_cls("prim")


@pytest.mark.parametrize("name", ["naive", "batch", "dapo"])
def test_from_config_reads_the_sections(name: str, managers: list) -> None:
    """Each manager takes what it needs from the reward_model and data sections (dapo: the overlong buffer)."""
    overlong = OverlongBufferConfig(enable=True, len=2, penalty_factor=1.0)
    fusion = SandboxFusionConfig(url="http://127.0.0.1:8080/run_code", memory_limit_mb=256)
    reward = type("RewardSection", (), {"scoring": FAST, "overlong_buffer": overlong, "sandbox_fusion": fusion})()
    data = type("DataSection", (), {"reward_fn_key": "source", "max_response_length": RESPONSE_LEN})()
    manager = get_reward_manager_cls(name).from_config(CharTokenizer(), None, reward, data)
    managers.append(manager)
    assert type(manager) is get_reward_manager_cls(name)
    assert manager.reward_fn_key == "source" and manager.pool.config is FAST and manager.num_examine == 0
    assert manager.remote_sandbox == fusion.endpoint() and manager.remote_sandbox.memory_limit_mb == 256
    if name == "dapo":
        assert manager.overlong is overlong and manager.max_resp_len == RESPONSE_LEN


def test_an_agent_loop_s_tool_extra_fields_reach_the_reward_function_s_extra_info() -> None:
    """verl's reward managers merge each row's `tool_extra_fields` (tool_rewards, turn_scores) into its extra_info."""
    import numpy as np

    from hybridflow.rewards.manager.base import decode_batch

    batch = make_batch(SAMPLES[:2])
    fields = np.empty(2, dtype=object)
    fields[:] = [{"tool_rewards": [0.0, -0.05], "turn_scores": [1.0]}, {}]
    batch.non_tensor_batch["tool_extra_fields"] = fields
    decoded = decode_batch(batch, CharTokenizer(), "data_source")
    assert decoded.extra_infos == [{"index": 0, "tool_rewards": [0.0, -0.05], "turn_scores": [1.0]}, {"index": 1}]


def test_a_custom_manager_that_breaks_the_contract_is_named(managers: list) -> None:
    """A verl-style manager returning a bare tensor failed later as "'Tensor' object has no attribute 'metrics'"."""
    from hybridflow.rewards.manager.base import checked_reward_result

    manager = NaiveRewardManager(CharTokenizer(), scoring=FAST)
    managers.append(manager)
    batch = make_batch(SAMPLES)
    assert checked_reward_result(manager, manager(batch), len(batch)).reward_tensor.shape == (4, RESPONSE_LEN)
    with pytest.raises(TypeError, match=r"reward manager NaiveRewardManager must return a hybridflow.rewards."
                                        r"RewardResult .*; it returned Tensor; wrap a token-level reward tensor"):
        checked_reward_result(manager, torch.zeros(4, RESPONSE_LEN), len(batch))
    with pytest.raises(ValueError, match=r"its reward_tensor has shape \(4,\) for a batch of 4"):
        checked_reward_result(manager, RewardResult(reward_tensor=torch.zeros(4)), len(batch))


def minus_one(*args: Any, **kwargs: Any) -> float:
    return -1.0


def test_an_aborted_row_s_reward_counts_in_its_group_as_verl_puts_it(managers: list) -> None:
    """An over-sampled row aborted before its first token (all-zero response mask) gets the reward function's score
    for the empty response on the last column, as verl's managers put it: DAPO's -1 must count in its group's
    mean, where a 0 left there moved the other samples' advantages."""
    manager = NaiveRewardManager(CharTokenizer(), scoring=FAST, compute_score=minus_one)
    managers.append(manager)
    batch = make_batch([("q", "abc", "gsm8k", "1"), ("q", "abc", "gsm8k", "1")])
    batch.batch["attention_mask"][0, PROMPT_LEN:] = 0  # row 0: aborted, no response token
    batch.batch["responses"][0] = PAD
    rewards = manager(batch).reward_tensor
    assert rewards.sum(-1).tolist() == [-1.0, -1.0]
    assert rewards[0, -1] == -1.0 and rewards[1, 3] == -1.0
