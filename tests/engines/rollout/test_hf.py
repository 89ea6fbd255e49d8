"""The `hf` rollout: output layout, eos handling, n samples, log-prob parity, weight updates, registry."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import ROLLOUTS, HFRollout, RolloutConfig, SamplingConfig, SamplingParams
from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.models import build_causal_lm, build_tiny_model
from hybridflow.utils.config import ConfigFieldError
from tests.engines.helpers import encode_prompts

PROMPTS = ["hello there", "what is 12 + 7? The answer is", "x"]


@pytest.fixture(scope="module")
def rollout(tiny_llama_dir, tiny_tokenizer):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8)
    return ROLLOUTS.get("hf")(build_causal_lm(tiny_llama_dir), tiny_tokenizer, params)


def test_layout_and_log_prob_parity_with_training_engine(rollout, tiny_llama_dir, tiny_tokenizer):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS, {"global_steps": 3})
    prompts.non_tensor_batch["uid"] = __import__("numpy").array(["a", "b", "c"], dtype=object)
    torch.manual_seed(0)
    out = rollout.generate_sequences(prompts)
    bs, prompt_len = prompts.batch["input_ids"].shape
    assert out.batch["responses"].shape == (bs, 8)
    assert out.batch["input_ids"].shape == out.batch["attention_mask"].shape == (bs, prompt_len + 8)
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    assert torch.equal(out.batch["input_ids"][:, prompt_len:], out.batch["responses"])
    assert torch.equal(out.batch["attention_mask"][:, prompt_len:], out.batch["response_mask"])
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(out.batch["position_ids"][:, prompt_len:], last + torch.arange(1, 9))
    assert list(out.non_tensor_batch["uid"]) == ["a", "b", "c"] and out.meta_info["global_steps"] == 3

    engine = build_fsdp_engine(tiny_llama_dir, FSDPEngineConfig(micro_batch_size_per_gpu=2))
    log_probs, _ = engine.compute_log_prob(out, temperature=0.7)
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_tokens_after_first_eos_are_pad_and_masked(tiny_llama_dir, tiny_tokenizer):
    model = build_causal_lm(tiny_llama_dir)
    greedy = HFRollout(model, tiny_tokenizer, SamplingParams(max_new_tokens=6, do_sample=False))
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    free = greedy.generate_sequences(prompts).batch["responses"]
    stop = int(free[0, 2])  # make row 0's third greedy token a stop token
    stopped = HFRollout(
        model, tiny_tokenizer, SamplingParams(max_new_tokens=6, do_sample=False, stop_token_ids=(stop,))
    ).generate_sequences(prompts)
    first_stop = int((free[0] == stop).nonzero()[0])
    mask = stopped.batch["response_mask"][0]
    assert mask[: first_stop + 1].tolist() == [1] * (first_stop + 1)
    assert mask[first_stop + 1 :].sum() == 0
    assert (stopped.batch["responses"][0, first_stop + 1 :] == tiny_tokenizer.pad_token_id).all()
    assert (stopped.batch["rollout_log_probs"][0, first_stop + 1 :] == 0).all()
    assert torch.equal(stopped.batch["responses"][0, : first_stop + 1], free[0, : first_stop + 1])


def test_n_samples_validate_and_overrides(rollout, tiny_tokenizer):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS[:2], {"n": 3})
    out = rollout.generate_sequences(prompts)
    assert len(out) == 6
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    val = encode_prompts(tiny_tokenizer, PROMPTS[:2], {"validate": True})
    first, second = rollout.generate_sequences(val), rollout.generate_sequences(val)
    assert len(first) == 2 and torch.equal(first.batch["responses"], second.batch["responses"])
    greedy = rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS[:2], {"do_sample": False}))
    assert torch.equal(greedy.batch["responses"], first.batch["responses"])


def test_update_weights_then_greedy_matches_source_model(tiny_llama_dir, tiny_tokenizer):
    source = build_causal_lm(tiny_llama_dir)
    other, _ = build_tiny_model(seed=5, tokenizer=tiny_tokenizer)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    reference = HFRollout(source, tiny_tokenizer, params)
    target = HFRollout(other, tiny_tokenizer, params)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    target.sleep()
    target.update_weights((name, p.detach()) for name, p in source.named_parameters())
    target.wake_up()
    expected = reference.generate_sequences(prompts).batch["responses"]
    assert torch.equal(target.generate_sequences(prompts).batch["responses"], expected)
    with pytest.raises(KeyError, match="no_such"):
        target.update_weights([("no_such.weight", torch.zeros(1))])


def test_sampling_params_validation_and_overrides():
    # temperature 0 (verl's way of asking for greedy) is normalised to do_sample=False, not refused
    zero = SamplingParams(temperature=0.0)
    assert zero.do_sample is False and zero.is_greedy and zero.log_prob_temperature == 1.0
    assert zero == SamplingParams(temperature=0.0, do_sample=False)
    with pytest.raises(ConfigFieldError, match=r"^temperature=-0.5 must be >= 0"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ConfigFieldError, match=r"^top_k=0 must be -1 \(disabled\) or >= 1"):
        SamplingParams(top_k=0)
    with pytest.raises(ConfigFieldError, match=r"^top_p=0.0 must be in \(0.0, 1.0\]"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)
    params = SamplingParams(temperature=0.8, n=4)
    assert not params.is_greedy and params.log_prob_temperature == 0.8
    greedy = params.greedy()
    assert greedy == SamplingParams(temperature=0.8, n=1, do_sample=False)
    assert greedy.is_greedy and greedy.log_prob_temperature == 1.0  # greedy log-probs are reported at T=1
    changed = params.with_overrides({"temperature": 0, "eos_token_id": 2})
    assert changed.do_sample is False and changed.log_prob_temperature == 1.0
    assert params.with_overrides(greedy.as_overrides()) == greedy


def test_sampling_params_from_config():
    rollout = RolloutConfig(temperature=0.7, top_p=0.9, top_k=5, n=4)
    params = SamplingParams.from_config(rollout, max_new_tokens=16)
    assert params == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, n=1, max_new_tokens=16)
    assert SamplingParams.from_config(rollout, 16, n=3).n == 3  # n is the call's, not config.n
    val = SamplingParams.from_config(rollout.val_kwargs, max_new_tokens=8)  # default validation: greedy
    assert val.do_sample is False and val.log_prob_temperature == 1.0 and val.max_new_tokens == 8
    zero = SamplingParams.from_config(SamplingConfig(temperature=0.0), 8)  # do_sample=True but temperature 0
    assert zero.is_greedy and zero.do_sample is False and zero.log_prob_temperature == 1.0


def test_greedy_log_probs_are_reported_at_temperature_one(tiny_llama_dir, tiny_tokenizer):
    """Greedy rollouts report log softmax(logits) whatever the configured temperature (one rule everywhere)."""
    params = SamplingParams(temperature=0.5, max_new_tokens=6, do_sample=False)
    out = HFRollout(build_causal_lm(tiny_llama_dir), tiny_tokenizer, params).generate_sequences(
        encode_prompts(tiny_tokenizer, PROMPTS)
    )
    engine = build_fsdp_engine(tiny_llama_dir, FSDPEngineConfig(micro_batch_size_per_gpu=2))
    mask = out.batch["response_mask"].bool()
    at_one, _ = engine.compute_log_prob(out, temperature=params.log_prob_temperature)
    torch.testing.assert_close(at_one[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    at_half, _ = engine.compute_log_prob(out, temperature=0.5)
    assert (at_half[mask] - out.batch["rollout_log_probs"][mask]).abs().max() > 1e-3


def test_registry_names_backends_and_rejects_unknown():
    assert set(ROLLOUTS.names()) >= {"hf", "native", "vllm"}
    with pytest.raises(KeyError, match="hf"):
        ROLLOUTS.get("sglang")


@pytest.mark.parametrize("shares", [False, True])
def test_sleep_never_moves_the_trainers_own_module(tiny_llama_dir, tiny_tokenizer, monkeypatch, shares):
    """On an accelerator, sleep/wake move a rollout's own copy off and back, but a module shared with the
    training engine (one rank) must stay where the trainer keeps it, and the device cache is not emptied then (the
    trainer's next update reuses those blocks)."""
    from hybridflow.engines.rollout import HFRollout, SamplingParams

    rollout = HFRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=2))
    rollout.shares_training_weights = shares
    rollout.device = torch.device("cuda", 0)  # what the rollout believes; nothing runs on it here
    moves: list[str] = []
    monkeypatch.setattr(rollout.model, "to", lambda device: moves.append(str(device)))
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: moves.append("empty_cache"))
    rollout.sleep()
    rollout.wake_up()
    assert moves == ([] if shares else ["cpu", "empty_cache", "cuda:0"])
