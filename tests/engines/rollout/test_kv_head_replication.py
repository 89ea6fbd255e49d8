"""Rollout tensor parallelism over more ranks than key/value heads: each rank holds the one head its query heads
attend with (replicated on tp / kv ranks, as Megatron and vLLM do). A qwen2 (key/value biases included) with one
key/value head on 2 gloo ranks, or with 2 on 4 ranks, generates exactly as one rank does, in the native and the hf
engine, and its weights go in and come back whole, bitwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.models import build_causal_lm, build_tiny_model, load_tokenizer
from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.parallel_plan import LLAMA_TP_PLAN, check_rollout_tp_layout, kv_heads_per_rank, kv_replicas
from hybridflow.models.reshard import param_blocks
from tests.engines.helpers import encode_prompts, run_distributed
from tests.engines.rollout.native.test_tensor_parallel import PROMPTS, _rollout_tp_mesh
from tests.engines.rollout.test_hf_tensor_parallel import _assert_same_output

GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)
K_PROJ = "model.layers.0.self_attn.k_proj"


def _replicated_heads(rank: int, world_size: int, model_dir: str, newer_dir: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    mesh = _rollout_tp_mesh(world_size)
    prompts = encode_prompts(tokenizer, PROMPTS)
    config = build_causal_lm(model_dir).config
    head_dim = config.hidden_size // config.num_attention_heads
    original = dict(build_causal_lm(model_dir).named_parameters())
    newer = {name: t.detach() for name, t in build_causal_lm(newer_dir).named_parameters()}
    replicas = world_size // config.num_key_value_heads
    head = slice((rank // replicas) * head_dim, (rank // replicas + 1) * head_dim)  # e.g. tp 4, kv 2: ranks 2, 3 hold 1
    engines = {"native": lambda source, **kw: NativeRollout(source, tokenizer, GREEDY, kernels="torch", **kw),
               "hf": lambda source, **kw: HFRollout(source, tokenizer, GREEDY, **kw)}
    for label, build in engines.items():
        expected = build(build_causal_lm(model_dir)).generate_sequences(prompts)
        rollout = build(model_dir, tp_mesh=mesh)
        attention = rollout.model.get_submodule(K_PROJ.rpartition(".")[0])
        assert torch.equal(attention.k_proj.weight, original[f"{K_PROJ}.weight"][head]), label
        assert torch.equal(attention.k_proj.bias, original[f"{K_PROJ}.bias"][head]), label
        assert attention.q_proj.weight.shape[0] * world_size == config.hidden_size, label  # its query heads
        _assert_same_output(rollout.generate_sequences(prompts), expected, label)
        for name, full in rollout.named_weights():  # the replicated head comes back once
            assert torch.equal(full, original[name]), (label, name)
        rollout.update_weights(newer.items())
        assert torch.equal(attention.v_proj.weight, newer["model.layers.0.self_attn.v_proj.weight"][head]), label
        for name, full in rollout.named_weights():
            assert torch.equal(full, newer[name]), (label, name)


@pytest.mark.parametrize(
    ("world_size", "kv_heads"), [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)], ids=["tp2_kv1", "tp4_kv2"]
)
def test_more_ranks_than_key_value_heads_generate_as_one_rank(tmp_path, tiny_tokenizer, world_size, kv_heads):
    assert len(tiny_tokenizer) % world_size == 0
    dirs = []
    for seed in (1, 5):
        model, tokenizer = build_tiny_model("qwen2", num_kv_heads=kv_heads, initializer_range=0.3, seed=seed,
                                            tokenizer=tiny_tokenizer)
        assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == kv_heads
        dirs.append(str(save_model_and_tokenizer(model, tokenizer, tmp_path / f"qwen2_{seed}")))
    run_distributed(_replicated_heads, world_size, *dirs)


def _config(heads: int, kv_heads: int) -> SimpleNamespace:
    return SimpleNamespace(model_type="llama", num_attention_heads=heads, num_key_value_heads=kv_heads,
                           intermediate_size=96, vocab_size=96)


def test_layouts_with_replicated_heads_and_the_ones_refused():
    assert [kv_replicas(_config(8, 2), tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [kv_heads_per_rank(_config(8, 2), tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    check_rollout_tp_layout(_config(8, 2), 8, "tp")
    with pytest.raises(ValueError, match=r"tp=6 neither divides the model's num_key_value_heads=4 nor is a multiple"):
        check_rollout_tp_layout(_config(12, 4), 6, "tp")
    with pytest.raises(ValueError, match=r"tp=16 does not divide the model's num_attention_heads=8"):
        check_rollout_tp_layout(_config(8, 2), 16, "tp")
    # rank 5 of 8 with 2 heads replicated 4 times: block 1 of 2 for k/v; its own block of 8 elsewhere
    assert param_blocks(f"{K_PROJ}.weight", LLAMA_TP_PLAN, 5, 8, 4) == (0, 1, 2)
    assert param_blocks(f"{K_PROJ}.bias", LLAMA_TP_PLAN, 5, 8, 4) == (0, 1, 2)
    assert param_blocks("model.layers.0.self_attn.q_proj.weight", LLAMA_TP_PLAN, 5, 8, 4) == (0, 5, 8)
    assert param_blocks("model.layers.0.self_attn.o_proj.weight", LLAMA_TP_PLAN, 5, 8, 4) == (1, 5, 8)
