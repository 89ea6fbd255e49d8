"""How a model family's weights split across tensor-parallel ranks, and which layouts a model can take.

One plan serves both sides of the hand-over: the training engine parallelizes its modules with it (DTensor
`ColwiseParallel` / `RowwiseParallel`) and the rollout engine slices the full weights it receives with it, so the
two layouts agree on what each rank holds. Names are the HF module names of the Llama / Qwen2 / Mistral family.
"""

from __future__ import annotations

from typing import Any, Literal

from hybridflow.models.moe_shape import moe_shape_of

Style = Literal["colwise", "rowwise", "vocab", "experts", "replicate"]

#: Per-module style of the Llama family's decoder layers and ends. `colwise` splits a Linear's output features
#: (weight dim 0, bias dim 0), `rowwise` its input features (weight dim 1; the outputs are summed over ranks),
#: `vocab` the vocabulary rows of the embedding and the head (weight dim 0).
LLAMA_TP_PLAN: dict[str, Style] = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "o_proj": "rowwise",
    "gate_proj": "colwise",
    "up_proj": "colwise",
    "down_proj": "rowwise",
    "embed_tokens": "vocab",
    "lm_head": "vocab",
}

#: model_type -> plan. Families whose modules carry the Llama names share its plan.
TP_PLANS: dict[str, dict[str, Style]] = {name: LLAMA_TP_PLAN for name in ("llama", "qwen2", "qwen3", "mistral")}

#: The rollout's plan for a mixture-of-experts family: Llama-named attention, dense layers and ends as in
#: LLAMA_TP_PLAN; the experts module's 3-D weights (experts, ..., ...) split whole experts over the group
#: (`experts`: dim 0, expert parallelism over the tensor-parallel ranks); routers and shared experts on every rank
#: (`replicate`, matched on the last two name parts before the generic `gate_proj`/`up_proj`/`down_proj`). Not
#: used by the training engine, whose tensor parallelism refuses mixture-of-experts models.
MOE_ROLLOUT_PLAN: dict[str, Style] = {
    **LLAMA_TP_PLAN,
    "experts": "experts",
    **{f"shared_expert.{name}": "replicate" for name in ("gate_proj", "up_proj", "down_proj")},  # Qwen2-MoE's
}
#: DeepSeek-V3: MoE_ROLLOUT_PLAN's experts, dense layers and ends, its shared experts replicated, and multi-head
#: latent attention split by heads. The query's and the latent's down-projections (`q_a_proj`, `kv_a_proj_with_mqa`)
#: and their norms are replicated, so every rank holds the whole latent cache; the up-projections (`q_b_proj`, or
#: `q_proj` for a full-rank query, and `kv_b_proj`) split their per-head output features, and `o_proj` its input
#: features, so each rank absorbs and attends with its own heads.
DEEPSEEK_V3_ROLLOUT_PLAN: dict[str, Style] = {
    **MOE_ROLLOUT_PLAN,
    **{f"shared_experts.{name}": "replicate" for name in ("gate_proj", "up_proj", "down_proj")},
    "q_a_proj": "replicate",
    "kv_a_proj_with_mqa": "replicate",
    "q_b_proj": "colwise",
    "kv_b_proj": "colwise",
}
ROLLOUT_PLANS: dict[str, dict[str, Style]] = {
    **TP_PLANS, **{name: MOE_ROLLOUT_PLAN for name in ("mixtral", "qwen2_moe", "qwen3_moe")},
    "deepseek_v3": DEEPSEEK_V3_ROLLOUT_PLAN,
}


def rollout_plan_for(model_type: str) -> dict[str, Style]:
    """The rollout's tensor-parallel plan of `model_type`: `tp_plan_for`'s, and for mixture-of-experts families the experts
    split whole over the group; a clear error for families without one."""
    if model_type not in ROLLOUT_PLANS:
        raise ValueError(
            f"the rollout has no tensor-parallel plan for model_type={model_type!r} (plans: "
            f"{sorted(ROLLOUT_PLANS)}); use tensor_model_parallel_size=1 for this model"
        )
    return ROLLOUT_PLANS[model_type]


def tp_plan_for(model_type: str) -> dict[str, Style]:
    """The plan of `model_type` (a HF config's `model_type`); a clear error for families without one."""
    if model_type not in TP_PLANS:
        raise ValueError(
            f"tensor parallelism has no plan for model_type={model_type!r} (plans: {sorted(TP_PLANS)}); use "
            "tensor_parallel_size=1 for this model, or add its plan to hybridflow.models.parallel_plan.TP_PLANS"
        )
    return TP_PLANS[model_type]


def module_style(module_name: str, plan: dict[str, Style]) -> Style | None:
    """The style of module `module_name` (an HF name such as `model.layers.0.self_attn.o_proj`): matched on its last
    two name parts first (`shared_expert.down_proj`), then on its last; None when the plan does not name it."""
    parts = module_name.split(".")
    style = plan.get(".".join(parts[-2:])) if len(parts) >= 2 else None
    return style or plan.get(parts[-1])


def param_shard_dim(name: str, plan: dict[str, Style]) -> int | None:
    """The dim along which parameter `name` (an HF name such as `model.layers.0.self_attn.q_proj.weight`) is split
    across tensor-parallel ranks, or None when every rank holds all of it (norms, a rowwise layer's bias)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    style = module_style(".".join(parts[:-1]), plan)
    if style is None or style == "replicate":
        return None
    if style == "rowwise":
        return 1 if parts[-1] == "weight" else None
    return 0


def check_tp_layout(config: Any, tp_size: int, key: str) -> None:
    """Refuse a tensor-parallel size the model cannot take: heads, key/value heads, the MLP's width and the
    vocabulary must divide evenly. `config` is a HF model config; `key` names the setting in errors."""
    if tp_size == 1:
        return
    tp_plan_for(getattr(config, "model_type", "?"))
    sizes = {**_head_counts(config), "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    _check_whole_shares(sizes, tp_size, key)


def check_rollout_tp_layout(config: Any, tp_size: int, key: str) -> None:
    """The rollout's tensor-parallel layouts: the query heads, the vocabulary and the MLP's width (a mixture-of-experts
    model's routed experts, split whole, and the width of its dense layers where it has some) divide by `tp_size`;
    the key/value heads divide by it, or `tp_size` is a multiple of them (each head is then replicated on
    `kv_replicas` ranks, as Megatron and vLLM do)."""
    if tp_size == 1:
        return
    rollout_plan_for(getattr(config, "model_type", "?"))
    heads = _head_counts(config)
    kv_heads = heads.pop("num_key_value_heads")
    shape = moe_shape_of(config)
    sizes = {**heads, "vocab_size": config.vocab_size}
    if shape is None:
        sizes["intermediate_size"] = config.intermediate_size
    else:
        sizes["routed experts"] = shape.num_experts
        dense_layers = (getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) > 1
                        or getattr(config, "first_k_dense_replace", 0) > 0)
        if dense_layers:
            sizes["intermediate_size"] = config.intermediate_size  # its dense layers split as a dense model's
    _check_whole_shares(sizes, tp_size, key)
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"{key}={tp_size} neither divides the model's num_key_value_heads={kv_heads} nor is a multiple of it: each "
            "rank holds a whole share of the key/value heads, or one head replicated on tp / num_key_value_heads "
            f"ranks; pick a divisor or a multiple of {kv_heads} that divides num_attention_heads"
        )


def kv_replicas(config: Any, tp_size: int) -> int:
    """On how many ranks of a rollout tensor-parallel group each key/value head sits (`head_replicas`)."""
    return head_replicas(_head_counts(config)["num_key_value_heads"], tp_size)


def head_replicas(kv_heads: int, group_size: int) -> int:
    """On how many ranks of a group (rollout tensor parallel, Ulysses) each key/value head sits: 1 when the group
    splits the heads, group_size / kv_heads when it has more ranks than heads (each rank then holds one head, the
    one its query heads attend with); ValueError when neither divides the other."""
    if kv_heads % group_size and group_size % kv_heads:
        raise ValueError(f"{group_size} ranks cannot share {kv_heads} key/value heads evenly")
    return group_size // kv_heads if group_size > kv_heads else 1


def kv_heads_per_rank(config: Any, tp_size: int) -> int:
    """The key/value heads one rank of a rollout tensor-parallel group holds."""
    kv_heads = _head_counts(config)["num_key_value_heads"]
    return max(kv_heads // tp_size, 1)


def _head_counts(config: Any) -> dict[str, int]:
    """The query and key/value head counts, which tensor- and sequence-parallel ranks take whole shares of."""
    heads = config.num_attention_heads
    return {"num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads}


def _check_whole_shares(sizes: dict[str, int], tp_size: int, key: str) -> None:
    """Each of the model's `sizes` (name -> count) divides by `tp_size`, or a ValueError naming it and its divisors."""
    for field_name, value in sizes.items():
        if value % tp_size:
            raise ValueError(
                f"{key}={tp_size} does not divide the model's {field_name}={value}: each tensor-parallel rank must "
                f"hold a whole share; pick a size that divides {field_name} "
                f"({', '.join(str(d) for d in _divisors(value) if d > 1) or 'none above 1'})"
            )


def check_sp_layout(config: Any, sp_size: int, key: str) -> None:
    """Refuse a Ulysses size the model cannot take: the all-to-all gives each rank whole attention heads, so the
    query heads must divide by it, and the key/value heads too, or it must be a multiple of them (each head is then
    repeated on sp / kv ranks before the all-to-all, as verl does)."""
    if sp_size == 1:
        return
    for field_name, value in _head_counts(config).items():
        if field_name == "num_key_value_heads" and sp_size > value and sp_size % value == 0:
            continue
        if value % sp_size:
            raise ValueError(
                f"{key}={sp_size} does not divide the model's {field_name}={value}: Ulysses gives each rank whole "
                f"heads; pick a size that divides {field_name} "
                f"({', '.join(str(d) for d in _divisors(value) if d > 1) or 'none above 1'})"
                + (" or a multiple of it" if field_name == "num_key_value_heads" else "")
            )


def check_ep_layout(config: Any, ep_size: int, key: str) -> None:
    """Refuse an expert-parallel size the model cannot take: a dense model, a family without transformers'
    expert-parallel plan, or routed experts that do not divide evenly."""
    if ep_size == 1:
        return
    shape = moe_shape_of(config)
    model_type = getattr(config, "model_type", "?")
    if shape is None:
        raise ValueError(f"{key}={ep_size}: model_type={model_type!r} has no experts to split (a dense model); set {key}=1")
    if not getattr(config, "base_model_ep_plan", None):
        raise ValueError(
            f"{key}={ep_size}: transformers has no expert-parallel plan for model_type={model_type!r}; set {key}=1"
        )
    if shape.num_experts % ep_size:
        raise ValueError(
            f"{key}={ep_size} does not divide the model's {shape.num_experts} routed experts per layer; pick a "
            f"divisor of {shape.num_experts} ({', '.join(str(d) for d in _divisors(shape.num_experts) if d > 1)})"
        )


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]
