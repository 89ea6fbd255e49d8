"""The training forwards' own dense attention masks give transformers' numbers, and are used only where they apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.attention_masks import (
    causal_padding_mask, for_kernel, packed_causal_mask, takes_prebuilt_mask,
)
from hybridflow.models.config import ModelConfig
from tests.engines.helpers import make_batch


def test_causal_padding_mask_hides_the_future_and_the_padding():
    mask = causal_padding_mask(torch.tensor([[0, 1, 1], [1, 1, 0]]))
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[False, False, False], [False, True, False], [False, True, True]]
    assert mask[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]


def test_packed_causal_mask_starts_a_sequence_wherever_the_position_does_not_follow():
    # three sequences: 0 1 2 | 0 1 | 5 6 (a restart at any position, as transformers reads packed rows)
    mask = packed_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 5, 6]]))[0, 0]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for start, stop in ((0, 3), (3, 5), (5, 7)):
        expected[start:stop, start:stop] = torch.ones(stop - start, stop - start).tril().bool()
    assert torch.equal(mask, expected)


def test_for_kernel_gives_sdpa_a_bool_mask_and_eager_an_additive_one():
    allowed = torch.tensor([[True, False]])
    assert for_kernel(allowed, "sdpa", torch.bfloat16) is allowed
    additive = for_kernel(allowed, "eager", torch.bfloat16)
    assert additive.dtype == torch.bfloat16 and additive.tolist() == [[0.0, torch.finfo(torch.bfloat16).min]]
    with pytest.raises(ValueError, match="flex_attention"):
        for_kernel(allowed, "flex_attention", torch.float32)


def _config(cls, attn: str, **sizes):
    config = cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, **sizes)
    config._attn_implementation = attn
    return config


@pytest.mark.parametrize(("config", "expected"), [
    (_config(LlamaConfig, "sdpa"), True),
    (_config(LlamaConfig, "eager"), True),
    (_config(LlamaConfig, "flash_attention_2"), False),  # takes no dense mask
    (_config(LlamaConfig, "flex_attention"), False),  # a block mask
    (_config(Qwen2Config, "sdpa"), True),  # its sliding window is off by default
    (_config(Qwen2Config, "sdpa", use_sliding_window=True, sliding_window=8, max_window_layers=1), False),
    (_config(MistralConfig, "sdpa", sliding_window=8), False),
    (_config(MistralConfig, "sdpa", sliding_window=None), True),
    (_config(MixtralConfig, "sdpa", sliding_window=None), False),  # its router loss reads the 2D mask
], ids=["llama-sdpa", "llama-eager", "flash", "flex", "qwen2", "qwen2-window", "mistral-window", "mistral", "moe"])
def test_prebuilt_masks_only_where_one_mask_serves_every_layer(config, expected):
    assert takes_prebuilt_mask(config) is expected


LAYOUTS = {
    "padded": dict(),
    "packed": dict(use_remove_padding=True),
    "packed_fused_head": dict(use_remove_padding=True, use_fused_kernels=True),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_and_entropy_match_transformers_own_masks(tiny_llama_dir, tiny_tokenizer, layout, attn):
    config = FSDPEngineConfig(
        model=ModelConfig(override_config={"attn_implementation": attn}, **LAYOUTS[layout]), optim=OptimConfig(lr=1e-3)
    )
    engine = build_fsdp_engine(tiny_llama_dir, config)
    assert engine.forward_model.prebuilt_masks and engine.forward_model.attn_kernel == attn
    data = make_batch(len(tiny_tokenizer), batch_size=8, prompt_len=7, response_len=6, seed=3)
    ours = engine.compute_log_prob(data, calculate_entropy=True, micro_batch_size=4)
    engine.forward_model = dataclasses.replace(engine.forward_model, prebuilt_masks=False)
    theirs = engine.compute_log_prob(data, calculate_entropy=True, micro_batch_size=4)
    mask = data.batch["response_mask"].bool()
    for mine, reference in zip(ours, theirs):
        assert torch.isfinite(mine[mask]).all()
        torch.testing.assert_close(mine[mask], reference[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_values_match_transformers_own_masks(tiny_llama_dir, tiny_tokenizer, layout):
    config = FSDPEngineConfig(model=ModelConfig(**LAYOUTS[layout]), optim=OptimConfig(lr=1e-3))
    engine = build_fsdp_engine(tiny_llama_dir, config, model_kind="value")
    data = make_batch(len(tiny_tokenizer), batch_size=6, prompt_len=5, response_len=4, seed=7)
    ours = engine.compute_values(data, micro_batch_size=3)
    engine.forward_model = dataclasses.replace(engine.forward_model, prebuilt_masks=False)
    theirs = engine.compute_values(data, micro_batch_size=3)
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(ours[mask], theirs[mask], rtol=1e-5, atol=1e-5)


def test_eager_shared_prompt_forward_gives_the_padded_log_probs(tiny_llama_dir, tiny_tokenizer):
    """Shared prompts pass their own block mask: eager attention must get it additive, not as 0/1 added to scores."""
    data = make_batch(len(tiny_tokenizer), batch_size=8, prompt_len=6, response_len=5, seed=4)
    tensors = {key: data.batch[key].clone() for key in data.batch.keys()}
    for key in ("input_ids", "attention_mask", "position_ids"):
        for group in range(2):  # rows 0-3 and 4-7 share their first row's prompt
            tensors[key][group * 4 : group * 4 + 4, :6] = tensors[key][group * 4, :6]
    tensors["position_ids"] = (tensors["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    data = type(data).from_dict(tensors=tensors)
    results = {}
    for name, share in (("padded", False), ("shared", True)):
        config = FSDPEngineConfig(share_prompts=share, model=ModelConfig(override_config={"attn_implementation": "eager"}),
                                  optim=OptimConfig(lr=1e-3))
        results[name] = build_fsdp_engine(tiny_llama_dir, config).compute_log_prob(data, micro_batch_size=8)[0]
    mask = tensors["response_mask"].bool()
    torch.testing.assert_close(results["shared"][mask], results["padded"][mask], rtol=1e-5, atol=1e-5)


def test_shared_prompts_refuse_flex_attention():
    """flex_attention's compiled score function aborted the process on a dense mask: refused before any work.
    (flash_attention_2 is refused the same way where flash-attn is installed, and for its absence here.)"""
    from hybridflow.utils.config import ConfigFieldError

    with pytest.raises(ConfigFieldError, match="flex_attention does not take; use sdpa or eager") as refused:
        FSDPEngineConfig(share_prompts=True, model=ModelConfig(override_config={"attn_implementation": "flex_attention"}))
    assert "attn_implementation" in str(refused.value.field)
