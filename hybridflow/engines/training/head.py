"""The output head of a causal-LM engine: project only the positions that predict response tokens, either through
the model's own head (logits of the kept positions) or fused with the log-prob computation (`chunked_log_probs`,
no (N, V) logits kept for the backward).

The fused head runs inside the model's forward: a pre-hook on the head module takes the final hidden states where
FSDP2 has gathered the head's weight, computes the log-probs (and entropy) chunk by chunk, and hands the head one
position per row so that the model's own projection costs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engines.training.chunked_projection import chunked_token_stats, project_logits
from hybridflow.engines.training.vocab_parallel import VocabShard, token_entropy, token_log_probs, token_sum_pi_squared

logger = logging.getLogger(__name__)

__all__ = ["Head", "TokenStats", "build_head", "output_head"]


def output_head(module: nn.Module, is_lora: bool) -> nn.Module:
    """The module that projects hidden states to the vocabulary (under peft's wrapper for LoRA models)."""
    hf_module = module.get_base_model() if is_lora else module
    return hf_module.get_output_embeddings()


@dataclass(frozen=True)
class TokenStats:
    """Which per-token statistics of the policy a forward returns beside the log-probs."""

    entropy: bool = False
    """`entropy` (differentiable: the update's entropy bonus reads it)."""
    sum_pi_squared: bool = False
    """`sum_pi_squared`, sum_v pi_v^2 of each position's distribution (not differentiable; verl's
    `calculate_sum_pi_squared`, read by the optimal-token-baseline estimator)."""


@dataclass(frozen=True)
class Head:
    """How a causal LM's kept positions become log-probs: `chunk_size` rows at a time fused with the head (None: the
    plain head's logits), with the vocabulary split as `shard` (tensor parallel) or whole (None)."""

    module: nn.Module
    chunk_size: int | None
    shard: VocabShard | None
    logit_multiplier: float = 1.0
    """What the model multiplies the head's output by before returning its logits (Cohere's `logit_scale`, Granite's
    1 / `logits_scaling`): the fused head, which projects the hidden states itself, folds it into the temperature.
    Measured at engine start (`forward_check`), never read from a config key (the same key means a product in one
    family and a quotient in another)."""
    logit_softcap: float | None = None
    """The model's soft cap on its logits (`final_logit_softcapping`: c * tanh(x / c), Gemma-2 and later), applied
    by the fused head as by the model; checked at engine start like the multiplier."""

    def log_probs(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        logits_to_keep: int | torch.Tensor,
        select: Callable[[torch.Tensor], torch.Tensor],
        labels: torch.Tensor,
        temperature: float,
        stats: TokenStats,
        *,
        rows: torch.Tensor | None = None,
        shard: VocabShard | None | str = "head",
    ) -> dict[str, torch.Tensor]:
        """Run `model` on `inputs` projecting `logits_to_keep` positions; `select` cuts the projected rows
        ((bs, kept, H) hidden states or (bs, kept, V) logits -> (N, H) / (N, V)) that predict `labels` (N,).
        Returns `log_probs` (N,) float32 under softmax(logits / temperature), and `entropy` / `sum_pi_squared` (N,)
        as `stats` asks.
        `rows` (N,) int64: label i reads selected row `rows[i]` (several labels share a row: a shared prompt's last
        token predicts every response's first one); the plain head then never copies (N, V) logits.
        `shard=None` overrides the head's vocabulary split (Ulysses: each rank projects the whole vocabulary)."""
        shard = self.shard if shard == "head" else shard
        if self.chunk_size is None:
            logits = model(**inputs, logits_to_keep=logits_to_keep).logits
            flat = select(logits).float() / temperature
            out = {"log_probs": token_log_probs(flat, labels, rows=rows, shard=shard)}
            if stats.entropy:
                out["entropy"] = token_entropy(flat, shard)
            if stats.sum_pi_squared:
                out["sum_pi_squared"] = token_sum_pi_squared(flat, shard)
            # per row, then per label: a shared row's statistics are computed once
            return {name: value[rows] if rows is not None and name != "log_probs" else value
                    for name, value in out.items()}
        pick = select if rows is None else (lambda hidden: select(hidden)[rows])
        return self._fused(model, inputs, logits_to_keep, pick, labels, temperature, stats, shard)

    def _fused(self, model, inputs, logits_to_keep, select, labels, temperature, stats: TokenStats, shard):
        result: dict[str, dict[str, torch.Tensor]] = {}

        def project(head: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            (hidden,) = args
            weight, bias = _local_weight_and_bias(head)
            result["out"] = chunked_token_stats(
                select(hidden), weight, labels, bias=bias, temperature=temperature / self.logit_multiplier,
                chunk_size=self.chunk_size, shard=shard, calculate_entropy=stats.entropy,
                calculate_sum_pi_squared=stats.sum_pi_squared, softcap=self.logit_softcap,
            )
            # The head still runs, on one position per row: DTensor's tensor-parallel head cannot take zero rows.
            return (hidden[..., :1, :],)

        # prepend: before tensor parallel's input hook, so that `hidden` is this rank's plain tensor
        handle = self.module.register_forward_pre_hook(project, prepend=True)
        try:
            model(**inputs, logits_to_keep=logits_to_keep)
        finally:
            handle.remove()
        return result["out"]

    def projection_and_logits(
        self, model: nn.Module, inputs: dict[str, Any], logits_to_keep: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head module's own projection of the last `logits_to_keep` positions (hidden @ weight.T + bias, this
        rank's vocabulary slice under tensor parallelism; soft-capped with `logit_softcap`) and the logits the model
        returns for them, float32: they differ where the model transforms its logits after the head otherwise."""
        projected: dict[str, torch.Tensor] = {}

        def project(head: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            projected["z"] = project_logits(args[0], *_local_weight_and_bias(head), self.logit_softcap)

        handle = self.module.register_forward_pre_hook(project, prepend=True)
        try:
            logits = model(**inputs, logits_to_keep=logits_to_keep).logits
        finally:
            handle.remove()
        return projected["z"], logits.float()


def _local_weight_and_bias(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias as this rank holds them (its vocabulary slice under tensor parallelism)."""
    return tuple(p.to_local() if isinstance(p, DTensor) else p for p in (head.weight, head.bias))


def build_head(module: nn.Module, *, is_lora: bool, fused: bool, chunk_size: int, shard: VocabShard | None) -> Head:
    """The causal LM's head; fused in chunks of `chunk_size` rows when asked and the head is a plain Linear (else
    one warning: a LoRA-wrapped head projects all kept positions at once)."""
    head = output_head(module, is_lora)
    if fused and not isinstance(head, nn.Linear):
        logger.warning(
            "use_fused_kernels: the output head is a %s, not a Linear (e.g. LoRA on lm_head); projecting all "
            "kept positions at once instead", type(head).__name__,
        )
        fused = False
    softcap = getattr(module.config.get_text_config(), "final_logit_softcapping", None) if fused else None
    return Head(module=head, chunk_size=chunk_size if fused else None, shard=shard,
                logit_softcap=float(softcap) if softcap else None)
