"""The hf rollout over a tensor-parallel group of 2 gloo ranks: transformers' generate on each rank's shard, with the
group's collectives hooked in, equals one rank's generate token for token (a dense llama, Qwen2-MoE with its
experts split whole over the group, DeepSeek-V3 with latent attention split by heads); sampling peers stay in
lock-step; a weight hand-over keeps each rank's block and the output follows it."""

from __future__ import annotations

import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.models import build_causal_lm, build_tiny_model, load_tokenizer
from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.moe import build_tiny_moe_model
from hybridflow.models.parallel_plan import param_shard_dim, rollout_plan_for
from hybridflow.models.reshard import shard_of, shard_shape
from tests.engines.helpers import encode_prompts, run_distributed
from tests.engines.rollout.native.test_tensor_parallel import KEYS, PROMPTS, _rollout_tp_mesh, _same_on_all_ranks

GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)
SAMPLED = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=8)


def _assert_same_output(out, expected, label: str) -> None:
    assert len(set(out.batch["responses"].flatten().tolist())) > 10, label  # varied tokens: the weights matter
    for key in KEYS:
        assert torch.equal(out.batch[key], expected.batch[key]), (label, key)
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)


def _hf_tensor_parallel(rank: int, world_size: int, dense_dir: str, newer_dir: str, moe_dirs: list[str]) -> None:
    tokenizer = load_tokenizer(dense_dir)
    mesh = _rollout_tp_mesh(world_size)
    prompts = encode_prompts(tokenizer, PROMPTS)
    original = dict(build_causal_lm(dense_dir).named_parameters())
    expected = HFRollout(build_causal_lm(dense_dir), tokenizer, GREEDY).generate_sequences(prompts)
    whole = HFRollout(build_causal_lm(dense_dir), tokenizer, GREEDY)
    for source in (dense_dir, build_causal_lm(dense_dir)):  # checkpoint slices / a module's tensors
        rollout = HFRollout(source, tokenizer, GREEDY, tp_mesh=mesh)
        assert rollout._kv_bytes_per_token * world_size == whole._kv_bytes_per_token  # its share of the heads' cache
        plan = rollout_plan_for(rollout.model.config.model_type)
        for name, local in rollout.model.named_parameters():  # only this rank's shard
            assert local.shape == shard_shape(original[name].shape, param_shard_dim(name, plan), world_size), name
        _assert_same_output(rollout.generate_sequences(prompts), expected, f"dense from {type(source).__name__}")
    # Sampling: peers seeded alike draw the same tokens from the same gathered logits.
    sampler = HFRollout(dense_dir, tokenizer, SAMPLED, tp_mesh=mesh)
    torch.manual_seed(7)
    sampled = sampler.generate_sequences(encode_prompts(tokenizer, PROMPTS, {"n": 2}))
    assert len(sampled) == 2 * len(PROMPTS)
    assert _same_on_all_ranks(sampled.batch["responses"]) and _same_on_all_ranks(sampled.batch["rollout_log_probs"])
    # A hand-over of other weights, one full tensor at a time: each rank keeps its block, the full tensors come back
    # bitwise, and generation follows the new weights.
    newer = build_causal_lm(newer_dir)
    rollout.update_weights((name, tensor.detach()) for name, tensor in newer.named_parameters())
    news = dict(newer.named_parameters())
    for name, local in rollout.model.named_parameters():
        assert torch.equal(local, shard_of(news[name].detach(), param_shard_dim(name, plan), rank, world_size)), name
    for name, full in rollout.named_weights():
        assert torch.equal(full, news[name].detach()), name
    expected = HFRollout(newer, tokenizer, GREEDY).generate_sequences(prompts)
    _assert_same_output(rollout.generate_sequences(prompts), expected, "after the hand-over")
    # Mixture-of-experts models: experts split whole over the group, routers and shared experts replicated.
    for moe_dir in moe_dirs:
        expected = HFRollout(build_causal_lm(moe_dir), tokenizer, GREEDY).generate_sequences(prompts)
        rollout = HFRollout(moe_dir, tokenizer, GREEDY, tp_mesh=mesh)
        _assert_same_output(rollout.generate_sequences(prompts), expected, moe_dir)


def test_hf_tp2_greedy_equals_tp1_and_hand_overs_reshard(tmp_path, tiny_tokenizer):
    dense = []
    for seed in (1, 5):
        model, tokenizer = build_tiny_model("llama", initializer_range=0.3, seed=seed, tokenizer=tiny_tokenizer)
        dense.append(str(save_model_and_tokenizer(model, tokenizer, tmp_path / f"llama_{seed}")))
    moe = []
    for arch in ("qwen2_moe", "deepseek_v3"):
        model, tokenizer = build_tiny_moe_model(arch, seed=1, tokenizer=tiny_tokenizer, initializer_range=0.3)
        moe.append(str(save_model_and_tokenizer(model, tokenizer, tmp_path / arch)))
    run_distributed(_hf_tensor_parallel, 2, *dense, moe)
