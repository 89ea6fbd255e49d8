"""The routers of transformers' mixture-of-experts families, by the shape of what they return: how to find them in
a model, read which experts they chose, weigh a replayed choice as they would, and hand a replayed choice back.

Most families (Qwen2/3-MoE, Mixtral, DeepSeek-V3, OLMoE, gpt-oss, GLM-4-MoE, Hunyuan-MoE, AFMoE, ...) return
`(router_logits (tokens, E), top_k_weights (tokens, k), top_k_index (tokens, k))`, which their MoE block hands to
its experts. Llama-4's router returns `(router_scores (tokens, E), router_logits)`: the chosen experts' sigmoid
scores with zeros elsewhere, by which every expert's input is scaled. A new family registers its `RouterKind` in
`ROUTER_KINDS`; the tests build each family tiny and check that replaying its own choice gives back its outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ROUTER_KINDS", "RouterKind", "find_routers", "read_routing", "write_routing", "replayed_weights",
           "check_replayed_weights"]


def _topk_weights(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Top-k routers' weighting of experts `index` from `logits`, by the router's own flags."""
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3, GLM-4-MoE: sigmoid scores, the bias only selects
        weights = logits.float().sigmoid().gather(1, index)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    if hasattr(router, "route_scale"):  # AFMoE: sigmoid scores renormalised, then scaled (its bias only selects)
        weights = logits.float().sigmoid().gather(1, index)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * router.route_scale
    if getattr(router, "expert_selection_fn", "softmax") == "sigmoid":  # Cohere2-MoE's sigmoid mode
        weights = logits.float().gather(1, index).sigmoid()
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype)
    weights = torch.softmax(logits.float(), dim=-1).gather(1, index)
    # A softmax over the chosen logits (Mixtral, gpt-oss, Granite, Cohere2) is the renormalised one; Qwen's, OLMoE's
    # and Hunyuan's renormalise when norm_topk_prob is set (Hunyuan always does, and has no flag).
    if getattr(router, "norm_topk_prob", True) or hasattr(router, "expert_selection_fn"):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


@dataclass(frozen=True)
class RouterKind:
    """One shape of router.

    matches: whether a module is such a router;
    read: (router, its output) -> (logits (tokens, E), weights (tokens, k), index (tokens, k));
    weigh: (router, logits, index) -> the weights the router gives experts `index` (gradients reach the logits);
    write: (router, its output, weights, index) -> the output with that choice in place of its own."""

    matches: Callable[[nn.Module], bool]
    read: Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    weigh: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    write: Callable[[nn.Module, Any, torch.Tensor, torch.Tensor], Any]


_TOPK_ROUTER_CLASSES = ("HunYuanMoEV1Gate", "AfmoeTokenChoiceRouter")  # top-k routers under other class names


def _llama4_read(router: nn.Module, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores, logits = output
    index = torch.topk(logits, router.top_k, dim=1).indices  # the router's own choice (its topk of the logits)
    return logits, scores.gather(1, index), index


def _llama4_write(router: nn.Module, output, weights: torch.Tensor, index: torch.Tensor):
    scores, logits = output
    return torch.zeros_like(scores).scatter(1, index, weights.to(scores.dtype)), logits


ROUTER_KINDS: dict[str, RouterKind] = {
    "topk": RouterKind(
        matches=lambda m: type(m).__name__.lower().endswith("topkrouter") or type(m).__name__ in _TOPK_ROUTER_CLASSES,
        read=lambda router, output: output,
        weigh=_topk_weights,
        write=lambda router, output, weights, index: (output[0], weights.to(output[1].dtype), index),
    ),
    "llama4": RouterKind(
        matches=lambda m: type(m).__name__ == "Llama4Router",
        read=_llama4_read,
        weigh=lambda router, logits, index: logits.float().gather(1, index).sigmoid().to(logits.dtype),
        write=_llama4_write,
    ),
}


def router_kind(module: nn.Module) -> RouterKind | None:
    return next((kind for kind in ROUTER_KINDS.values() if kind.matches(module)), None)


def find_routers(module: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (empty for a dense model, or a family no `RouterKind` matches)."""
    return [sub for sub in module.modules() if router_kind(sub) is not None]


def read_routing(router: nn.Module, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, weights, index) from a router's output."""
    return router_kind(router).read(router, output)


def write_routing(router: nn.Module, output, logits: torch.Tensor, index: torch.Tensor):
    """The router's `output` with experts `index` chosen, weighed from its `logits` (`read_routing`'s) as the router
    weighs them."""
    kind = router_kind(router)
    return kind.write(router, output, kind.weigh(router, logits, index), index)


def replayed_weights(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The weights `router` gives the experts `index` (tokens, k) from its `logits` (tokens, E), as its own forward
    would had it chosen them."""
    return router_kind(router).weigh(router, logits, index)


def check_replayed_weights(router: nn.Module, logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> None:
    """Raise unless `replayed_weights` gives back the router's own `weights` for its own choice `index`: replay
    would otherwise weigh the replayed experts unlike the router (a family whose weighting it does not know)."""
    expected = replayed_weights(router, logits, index).float()
    error = (expected - weights.float()).abs().max().item()
    tolerance = 1e-4 if logits.dtype == torch.float32 else 2e-2
    if not error <= tolerance:
        raise ValueError(
            f"router replay cannot weigh {type(router).__name__}'s experts as the router does (largest difference "
            f"{error:.3g} replaying its own choice): set actor_rollout_ref.actor.router_replay.mode=disabled and "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=False"
        )
