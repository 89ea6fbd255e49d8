"""The reward-model worker: its score is the HF sequence classifier's own, on the last response token, with the
policy's ids as they are or re-templated for a reward model with another tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from hybridflow.models import build_local_tokenizer, load_tokenizer, save_tiny_model, save_tiny_reward_model
from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.workers import RewardModelWorker
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.reward_config import RewardModelModelConfig, RewardModelWorkerConfig
from hybridflow.workers.reward_model import encode_chat, same_tokenization, template_for_reward_model

MESSAGES = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Say hi"}]]
ANSWERS = ["The answer is 5.", "hi"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return {
        "policy": str(save_tiny_model(root / "policy", seed=0)),
        "rm": str(save_tiny_reward_model(root / "rm", seed=3)),
        "rm_local": str(save_tiny_reward_model(root / "rm_local", seed=4, tokenizer=build_local_tokenizer())),
    }


def policy_batch(tokenizer, prompt_len: int = 24, response_len: int = 8) -> DataProto:
    """Left-padded templated prompts + right-padded responses, as the rollout returns them."""
    prompts = [
        tokenizer(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        for m in MESSAGES
    ]
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in ANSWERS]
    pad = tokenizer.pad_token_id
    input_ids, attention_mask = [], []
    for prompt, answer in zip(prompts, answers):
        prompt, answer = list(prompt)[-prompt_len:], answer[:response_len]
        input_ids.append([pad] * (prompt_len - len(prompt)) + prompt + answer + [pad] * (response_len - len(answer)))
        attention_mask.append([0] * (prompt_len - len(prompt)) + [1] * (len(prompt) + len(answer))
                              + [0] * (response_len - len(answer)))
    input_ids, attention_mask = torch.tensor(input_ids), torch.tensor(attention_mask)
    return DataProto.from_dict(
        {
            "input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt_len:], "response_mask": attention_mask[:, prompt_len:],
        },
        non_tensors={"raw_prompt": np.array(MESSAGES + [], dtype=object)},
    )


def hf_scores(rm_path: str, texts_ids: list[list[int]]) -> list[float]:
    """The HF classifier's score head on each whole sequence's last token. (Its own pooling skips trailing tokens
    equal to pad, and pad is eos here; verl and hybridflow read the last attended token, the eos included.)"""
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        hidden = [model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] for ids in texts_ids]
        return [model.score(h).item() for h in hidden]


def rm_group(rm_path: str, input_tokenizer: str | None, packed: bool = False, **kwargs) -> LocalWorkerGroup:
    model = RewardModelModelConfig(path=rm_path, input_tokenizer=input_tokenizer, use_remove_padding=packed)
    config = RewardModelWorkerConfig(enable=True, model=model, **kwargs)
    group = LocalWorkerGroup(RayClassWithInitArgs(RewardModelWorker, config, WorkerRuntimeConfig(seed=0, num_threads=1)))
    group.init_model()
    return group


def test_same_tokenizer_scores_the_policy_ids_as_the_hf_classifier_does(models):
    tokenizer = load_tokenizer(models["policy"])
    batch = policy_batch(tokenizer)
    group = rm_group(models["rm"], models["policy"], micro_batch_size_per_gpu=1)
    scores = group.compute_rm_score(batch).batch["rm_scores"]
    mask = batch.batch["attention_mask"].bool()
    expected = hf_scores(models["rm"], [row[m].tolist() for row, m in zip(batch.batch["input_ids"], mask)])
    last = batch.batch["response_mask"].sum(-1) - 1
    assert torch.allclose(scores[torch.arange(2), last], torch.tensor(expected), atol=1e-5)
    assert scores.sum(-1).tolist() == pytest.approx(expected, abs=1e-5)  # zero elsewhere
    packed = rm_group(models["rm"], models["policy"], packed=True).compute_rm_score(batch).batch["rm_scores"]
    assert torch.allclose(packed, scores, atol=1e-5), "padding removal scores the same"


def test_other_tokenizer_re_templates_the_conversation(models):
    policy_tokenizer, rm_tokenizer = load_tokenizer(models["policy"]), load_tokenizer(models["rm_local"])
    assert not same_tokenization(policy_tokenizer, rm_tokenizer)
    batch = policy_batch(policy_tokenizer)
    group = rm_group(models["rm_local"], models["policy"], use_dynamic_bsz=True, forward_max_token_len_per_gpu=64)
    scores = group.compute_rm_score(batch).batch["rm_scores"].sum(-1)
    conversations = [encode_chat(rm_tokenizer, [*m, {"role": "assistant", "content": a}]) for m, a in zip(MESSAGES, ANSWERS)]
    assert scores.tolist() == pytest.approx(hf_scores(models["rm_local"], conversations), abs=1e-5)


def test_re_templating_keeps_the_end_of_long_conversations():
    tokenizer = build_local_tokenizer()
    responses = torch.tensor([[tokenizer.eos_token_id] * 3])
    inputs = template_for_reward_model(
        np.array([[{"role": "user", "content": "a long question " * 20}]], dtype=object), responses,
        torch.ones_like(responses), tokenizer, tokenizer, max_length=10,
    )
    full = encode_chat(tokenizer, [{"role": "user", "content": "a long question " * 20}, {"role": "assistant", "content": ""}])
    assert inputs["input_ids"][0].tolist() == full[-10:]
    assert inputs["attention_mask"].sum().item() == 10
    assert inputs["truncated"].tolist() == [1.0]  # counted: reward_model/truncated_ratio
    whole = template_for_reward_model(
        np.array([[{"role": "user", "content": "hi"}]], dtype=object), responses, torch.ones_like(responses),
        tokenizer, tokenizer, max_length=len(full))
    assert whole["truncated"].tolist() == [0.0]


def test_a_causal_lm_is_refused_as_reward_model(models):
    with pytest.raises(Exception, match="no trained score head"):
        rm_group(models["policy"], None)


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_tensor_parallel_reward_model_on_two_ranks_scores_like_one(models, ray_cluster):
    """Both ranks of a tensor-parallel pair score the same rows; the group returns each row once."""
    from hybridflow.engines.training import FSDPConfig
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup

    tokenizer = load_tokenizer(models["policy"])
    batch = policy_batch(tokenizer)
    expected = rm_group(models["rm"], None, packed=True).compute_rm_score(batch).batch["rm_scores"]
    model = RewardModelModelConfig(path=models["rm"], use_remove_padding=True,
                                   fsdp_config=FSDPConfig(tensor_parallel_size=2))
    config = RewardModelWorkerConfig(enable=True, model=model)
    pool = RayResourcePool([2])
    group = RayWorkerGroup(pool, RayClassWithInitArgs(RewardModelWorker, config, WorkerRuntimeConfig(seed=0, num_threads=1)))
    try:
        group.init_model()
        assert group.query_dispatch_info("reward") == [(0, 1, True), (0, 1, False)]
        scores = group.compute_rm_score(batch).batch["rm_scores"]
    finally:
        group.shutdown()
        pool.release()
    assert scores.shape == expected.shape
    assert torch.allclose(scores, expected, atol=1e-5)
