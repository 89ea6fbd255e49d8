"""A probe at engine start: the engine's own forward (its packed, shared-prompt or Ulysses layout, its fused head)
computes what the model's plain padded forward computes, on a small random batch, or the engine refuses to start.

The layouts and the fused head re-implement parts of a transformers forward: they pack rows, build masks, and
project the hidden states to the vocabulary themselves. An architecture that does something they do not (a
recurrent or linear-attention layer that carries state across packed sequences, an attention kernel that ignores
packed position ids, logits scaled or soft-capped after the head) would otherwise train on wrong log-probs without
a sign. Measured on transformers' own families: Cohere's `logit_scale` under the fused head (log-prob error 1.4),
gpt-oss's packed rows (0.95), MiniMax's linear-attention layers packed (0.34).

A scale the model applies to the head's output is measured here and folded into the fused head's temperature
(`Head.logit_multiplier`); any other difference stops the engine with the setting to change. The probe is three
or four forwards of a few dozen tokens, run alike on every rank (the collectives of FSDP2, TP and EP need them all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from hybridflow.engines.training.layouts import LayoutName, padded_inputs
from hybridflow.protocol import DataProto

FSDPEngine = Any
"""The engine the probe runs on (`fsdp.FSDPEngine`, which calls the probe: not imported here)."""

logger = logging.getLogger(__name__)

__all__ = ["ForwardMismatchError", "ProbeTolerance", "check_engine_forward", "probe_batch", "probe_tolerance"]

PROMPT_LENGTH, RESPONSE_LENGTH = 6, 5
PROBE_SEED = 1234


class ForwardMismatchError(ValueError):
    """The engine's forward computes other values than the model's plain forward: a setting must change."""


def probe_batch(vocab_size: int) -> DataProto:
    """Four rollout-shaped rows (left-padded prompts, right-padded responses), the same on every rank: prompts of
    different lengths, two rows sharing one prompt (a shared-prompt group), responses of different lengths."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    width = PROMPT_LENGTH + RESPONSE_LENGTH
    ids = torch.randint(0, vocab_size, (4, width), generator=gen)
    ids[1, :PROMPT_LENGTH] = ids[0, :PROMPT_LENGTH]
    prompt_lengths = torch.tensor([PROMPT_LENGTH, PROMPT_LENGTH, 3, 5])
    response_lengths = torch.tensor([RESPONSE_LENGTH, 3, 4, RESPONSE_LENGTH])
    cols = torch.arange(width)
    prompt_mask = cols[None, :PROMPT_LENGTH] >= PROMPT_LENGTH - prompt_lengths[:, None]
    response_mask = cols[None, :RESPONSE_LENGTH] < response_lengths[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    ids = torch.where(attention_mask.bool(), ids, 0)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "responses": ids[:, PROMPT_LENGTH:], "response_mask": response_mask.long(),
    })


@dataclasses.dataclass(frozen=True)
class ProbeTolerance:
    """Accepted differences between two forwards of the same weights, per response token: the largest, the mean,
    and the relative residual of the logits after their best scale."""

    max_abs: float
    mean_abs: float
    residual: float


def probe_tolerance(compute_dtype: torch.dtype) -> ProbeTolerance:
    """float32 only reorders sums (about 1e-6 measured). In bf16 the probe's random tokens (log-probs near -18)
    move a lot: SmolLM2-135M's packed and padded bf16 forwards differ by 0.087 on average and 0.25 at most on the
    probe batch (CPU), more than the smallest error found in float32 (MiniMax packed: mean 0.17). So a sharded
    half-precision engine (which cannot compute the probe in float32) is stopped only by gross errors; the config
    rules before Ray and the float32 tests carry the rest."""
    if compute_dtype == torch.float32:
        return ProbeTolerance(max_abs=1e-3, mean_abs=1e-3, residual=1e-4)
    return ProbeTolerance(max_abs=5.0, mean_abs=0.5, residual=2e-2)


def check_engine_forward(engine: FSDPEngine) -> None:
    """Run the probe on `engine` (a causal LM or value model, just built): raise `ForwardMismatchError` naming the
    setting to change, and set the fused head's measured logit multiplier. A no-op when the engine runs the plain
    padded forward with the model's own head (nothing to compare)."""
    layout = engine.layout_name
    fused = engine.head is not None and engine.head.chunk_size is not None
    if layout == "padded" and not fused:
        return
    work = dict(engine._work)
    batch = probe_batch(engine.module.config.get_text_config().vocab_size)
    key = "values" if engine.model_kind == "value" else "log_probs"
    mask = batch.batch["response_mask"].bool()
    # An unsharded engine computes under autocast over float32 weights: the probe runs it in float32 (bfloat16
    # weights compute in bfloat16 either way).
    compute_dtype = engine.param_dtype if engine.is_sharded else engine.weight_dtype
    tolerance = probe_tolerance(compute_dtype)
    was_training = engine.module.training
    engine.module.eval()
    try:
        with torch.no_grad(), _without_autocast(engine):
            with _plain_head(engine), _inner_attention(engine):
                reference = _run(engine, batch, "padded")[key]
            if fused:
                _measure_logit_multiplier(engine, batch, tolerance)
                with _inner_attention(engine):
                    _compare(_run(engine, batch, "padded")[key], reference, mask, tolerance, _fused_fix(engine))
            if layout != "padded":
                got = _run(engine, batch, layout)[key]
                _compare(got, reference, mask, tolerance, _layout_fix(engine, layout))
    finally:
        engine.module.train(was_training)
        engine._work = work
        _reshard(engine.module)


def _reshard(module: torch.nn.Module) -> None:
    """Free the gathered weights: FSDP2's root keeps its parameters unsharded after a forward (for the backward it
    expects next); the engine starts from sharded ones, as it would without the probe."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _run(engine: FSDPEngine, batch: DataProto, layout: LayoutName) -> dict[str, torch.Tensor]:
    plan = engine.plan_micro_batches([batch], layout=layout)[0]
    return {key: value.float().cpu() for key, value in engine.forward_micro_batch(batch, plan=plan).items()}


def _compare(
    got: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, tolerance: ProbeTolerance, fix: str
) -> None:
    error = (got - reference)[mask].abs()
    largest, mean = error.max().item(), error.mean().item()
    logger.debug("forward probe: largest difference %.3g, mean %.3g", largest, mean)
    if not (largest <= tolerance.max_abs and mean <= tolerance.mean_abs):  # NaN fails too
        raise ForwardMismatchError(
            f"{fix} (difference on a probe batch: largest {largest:.3g}, mean {mean:.3g}; accepted "
            f"{tolerance.max_abs:g} and {tolerance.mean_abs:g})"
        )


@contextlib.contextmanager
def _without_autocast(engine: FSDPEngine) -> Iterator[None]:
    """An unsharded engine's forwards in its float32 weights' precision while the context is open."""
    if engine.is_sharded:
        yield
        return
    engine._autocast = contextlib.nullcontext
    try:
        yield
    finally:
        del engine._autocast  # the class's method again


@contextlib.contextmanager
def _plain_head(engine: FSDPEngine) -> Iterator[None]:
    """The model's own head projects the logits (the fused head steps aside) while the context is open."""
    if engine.head is None or engine.head.chunk_size is None:
        yield
        return
    fused_model = engine.forward_model
    engine.forward_model = dataclasses.replace(fused_model, head=dataclasses.replace(engine.head, chunk_size=None))
    try:
        yield
    finally:
        engine.forward_model = fused_model


@contextlib.contextmanager
def _inner_attention(engine: FSDPEngine) -> Iterator[None]:
    """Under Ulysses, the attention kernel the Ulysses one wraps (a padded forward runs whole rows on each rank)."""
    if engine.sp_group is None:
        yield
        return
    ulysses_kernel = engine.module.config._attn_implementation
    engine.module.set_attn_implementation(engine.config.attn_implementation)
    try:
        yield
    finally:
        engine.module.set_attn_implementation(ulysses_kernel)


def _measure_logit_multiplier(engine: FSDPEngine, batch: DataProto, tolerance: ProbeTolerance) -> None:
    """Fit the model's logits as a multiple of the head's projection; fold a scale into the fused head, refuse
    anything else (a soft cap, an added term)."""
    tensors = {key: batch.batch[key].to(engine.device) for key in ("input_ids", "attention_mask", "position_ids")}
    with _inner_attention(engine), engine._autocast():
        projected, logits = engine.head.projection_and_logits(
            engine.module, padded_inputs(engine.forward_model, tensors), RESPONSE_LENGTH + 1
        )
    z, out = projected.reshape(-1).double(), logits.reshape(-1).double()
    multiplier = float((z * out).sum() / (z * z).sum().clamp_min(1e-30))
    residual = float((out - multiplier * z).abs().max() / out.abs().max().clamp_min(1e-30))
    if not (math.isfinite(multiplier) and multiplier > 0 and residual <= tolerance.residual):
        raise ForwardMismatchError(
            f"use_fused_kernels=True: {type(engine.module).__name__} transforms its logits after the output head in a "
            f"way the fused head cannot reproduce (e.g. a soft cap: relative residual {residual:.3g} after the best "
            f"scale {multiplier:.4g}); set actor_rollout_ref.model.use_fused_kernels=False"
        )
    if abs(multiplier - 1.0) > tolerance.residual:
        logger.info("fused head: the model scales its logits by %.6g after the head; folded into the temperature",
                    multiplier)
        engine.head = dataclasses.replace(engine.head, logit_multiplier=multiplier)
        engine.forward_model = dataclasses.replace(engine.forward_model, head=engine.head)


def _fused_fix(engine: FSDPEngine) -> str:
    return (
        f"use_fused_kernels=True: the fused output head's log-probs differ from {type(engine.module).__name__}'s own "
        "head; set actor_rollout_ref.model.use_fused_kernels=False"
    )


def _layout_fix(engine: FSDPEngine, layout: LayoutName) -> str:
    name = type(engine.module).__name__
    if layout == "shared_prompts":
        return (
            f"use_prefix_grouper=True: {name}'s shared-prompt rows compute other values than its padded forward; "
            "set actor_rollout_ref.actor.use_prefix_grouper=False"
        )
    if engine.sp_group is not None:
        return (
            f"ulysses_sequence_parallel_size={engine.layout.sp}: {name}'s sequence-parallel forward computes other "
            "values than its padded forward (its attention is not the one the Ulysses kernel wraps); set "
            "ulysses_sequence_parallel_size=1"
        )
    return (
        f"use_remove_padding=True: {name}'s packed rows compute other values than its padded forward (a layer that "
        "carries state across the packed sequences, or attention that ignores packed position ids); set "
        "use_remove_padding=False for this model (actor_rollout_ref.model / critic.model)"
    )
