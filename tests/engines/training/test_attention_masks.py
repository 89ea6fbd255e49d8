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
    (_config(LlamaConfig, "flex_attention"), True),  # a block mask
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


def _shared_prompt_batch(vocab_size: int):
    data = make_batch(vocab_size, batch_size=8, prompt_len=6, response_len=5, seed=4)
    tensors = {key: data.batch[key].clone() for key in data.batch.keys()}
    for key in ("input_ids", "attention_mask", "position_ids"):
        for group in range(2):  # rows 0-3 and 4-7 share their first row's prompt
            tensors[key][group * 4 : group * 4 + 4, :6] = tensors[key][group * 4, :6]
    tensors["position_ids"] = (tensors["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return type(data).from_dict(tensors=tensors)


def _flex_and_sdpa(tiny_llama_dir, data, layout: str, train: bool) -> dict:
    """Per kernel: log-probs, and with `train` one update's gradients (the optimizer step skipped)."""
    from tests.engines.helpers import seq_mean_nll

    options = dict(share_prompts=True) if layout == "shared_prompts" else {}
    model = dict(use_remove_padding=True) if layout == "packed" else {}
    results = {}
    for attn in ("sdpa", "flex_attention"):
        config = FSDPEngineConfig(model=ModelConfig(override_config={"attn_implementation": attn}, **model),
                                  optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=8, **options)
        engine = build_fsdp_engine(tiny_llama_dir, config)
        assert engine.forward_model.prebuilt_masks
        results[attn] = [engine.compute_log_prob(data, micro_batch_size=8)[0]]
        if train:
            engine.optimizer.step = lambda *args, **kwargs: None  # keep the weights: compare the gradients
            engine.train_batch(data, seq_mean_nll)
            results[attn].append([param.grad.clone() for param in engine.module.parameters() if param.grad is not None])
    return results


@pytest.mark.slow  # inductor compiles flex's kernels for each shape: 45 s in a fresh clone (make test-all runs it)
@pytest.mark.slow  # compiling the block mask's creation takes about 20 s in a fresh clone
def test_block_masks_give_the_dense_masks_attention():
    """The block masks of a shared-prompt layout and of a packed row, run by flex_attention's reference (eager)
    implementation on CPU, give sdpa's output under the dense masks built from the same pattern: the masks flex
    kernels get on a GPU are the ones the sdpa forwards are tested with."""
    from torch.nn.attention.flex_attention import flex_attention

    from hybridflow.engines.training.attention_masks import block_mask, dense_mask, packed_allowed, packed_segments
    from hybridflow.engines.training.prefix_sharing import build_shared_prompt_layout

    data = _shared_prompt_batch(64)
    layout = build_shared_prompt_layout(data.batch["input_ids"], data.batch["attention_mask"],
                                        data.batch["position_ids"], response_length=5)
    positions = torch.cat([torch.arange(n) for n in (5, 9, 1, 7)])[None]
    cases = {
        "shared_prompts": (layout.allowed, layout.length, layout.groups, layout.attention_mask()),
        "packed": (packed_allowed(packed_segments(positions)), positions.size(1), 1,
                   dense_mask(packed_allowed(packed_segments(positions)), positions.size(1), positions.device)),
    }
    generator = torch.Generator().manual_seed(0)
    for name, (allowed, length, rows, dense) in cases.items():
        q, k, v = (torch.randn(rows, 4, length, 16, generator=generator) for _ in range(3))
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        got = flex_attention(q, k, v, block_mask=block_mask(allowed, length, torch.device("cpu"), rows=rows))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_a_cpu_engine_refuses_flex_attention_when_it_is_built(tiny_llama_dir):
    """flex_attention runs on CUDA ranks only (as flash_attention_2, which needs flash-attn besides); a CPU rank
    refuses it when its engine is built, naming the key and the kernel that does run there (the same rule refuses
    it before Ray starts)."""
    if torch.cuda.is_available():
        pytest.skip("the refusal is for CPU ranks")
    config = FSDPEngineConfig(model=ModelConfig(override_config={"attn_implementation": "flex_attention"}),
                              optim=OptimConfig(lr=1e-3))
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' runs on CUDA ranks only.*use sdpa"):
        build_fsdp_engine(tiny_llama_dir, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention runs on CUDA ranks only")
@pytest.mark.parametrize("layout", ["shared_prompts", "packed"])
def test_flex_attention_block_masks_give_the_sdpa_log_probs(tiny_llama_dir, tiny_tokenizer, layout):
    """flex_attention gets a block mask (no total x total tensor) and gives the dense-mask sdpa forward's numbers,
    for shared prompts and packed rows."""
    data = _shared_prompt_batch(len(tiny_tokenizer))
    mask = data.batch["response_mask"].bool()
    results = _flex_and_sdpa(tiny_llama_dir, data, layout, train=False)
    torch.testing.assert_close(results["flex_attention"][0][mask], results["sdpa"][0][mask], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward needs CUDA")
@pytest.mark.parametrize("layout", ["shared_prompts", "packed"])
def test_flex_attention_block_masks_give_the_sdpa_gradients(tiny_llama_dir, tiny_tokenizer, layout):
    data = _shared_prompt_batch(len(tiny_tokenizer))
    results = _flex_and_sdpa(tiny_llama_dir, data, layout, train=True)
    assert len(results["sdpa"][1]) > 0
    for flex_grad, sdpa_grad in zip(results["flex_attention"][1], results["sdpa"][1]):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=2e-2, atol=1e-4)  # bf16 autocast on both


@pytest.mark.slow  # compiling the block mask's creation takes about 20 s in a fresh clone
def test_block_mask_is_linear_in_tokens():
    """A 16k-token packed row's block mask: per-block tables, not a (16k x 16k) tensor (whose creation would also
    take a quarter of a gigabyte)."""
    from hybridflow.engines.training.attention_masks import block_mask, packed_allowed, packed_segments

    lengths = [700] * 23 + [16384 - 700 * 23]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = block_mask(packed_allowed(packed_segments(positions)), positions.size(1), positions.device)
    stored = sum(t.numel() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    assert stored < 16384 * 16384 / 1000, stored
    assert mask.shape[-2:] == (16384, 16384)
