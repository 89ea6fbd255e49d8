"""Mixture-of-experts families beyond the four the project builds its own tiny models for: every family in
`ROUTED_MODEL_TYPES` has its routers found (one per MoE layer, as `moe_shape_of` counts them), and every family in
`REPLAY_MODEL_TYPES` is replayed exactly (its own choice gives back its own weights and outputs). Families outside
them are refused before Ray for router replay and router losses, and a router whose weighting replay does not know
stops the first replayed forward."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.engines.training.moe import build_moe_routing
from hybridflow.models.config import ModelConfig
from hybridflow.models.moe import (
    ROUTED_EXPERTS_KEY,
    check_replayed_weights,
    find_routers,
    moe_shape_of,
    record_routing,
    replay_routing,
)
from hybridflow.models.router_kinds import read_routing
from hybridflow.models.moe_shape import (
    REPLAY_MODEL_TYPES,
    ROUTED_MODEL_TYPES,
    MoeShape,
    moe_routing_unsupported_reason,
)
from hybridflow.trainer.config import load_config, validate_config
from tests.engines.helpers import encode_prompts
from tests.helpers import grpo_overrides, nothing_started, write_rows
from tests.model_families import build_family_model, save_family_model

ATTENTION = {"gpt_oss": "eager"}  # gpt-oss has no sdpa path in transformers
# "llama4" (the multimodal config) routes with its text model, built as "llama4_text"
VARIANTS = [(t, {}) for t in ROUTED_MODEL_TYPES if t != "llama4"] + [
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False}),
    ("olmoe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"decoder_sparse_step": 2}),  # every second layer holds experts
    ("hunyuan_v1_moe", {"moe_topk": 2}),  # Hunyuan's own top-k key (the default variant routes top-1)
    ("llama4_text", {"moe_layers": [1]}),  # Llama-4 lists its MoE layers
    ("afmoe", {"route_scale": 2.5}),
]


def _own_choice_check(routers):
    """Forward hooks that check, for each router call, that replay's weighting of its own choice is its own."""
    return [router.register_forward_hook(lambda r, args, out: check_replayed_weights(r, *read_routing(r, out))) for router in routers]


@pytest.mark.parametrize(("model_type", "overrides"), VARIANTS, ids=lambda v: str(v) if isinstance(v, str) else "")
def test_each_family_has_one_router_per_moe_layer_and_replays_exactly(tiny_tokenizer, model_type, overrides):
    model = build_family_model(model_type, tiny_tokenizer, ATTENTION.get(model_type, "sdpa"), **overrides).eval()
    routers, shape = find_routers(model), moe_shape_of(model.config)
    assert routers and len(routers) == shape.num_moe_layers
    ids = torch.randint(3, len(tiny_tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as recorder:
        logits = model(ids, use_cache=False).logits
    routed = recorder.per_token(2)
    assert routed.shape == (2, 9, len(routers), shape.top_k) and int(routed.max()) < shape.num_experts
    if model_type not in REPLAY_MODEL_TYPES:
        with pytest.raises(ValueError, match=r"router replay cannot weigh PhimoeTopKRouter's experts"):
            with torch.no_grad():
                handles = _own_choice_check(routers)
                try:
                    model(ids, use_cache=False)
                finally:
                    for handle in handles:
                        handle.remove()
        return
    handles = _own_choice_check(routers)
    try:
        with torch.no_grad(), replay_routing(model, routed.reshape(-1, *routed.shape[2:])):
            replayed = model(ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    assert (replayed - logits).abs().max().item() < 1e-5
    other = (routed + 1) % shape.num_experts  # another choice of experts routes otherwise: the replay acts
    with torch.no_grad(), replay_routing(model, other.reshape(-1, *other.shape[2:])):
        assert (model(ids, use_cache=False).logits - logits).abs().max().item() > 1e-3


def test_a_multimodal_config_routes_with_its_text_model():
    from transformers import Llama4Config

    llama4 = Llama4Config(text_config={"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 1,
                                       "interleave_moe_layer_step": 2})
    assert moe_shape_of(llama4) == MoeShape(8, 1, 2)  # its text model's: every second layer
    assert moe_routing_unsupported_reason(llama4.to_dict(), replay=True) is None


@pytest.mark.parametrize("model_type", ["olmoe", "gpt_oss", "glm4_moe", "granitemoe", "hunyuan_v1_moe", "afmoe",
                                        "llama4_text"])
def test_the_engine_trains_more_families_with_router_metrics_and_replay(tmp_path, tiny_tokenizer, model_type):
    """The training engine's log-probs equal the hf rollout's, its routing metrics are logged, and router replay
    (R3) routes every token as the rollout recorded."""
    attn = ATTENTION.get(model_type, "sdpa")
    path = save_family_model(tmp_path / model_type, model_type, tiny_tokenizer, attn)
    model = build_family_model(model_type, tiny_tokenizer, attn)
    rollout = HFRollout(model, tiny_tokenizer, SamplingParams(temperature=1.0, max_new_tokens=5))
    rollout.record_routed_experts = True
    out = rollout.generate_sequences(encode_prompts(tiny_tokenizer, ["hello there", "what is 12 + 7?"]))
    engine = build_fsdp_engine(path, FSDPEngineConfig(micro_batch_size_per_gpu=2, model=ModelConfig(
        use_remove_padding=model_type not in ("gpt_oss", "afmoe"), override_config={"attn_implementation": attn})))
    mask = out.batch["response_mask"].bool()
    with record_routing(engine.module) as recorder:
        log_probs, _ = engine.compute_log_prob(out)
    assert (log_probs - out.batch["rollout_log_probs"])[mask].abs().max().item() < 1e-4
    real = out.batch["attention_mask"].reshape(-1).bool()
    routed = out.batch[ROUTED_EXPERTS_KEY].reshape(-1, *out.batch[ROUTED_EXPERTS_KEY].shape[2:])[real].long()
    last = torch.zeros_like(out.batch["attention_mask"], dtype=torch.bool)
    last[:, -1] = True  # the rollout never feeds its last token back
    compare = ~last.reshape(-1)[real]
    seen = recorder.per_token(1)[0]
    seen = seen if seen.size(0) == int(real.sum()) else seen[real]  # the padded forward routes its padding too
    assert torch.equal(seen.sort(-1).values[compare], routed.sort(-1).values[compare])
    metrics = engine.train_batch(out, lambda o, mb: ((o["log_probs"] * mb.batch["response_mask"]).sum() * 0, {}))
    assert metrics["moe/router_entropy"] > 0 and metrics["moe/layer_0/tokens_per_expert_max"] >= 1


def test_an_moe_without_hooked_routers_refuses_router_losses(tiny_tokenizer):
    model = build_family_model("jetmoe", tiny_tokenizer)  # its JetMoeTopKGating has another shape
    assert moe_shape_of(model.config) is not None and not find_routers(model)
    assert build_moe_routing(model) is None  # trains, without routing metrics (a warning says so)
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.01
    with pytest.raises(ValueError, match=r"no router it hooks in model type 'jetmoe'.*output_router_logits"):
        build_moe_routing(model)


def test_routing_support_by_family():
    assert moe_routing_unsupported_reason({"model_type": "llama"}, replay=True) is None  # dense: nothing to route
    assert moe_routing_unsupported_reason({"model_type": "olmoe", "num_experts": 8}, replay=True) is None
    assert "phimoe" in moe_routing_unsupported_reason({"model_type": "phimoe", "num_local_experts": 8}, replay=True)
    assert moe_routing_unsupported_reason({"model_type": "phimoe", "num_local_experts": 8}, replay=False) is None
    assert "'jetmoe'" in moe_routing_unsupported_reason({"model_type": "jetmoe", "num_local_experts": 8}, replay=False)


R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]


@pytest.mark.parametrize(("model_type", "extra", "config", "message"), [
    ("phimoe", R3, {}, r"router_replay.mode='R3' cannot replay .*'phimoe' is not among"),
    ("jetmoe", R3, {}, r"router_replay.mode='R3' cannot replay .*'jetmoe' is not among"),
    ("jetmoe", [], {"output_router_logits": True, "router_aux_loss_coef": 0.01},
     r"sets output_router_logits with router_aux_loss_coef=0.01.*set output_router_logits=false"),
])
def test_unserved_routing_is_refused_before_ray(tmp_path, tiny_tokenizer, model_type, extra, config, message):
    path = save_family_model(tmp_path / model_type, model_type, tiny_tokenizer, **config)
    train_file = write_rows(tmp_path / "train.parquet", ["gsm8k", "reasoning_gym/basic_arithmetic"] * 8)
    overrides = grpo_overrides(train_file, f"actor_rollout_ref.model.path={path}")
    with nothing_started():
        with pytest.raises(ValueError, match=message):
            validate_config(load_config(overrides + extra))
        if not config:
            validate_config(load_config(overrides))  # the same model without replay is accepted
