"""The training engine's mixture-of-experts hooks: capture each router's logits and choices during a forward (router
losses and routing metrics), and replay recorded experts (router replay, R3) so that the training forward routes
every token as the rollout did.

`MoeRouting` keeps one forward hook per router for the engine's lifetime. Before each micro-batch the engine calls
`begin(micro_batch, plan, attention_mask)`: it sets the experts to replay (or none) and starts capturing; `end()`
returns the router loss and metrics of that forward. The replay experts stay set until the next `begin`, so that
activation checkpointing's recompute in the backward routes alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.algorithms.router_losses import (
    compute_load_balancing_loss,
    compute_router_metrics,
    compute_router_z_loss,
)
from hybridflow.engines.training.config import RouterReplayConfig
from hybridflow.models.moe import ROUTED_EXPERTS_KEY, moe_shape_of
from hybridflow.models.router_kinds import check_replayed_weights, find_routers, read_routing, write_routing

logger = logging.getLogger(__name__)

__all__ = [
    "ROUTED_EXPERTS_KEY", "MoeRouting", "RouterReplayConfig", "RouterLossCoefs", "add_router_loss", "build_moe_routing", "moe_forward",
    "replay_tokens",
]


@dataclass(frozen=True)
class RouterLossCoefs:
    """Weights of the router losses added to the training loss (0: not added; the metrics are logged anyway)."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0


def router_loss_coefs_of(config) -> RouterLossCoefs:
    """transformers' convention: the load-balancing loss is added with `router_aux_loss_coef` when the model config
    sets `output_router_logits`; `router_z_loss_coef` (ST-MoE; absent: 0) likewise."""
    if not getattr(config, "output_router_logits", False):
        return RouterLossCoefs()
    return RouterLossCoefs(
        float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0), float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)
    )


def replay_tokens(routed_experts: torch.Tensor, layout: str, kept: torch.Tensor | None) -> torch.Tensor:
    """The recorded experts of the tokens a forward in `layout` runs, in the order its routers see them.

    routed_experts: (bs, seq, L, k); kept: the packed layout's flat indices of real tokens -> (tokens, L, k)."""
    flat = routed_experts.reshape(-1, *routed_experts.shape[2:])
    if layout == "padded":
        return flat
    if layout == "packed" and kept is not None:
        return flat[kept]
    raise ValueError(
        f"router replay runs the padded or packed forward only, not {layout!r} (use_prefix_grouper / Ulysses): "
        "set actor_rollout_ref.actor.router_replay.mode=disabled or use the padded/packed layout"
    )


class MoeRouting:
    """Forward hooks on every router of one model (see the module docstring)."""

    def __init__(self, routers: list[nn.Module], num_experts: int, coefs: RouterLossCoefs) -> None:
        self.routers = routers
        self.num_experts = num_experts
        self.coefs = coefs
        self._replay: torch.Tensor | None = None
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._replay_checked: set[int] = set()
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(router, args, output):
            logits, weights, index = read_routing(router, output)
            if self._replay is not None:
                if layer not in self._replay_checked:  # once per router: one host sync per engine
                    check_replayed_weights(router, logits, weights, index)
                    self._replay_checked.add(layer)
                index = self._replay[:, layer].to(device=logits.device, dtype=torch.long)
                if index.size(0) != logits.size(0):
                    raise ValueError(f"router replay: {index.size(0)} recorded tokens, the forward has {logits.size(0)}")
                output = write_routing(router, output, logits, index)
            if self._captured is not None and len(self._captured) == layer:  # skip activation-checkpoint recomputes
                self._captured.append((logits, index))
            return output

        return hook

    def begin(self, replay: torch.Tensor | None, capture: bool) -> None:
        """Start a forward: replay (tokens, L, k) experts (None: route freely); capture logits when `capture`."""
        self._replay = replay
        self._captured = [] if capture else None

    def end(self, token_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The captured forward's `router_loss` (weighted sum, 0-dim, differentiable) and `moe/*` metrics."""
        captured, self._captured = self._captured, None
        if not captured:
            return {}
        logits = torch.stack([c[0] for c in captured])
        selected = torch.stack([c[1] for c in captured])
        out: dict[str, torch.Tensor] = dict(compute_router_metrics(logits, selected, self.num_experts, token_mask))
        loss = logits.new_zeros((), dtype=torch.float32)
        if self.coefs.aux_loss_coef:
            aux = compute_load_balancing_loss(logits, selected, self.num_experts, token_mask)
            out["moe/aux_loss"] = aux.detach()
            loss = loss + self.coefs.aux_loss_coef * aux
        if self.coefs.z_loss_coef:
            z = compute_router_z_loss(logits, token_mask)
            out["moe/z_loss"] = z.detach()
            loss = loss + self.coefs.z_loss_coef * z
        out["router_loss"] = loss
        return out


def build_moe_routing(module: nn.Module) -> MoeRouting | None:
    """Hooks for `module`'s routers (read from its HF config), or None for a dense model."""
    hf_config = module.config
    shape = moe_shape_of(hf_config)
    routers = find_routers(module)
    if shape is None:
        return None
    coefs = router_loss_coefs_of(hf_config)
    if not routers:
        if coefs != RouterLossCoefs():
            raise ValueError(
                f"{type(module).__name__}'s config sets output_router_logits with router loss coefficients, but the "
                f"engine finds no router it hooks in model type {hf_config.model_type!r}: set output_router_logits="
                "false in its config.json (the losses would not be added)"
            )
        logger.warning(
            "%s has %d experts per MoE layer but no router the engine hooks (model type %r): no routing metrics, "
            "router losses or router replay for it", type(module).__name__, shape.num_experts, hf_config.model_type,
        )
        return None
    logger.info("MoE model: %d routers, %d experts, top-%d; router losses %s", len(routers), shape.num_experts,
                shape.top_k, coefs)
    return MoeRouting(routers, shape.num_experts, coefs)


def moe_forward(
    routing: MoeRouting | None, micro_batch, tensors: dict[str, torch.Tensor], plan, forward: Callable[[], dict]
) -> dict[str, torch.Tensor]:
    """Run `forward()` (one micro-batch in `plan`'s layout) with `routing`'s hooks: replaying the micro-batch's
    `routed_experts` when it has them, capturing the routers (router loss and metrics) when autograd is on."""
    if routing is None:
        return forward()
    batch = micro_batch.batch if hasattr(micro_batch, "non_tensor_batch") else micro_batch
    replay = None
    if ROUTED_EXPERTS_KEY in batch.keys():
        kept = plan.packed.kept if plan.packed is not None else None
        replay = replay_tokens(batch[ROUTED_EXPERTS_KEY].to(tensors["input_ids"].device), plan.layout, kept)
    routing.begin(replay, capture=torch.is_grad_enabled())
    outputs = forward()
    mask = tensors["attention_mask"].reshape(-1) if plan.layout == "padded" else None
    outputs.update(routing.end(mask))
    return outputs


def add_router_loss(
    loss_and_metrics: tuple[torch.Tensor, Mapping], outputs: dict[str, torch.Tensor], num_micro_batches: int
) -> tuple[torch.Tensor, dict]:
    """A micro-batch's loss plus its `router_loss` (divided by `num_micro_batches` when the engine does not weight
    the loss by rows), with the `moe/*` metrics added to the loss function's metrics; unchanged for dense models."""
    loss, metrics = loss_and_metrics
    if "router_loss" not in outputs:
        return loss, metrics
    moe_metrics = {key: value for key, value in outputs.items() if key.startswith("moe/")}
    return loss + outputs["router_loss"] / num_micro_batches, {**metrics, **moe_metrics}
