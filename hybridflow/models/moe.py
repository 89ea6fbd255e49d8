"""Mixture-of-experts models: tiny MoE builders for tests, finding a model's routers, and recording or replaying
the experts each token is routed to (router replay, R3).

Routers are found and read by `router_kinds` (the shapes of transformers' routers). Recording reads each router's
chosen experts with a forward hook; replay replaces them (and the weights, recomputed from the same logits at the
replayed experts, so gradients still reach the router) with the recorded experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from hybridflow.models.loader import prepare_tokenizer, save_model_and_tokenizer
from hybridflow.models.moe_shape import MoeShape, moe_shape_of
from hybridflow.models.router_kinds import (
    check_replayed_weights,
    find_routers,
    read_routing,
    replayed_weights,
    write_routing,
)
from hybridflow.models.tiny import build_tiny_tokenizer

__all__ = [
    "MOE_ARCHS", "MoeArch", "MoeShape", "build_tiny_moe_model", "save_tiny_moe_model", "moe_shape_of", "find_routers",
    "RoutingRecorder", "record_routing", "replay_routing", "replayed_weights", "check_replayed_weights",
    "ROUTED_EXPERTS_KEY",
]

ROUTED_EXPERTS_KEY = "routed_experts"
"""Batch key of the rollout's recorded experts: (bs, seq, moe_layers, k) integers (uint8 up to 256 experts), one
row per input position (prompt then response; the last response token, never fed back, holds 0)."""

MoeArch = Literal["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"]
MOE_ARCHS: tuple[str, ...] = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


def _tiny_config(arch: str, common: dict, num_experts: int, top_k: int, hidden: int) -> PretrainedConfig:
    moe = dict(num_experts_per_tok=top_k, moe_intermediate_size=hidden)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, num_experts=num_experts, norm_topk_prob=True, head_dim=hidden // 4)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, **moe, num_experts=num_experts, shared_expert_intermediate_size=hidden)
    if arch == "mixtral":
        return MixtralConfig(**common, num_experts_per_tok=top_k, num_local_experts=num_experts)
    if arch == "deepseek_v3":
        # MLA with small ranks; one dense layer first, then routed + shared experts (DeepSeek-V3's layout).
        # MLA keeps one key/value head per query head (GQA breaks its sdpa path with a padding mask).
        return DeepseekV3Config(
            **{**common, "num_key_value_heads": common["num_attention_heads"]}, **moe, n_routed_experts=num_experts, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, rope_interleave=False,
        )
    raise ValueError(f"arch={arch!r} is not a known MoE architecture; use one of {MOE_ARCHS}")


def build_tiny_moe_model(
    arch: MoeArch = "qwen3_moe",
    num_layers: int = 2,
    hidden: int = 64,
    num_experts: int = 4,
    top_k: int = 2,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    initializer_range: float = 0.1,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A small random MoE causal LM (float32, sdpa) and its tokenizer; the same `seed` gives the same weights.

    `num_experts` routed experts per MoE layer of `hidden` units each, `top_k` per token; Qwen2-MoE adds a gated
    shared expert, DeepSeek-V3 a shared expert and a dense first layer. A larger `initializer_range` gives peaked
    output distributions (greedy decoding then has no near-ties). The global torch RNG is left untouched.
    """
    tokenizer = prepare_tokenizer(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        initializer_range=initializer_range, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = _tiny_config(arch, common, num_experts, top_k, hidden)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model, tokenizer


def save_tiny_moe_model(path, arch: MoeArch = "qwen3_moe", seed: int = 0, tokenizer=None, **shape):
    """`build_tiny_moe_model(arch, seed=seed, **shape)` saved with its tokenizer to `path` (returned)."""
    model, tokenizer = build_tiny_moe_model(arch, seed=seed, tokenizer=tokenizer, **shape)
    return save_model_and_tokenizer(model, tokenizer, path)


class RoutingRecorder:
    """Collects each router call's `top_k_index` while active: `calls[layer]` is the list of (tokens, k) tensors,
    one per forward (prefill, then each decode step)."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers]
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self.calls[layer].append(read_routing(module, output)[2].detach())

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def routed_experts(self, num_rows: int, seq_len: int, num_experts: int) -> torch.Tensor:
        """`per_token` right-padded with 0 to `seq_len` positions, in the smallest integer type that holds
        `num_experts`: (num_rows, seq_len, layers, k)."""
        routed = self.per_token(num_rows)
        dtype = torch.uint8 if num_experts <= 256 else torch.int32
        out = routed.new_zeros((num_rows, seq_len, *routed.shape[2:]), dtype=dtype)
        out[:, : routed.size(1)] = routed[:, :seq_len].to(dtype)
        return out

    def per_token(self, num_rows: int) -> torch.Tensor:
        """(num_rows, tokens, layers, k) int64: every forward's experts in order, each forward's tokens as
        (num_rows, its length) rows (a prefill of the prompts, then one column per decode step)."""
        layers = []
        for calls in self.calls:
            layers.append(torch.cat([c.reshape(num_rows, -1, c.size(-1)) for c in calls], dim=1))
        return torch.stack(layers, dim=2)


@contextlib.contextmanager
def record_routing(module: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the experts every router of `module` picks while the context is open."""
    recorder = RoutingRecorder(find_routers(module))
    try:
        yield recorder
    finally:
        recorder.close()


@contextlib.contextmanager
def replay_routing(module: nn.Module, routed_experts: torch.Tensor) -> Iterator[None]:
    """Route every token of the forwards run inside the context to the recorded experts.

    Args:
        routed_experts: (tokens, layers, k) integer: for each token the model will see (in the order its routers
            see them: the flattened (bs, seq) input, or the packed row) and each MoE layer, the experts to use.
    """
    routers = find_routers(module)
    if routed_experts.size(1) != len(routers):
        raise ValueError(f"routed_experts has {routed_experts.size(1)} layers; the model has {len(routers)} routers")

    def hook_for(layer: int):
        def hook(router, args, output):
            logits = read_routing(router, output)[0]
            index = routed_experts[:, layer].to(device=logits.device, dtype=torch.long)
            if index.size(0) != logits.size(0):
                raise ValueError(f"router replay: {index.size(0)} recorded tokens for a forward of {logits.size(0)}")
            return write_routing(router, output, logits, index)

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
