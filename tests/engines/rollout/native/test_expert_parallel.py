"""Expert parallelism of the native rollout over its tensor-parallel group, on 2 gloo ranks: a mixture-of-experts
model's experts split whole (each rank holds E / 2), attention and vocabulary split as a dense model's (DeepSeek-V3's
latent attention by heads, its latent replicated), routers and shared experts replicated. Greedy output equals one
rank's token for token, and a weight hand-over keeps each rank's experts and gives back the full tensors bitwise."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import NativeRollout, SamplingParams
from hybridflow.models import build_causal_lm, load_tokenizer
from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.moe import build_tiny_moe_model
from hybridflow.models.parallel_plan import (
    DEEPSEEK_V3_ROLLOUT_PLAN, MOE_ROLLOUT_PLAN, check_rollout_tp_layout, param_shard_dim, rollout_plan_for,
)
from hybridflow.models.reshard import shard_of
from tests.engines.helpers import encode_prompts, run_distributed
from tests.engines.rollout.native.test_tensor_parallel import KEYS, PROMPTS, _rollout_tp_mesh

GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)


def _expert_parallel(rank: int, world_size: int, model_dir: str, newer_dir: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    prompts = encode_prompts(tokenizer, PROMPTS)
    full = build_causal_lm(model_dir)
    expected = NativeRollout(build_causal_lm(model_dir), tokenizer, GREEDY, max_num_seqs=3).generate_sequences(prompts)
    rollout = NativeRollout(model_dir, tokenizer, GREEDY, max_num_seqs=3, tp_mesh=_rollout_tp_mesh(world_size))
    num_experts = next(getattr(full.config, key) for key in ("num_local_experts", "num_experts", "n_routed_experts")
                       if getattr(full.config, key, None))
    plan = rollout_plan_for(full.config.model_type)
    for name, module in rollout.model.named_modules():
        if name.endswith(".experts"):  # this rank's block of whole experts
            assert module.num_experts == num_experts // world_size and module.gate_up_proj.shape[0] == module.num_experts
    originals = dict(full.named_parameters())
    for name, local in rollout.model.named_parameters():
        assert torch.equal(local, shard_of(originals[name].detach(), param_shard_dim(name, plan), rank,
                                           world_size)), name
    out = rollout.generate_sequences(prompts)
    assert len(set(out.batch["responses"].flatten().tolist())) > 10
    for key in KEYS:
        assert torch.equal(out.batch[key], expected.batch[key]), key
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)
    # A hand-over of other weights: each rank keeps its experts, the full tensors come back bitwise, and the
    # output follows the new weights.
    newer = build_causal_lm(newer_dir)
    rollout.update_weights((name, tensor.detach()) for name, tensor in newer.named_parameters())
    news = dict(newer.named_parameters())
    for name, gathered in rollout.named_weights():
        assert torch.equal(gathered, news[name].detach()), name
    expected = NativeRollout(newer, tokenizer, GREEDY, max_num_seqs=3).generate_sequences(prompts)
    again = rollout.generate_sequences(prompts)
    assert torch.equal(again.batch["responses"], expected.batch["responses"])


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", pytest.param("mixtral", marks=pytest.mark.slow),
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_ep2_over_the_rollout_group_equals_one_rank(arch, tmp_path, tiny_tokenizer):
    """Qwen2-MoE (with its replicated gated shared expert) and DeepSeek-V3 (latent attention split by heads, a dense
    first layer split as a dense model's, a replicated shared expert) in the default suite; Mixtral and Qwen3-MoE
    in the slow tier (Qwen2-MoE's path)."""
    dirs = []
    for seed in (1, 2):
        model, tokenizer = build_tiny_moe_model(arch, seed=seed, tokenizer=tiny_tokenizer, initializer_range=0.3)
        dirs.append(str(save_model_and_tokenizer(model, tokenizer, tmp_path / f"{arch}_{seed}")))
    run_distributed(_expert_parallel, 2, *dirs)


def test_the_rollout_layout_check_splits_experts_not_their_width(tiny_tokenizer):
    """A mixture-of-experts model's experts must divide by the group; the experts' own width is not split."""
    config = build_tiny_moe_model("mixtral", tokenizer=tiny_tokenizer)[0].config  # 4 experts, 4 heads, 2 kv heads
    check_rollout_tp_layout(config, 2, "tp")
    config.intermediate_size = 129  # each expert whole on one rank: an odd width is fine
    check_rollout_tp_layout(config, 2, "tp")
    config.num_local_experts = 6  # (its 2 key/value heads are replicated on 2 ranks each at tp=4)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's routed experts=6.*\(2, 3, 6\)"):
        check_rollout_tp_layout(config, 4, "tp")
    assert param_shard_dim("model.layers.0.mlp.experts.gate_up_proj", MOE_ROLLOUT_PLAN) == 0
    assert param_shard_dim("model.layers.0.mlp.shared_expert.down_proj.weight", MOE_ROLLOUT_PLAN) is None
    assert param_shard_dim("model.layers.0.mlp.gate.weight", MOE_ROLLOUT_PLAN) is None
    assert param_shard_dim("model.layers.0.mlp.down_proj.weight", MOE_ROLLOUT_PLAN) == 1  # a dense layer's


def test_deepseek_v3_splits_latent_attention_by_heads_and_checks_its_dense_layer(tiny_tokenizer):
    """The latent's projections and norms stay whole on every rank; the per-head up-projections split their rows and
    o_proj its columns; the dense first layer's width must divide."""
    config = build_tiny_moe_model("deepseek_v3", tokenizer=tiny_tokenizer)[0].config  # 4 heads, 4 experts
    plan = rollout_plan_for("deepseek_v3")
    assert plan is DEEPSEEK_V3_ROLLOUT_PLAN
    attn = "model.layers.0.self_attn."
    for name in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert param_shard_dim(attn + name, plan) is None, name
    assert [param_shard_dim(attn + name, plan) for name in ("q_b_proj.weight", "kv_b_proj.weight", "q_proj.weight",
                                                           "o_proj.weight")] == [0, 0, 0, 1]
    assert param_shard_dim("model.layers.1.mlp.shared_experts.down_proj.weight", plan) is None
    assert param_shard_dim("model.layers.1.mlp.gate.e_score_correction_bias", plan) is None
    check_rollout_tp_layout(config, 2, "tp")
    config.intermediate_size = 129  # the dense first layer splits its width
    with pytest.raises(ValueError, match="tp=2 does not divide the model's intermediate_size=129"):
        check_rollout_tp_layout(config, 2, "tp")
