"""Forward layouts of the training engine: how a micro-batch's rows go through the model and come back as per-token
log-probs (and entropy, sum of squared probabilities) or values.

- padded: the (bs, seq) batch as it is, with its attention mask;
- packed (`use_remove_padding`): the real tokens of every row in one row, position ids restarting per sequence;
- packed over a Ulysses group (`ulysses_sequence_parallel_size > 1`): each rank runs a slice of the packed row;
- shared prompts (`use_prefix_grouper`): one row per prompt group, holding that prompt once and then its responses.

Each layout has a plan built on the host before the micro-batch loop (`plan_micro_batches`): index tensors from
host copies of the masks, moved to the device without blocking, and the work counts as Python ints. The forwards
themselves then never wait on the device: no `.item()`, `.tolist()`, boolean-mask indexing or `torch.unique` in
the loop (issue 25), so the host can run ahead of an accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybridflow.engines.training import attention_masks, ulysses
from hybridflow.engines.training.batches import get
from hybridflow.engines.training.head import Head, TokenStats
from hybridflow.engines.training.prefix_sharing import SharedPromptLayout, build_shared_prompt_layout
from hybridflow.models.vision import concat_multi_modal_inputs
from hybridflow.protocol import DataProto
from hybridflow.utils.device import to_device_async
from hybridflow.utils.flops import ForwardWork

__all__ = [
    "ForwardModel", "PackedPlan", "Plan", "plan_micro_batches", "forward_layout", "token_values", "host_copies",
    "padded_inputs",
    "vision_inputs",
]

LayoutName = Literal["padded", "packed", "shared_prompts"]


@dataclass(frozen=True)
class ForwardModel:
    """What a layout needs of the engine: the module, whether it is a value model, its head (causal LMs), the
    Ulysses group (None: none), and how its attention masks are made (`attention_masks`)."""

    module: nn.Module
    is_value: bool
    head: Head | None
    sp_group: dist.ProcessGroup | None
    attn_kernel: str = "sdpa"
    prebuilt_masks: bool = False
    """The padded and packed layouts pass dense causal masks (False: transformers builds them)."""
    mask_dtype: torch.dtype = torch.float32
    """The dtype of the model's activations (eager attention's additive mask)."""

    def dense_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """`allowed` (bool) in the form this model's attention kernel takes, when it takes a dense mask."""
        if self.attn_kernel not in attention_masks.DENSE_MASK_KERNELS:
            return allowed
        return attention_masks.for_kernel(allowed, self.attn_kernel, self.mask_dtype)

    @property
    def takes_block_mask(self) -> bool:
        return self.attn_kernel == "flex_attention"


@dataclass(frozen=True)
class PackedPlan:
    """Where the real tokens of a (bs, seq) micro-batch go in one packed row, and which packed positions predict
    the response tokens (the window: columns seq - response_len - 1 ... seq - 2), all built on the host."""

    kept: torch.Tensor
    """(total,) int64: flat index in (bs * seq) of each real token, row-major (the packed row's order)."""
    window_src: torch.Tensor
    """(n,) int64: packed index of each real window position (ascending)."""
    window_next: torch.Tensor
    """(n,) int64: packed index of the token each window position predicts (its label; clamped at the end)."""
    window_dst: torch.Tensor
    """(n,) int64: flat index in (bs * response_len) of the response token it predicts."""
    host_window_src: np.ndarray
    """`window_src` on the host (Ulysses picks each rank's share of it)."""
    num_tokens: int


@dataclass(frozen=True)
class Plan:
    """A micro-batch's host-built plan: its layout's index tensors and what its forward computes."""

    layout: LayoutName
    response_length: int
    work: ForwardWork
    packed: PackedPlan | None = None
    shared: SharedPromptLayout | None = None


def host_copies(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Host (numpy) copies of `tensors` with one device-to-host transfer for all of them."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu().numpy()
    pieces = np.split(flat, np.cumsum([t.numel() for t in tensors])[:-1])
    return [piece.reshape(tuple(t.shape)) for piece, t in zip(pieces, tensors)]


def _padded_work(mask: np.ndarray, response_length: int, projects: bool) -> ForwardWork:
    lengths = mask.sum(-1).astype(np.int64)
    projected = int(mask[:, -response_length:].sum()) if projects else 0
    return ForwardWork(int(lengths.sum()), int((lengths * lengths).sum()), projected)


def plan_packed(mask: np.ndarray, response_length: int, device: torch.device) -> PackedPlan:
    """The packing of a (bs, seq) micro-batch whose real tokens are where `mask` (host) is nonzero."""
    keep = mask.astype(bool)
    bs, seq = keep.shape
    flat_keep = keep.reshape(-1)
    kept = np.flatnonzero(flat_keep)
    packed_index = (np.cumsum(flat_keep) - 1).reshape(bs, seq)
    first = seq - response_length - 1
    in_window = np.zeros_like(keep)
    in_window[:, first : seq - 1] = keep[:, first : seq - 1]
    rows, cols = np.nonzero(in_window)
    src = packed_index[rows, cols]
    dst = rows * response_length + (cols - first)
    nxt = np.minimum(src + 1, max(len(kept) - 1, 0))  # wrong only past a sequence's end: never used
    return PackedPlan(
        kept=to_device_async(kept, device), window_src=to_device_async(src, device),
        window_next=to_device_async(nxt, device), window_dst=to_device_async(dst, device),
        host_window_src=src, num_tokens=len(kept),
    )


def plan_micro_batches(
    layout: LayoutName,
    micro_batches: Sequence[DataProto],
    device: torch.device,
    *,
    projects: bool,
    response_length: int | None = None,
) -> list[Plan]:
    """One plan per micro-batch, from one host copy of all their `attention_mask`s (and, for shared prompts,
    `input_ids` and `position_ids`): one synchronisation per pass, none per micro-batch. `projects`: the model
    projects response positions to the vocabulary (a causal LM). `response_length` defaults to the width of the
    micro-batches' `responses`."""
    keys = ("attention_mask", "input_ids", "position_ids") if layout == "shared_prompts" else ("attention_mask",)
    host = host_copies([get(mb, key) for key in keys for mb in micro_batches])
    count = len(micro_batches)
    if response_length is None:
        widths = {get(mb, "responses").size(1) for mb in micro_batches}
        assert len(widths) == 1, f"micro-batches of one pass share their response width, got {sorted(widths)}"
        (response_length,) = widths
    plans = []
    for index, mask in enumerate(host[:count]):
        if layout == "shared_prompts":
            shared = build_shared_prompt_layout(
                host[count + index], mask, host[2 * count + index], response_length, device=device
            )
            work = ForwardWork(shared.num_tokens, shared.attention_pairs, shared.num_predicted if projects else 0)
            plans.append(Plan(layout, response_length, work, shared=shared))
            continue
        work = _padded_work(mask, response_length, projects)
        packed = plan_packed(mask, response_length, device) if layout == "packed" else None
        plans.append(Plan(layout, response_length, work, packed=packed))
    return plans


def vision_inputs(
    multi_modal_inputs: Sequence[dict[str, torch.Tensor]], tensors: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """A vision-language micro-batch's images (its rows' pixel values and grids, concatenated in row order) and its
    (bs, 4, seq) position ids as the model takes them, (4, bs, seq); for the padded and packed layouts."""
    images = concat_multi_modal_inputs(list(multi_modal_inputs))
    images = {key: value.to(device, non_blocking=True) for key, value in images.items()}
    return {**images, "position_ids": tensors["position_ids"].transpose(0, 1)}


def _scatter(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(n,) values at flat `index` of a zero (rows, cols) tensor (differentiable in `values`)."""
    return values.new_zeros(shape[0] * shape[1]).index_put((index,), values).view(shape)


def _outputs(stats: dict[str, torch.Tensor], place) -> dict[str, torch.Tensor]:
    """Each per-token statistic (log-probs, entropy, ...) placed into (bs, response_len)."""
    return {name: place(value) for name, value in stats.items()}


def forward_layout(
    model: ForwardModel, tensors: dict[str, torch.Tensor], plan: Plan, temperature: float, stats: TokenStats
) -> dict[str, torch.Tensor]:
    """`log_probs` (and `stats`' `entropy`, `sum_pi_squared`) (bs, response_len) of a causal LM, or `values`
    (bs, response_len) of a value model (the value at the token before each response token), computed in `plan`'s
    layout."""
    if plan.layout == "shared_prompts":
        return _forward_shared_prompts(model, tensors, plan.shared, temperature, stats)
    if plan.layout == "packed":
        if model.sp_group is not None:
            return _forward_packed_ulysses(model, tensors, plan, temperature, stats)
        return _forward_packed(model, tensors, plan, temperature, stats)
    return _forward_padded(model, tensors, plan.response_length, temperature, stats)


def token_values(model: ForwardModel, tensors: dict[str, torch.Tensor], plan: Plan) -> torch.Tensor:
    """The value head's output at every position, (bs, seq) float32 (0 at padding when packed)."""
    if plan.layout == "packed":
        ids, pos = _packed_row(tensors, plan.packed)
        packed = model.module(**_packed_inputs(model, ids, pos, _image_inputs(tensors))).logits[0, :, 0].float()
        return _scatter(packed, plan.packed.kept, tuple(tensors["input_ids"].shape))
    return model.module(**padded_inputs(model, tensors)).logits[..., 0].float()


def _packed_row(tensors: dict[str, torch.Tensor], packed: PackedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row's ids (1, n) and positions: (1, n), or (4, 1, n) for a vision-language model's M-RoPE
    positions ((4, bs, seq) from `vision_inputs`)."""
    ids, pos = tensors["input_ids"].reshape(-1)[packed.kept][None], tensors["position_ids"]
    if pos.dim() == 3:
        return ids, pos.reshape(pos.size(0), -1)[:, packed.kept][:, None]
    return ids, pos.reshape(-1)[packed.kept][None]


def _image_inputs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language micro-batch's images (pixel values and grids, in row order), which packing leaves as they
    are: the model places them on the image tokens in order, and packing keeps the rows' order."""
    return {key: value for key, value in tensors.items() if key not in ("input_ids", "attention_mask", "position_ids")}


def padded_inputs(model: ForwardModel, tensors: dict[str, torch.Tensor]) -> dict:
    """The model's inputs for a padded micro-batch: its 2D padding mask becomes the dense causal mask, unless
    transformers must build it (another kernel, sliding windows) or the rows carry images (vision models place
    their image tokens by the 2D mask)."""
    if not model.prebuilt_masks or model.takes_block_mask or "pixel_values" in tensors:
        return dict(tensors, use_cache=False)
    allowed = attention_masks.causal_padding_mask(tensors["attention_mask"])
    return dict(tensors, attention_mask=model.dense_mask(allowed), use_cache=False)


def _packed_inputs(model: ForwardModel, ids: torch.Tensor, pos: torch.Tensor,
                   images: dict[str, torch.Tensor] | None = None) -> dict:
    """The model's inputs for one packed row: with the block-diagonal causal mask, or, for transformers to derive
    it from the position ids (each sequence's restart at 0), without a mask. A vision-language row (`images`) goes
    without a mask, as its padded forward does: the model derives the blocks from the text positions, pos[0]."""
    inputs = dict(input_ids=ids, position_ids=pos, use_cache=False)
    if images:
        return dict(inputs, **images)
    if model.prebuilt_masks and model.takes_block_mask:
        allowed = attention_masks.packed_allowed(attention_masks.packed_segments(pos))
        inputs["attention_mask"] = attention_masks.block_mask(allowed, ids.size(1), ids.device)
    elif model.prebuilt_masks:
        inputs["attention_mask"] = model.dense_mask(attention_masks.packed_causal_mask(pos))
    return inputs


def _forward_padded(model, tensors, response_length, temperature, stats):
    if model.is_value:
        logits = model.module(**padded_inputs(model, tensors)).logits
        return {"values": logits[:, -response_length - 1 : -1, 0].float()}
    labels = tensors["input_ids"][:, -response_length:]
    out = model.head.log_probs(
        model.module, padded_inputs(model, tensors), response_length + 1,
        lambda x: x[:, :-1].reshape(-1, x.size(-1)), labels.reshape(-1), temperature, stats,
    )
    return _outputs(out, lambda values: values.view(labels.shape))


def _forward_packed(model, tensors, plan, temperature, stats):
    packed, shape = plan.packed, (tensors["input_ids"].size(0), plan.response_length)
    ids, pos = _packed_row(tensors, packed)
    inputs = _packed_inputs(model, ids, pos, _image_inputs(tensors))
    if model.is_value:
        values = model.module(**inputs).logits[0, :, 0].float()
        return {"values": _scatter(values[packed.window_src], packed.window_dst, shape)}
    # Only the packed positions that predict response tokens are projected to the vocabulary.
    out = model.head.log_probs(
        model.module, inputs, packed.window_src, lambda x: x[0], ids[0, packed.window_next], temperature, stats,
    )
    return _outputs(out, lambda values: _scatter(values, packed.window_dst, shape))


def _forward_packed_ulysses(model, tensors, plan, temperature, stats):
    """The packed forward with the row split over the sequence-parallel group: each rank runs its slice
    (attention all-to-alls inside), projects its own window positions, and the per-token results are gathered."""
    packed, shape, group = plan.packed, (tensors["input_ids"].size(0), plan.response_length), model.sp_group
    ids, pos = _packed_row(tensors, packed)
    total = packed.num_tokens
    ids, pos = ulysses.pad_packed_row(ids, pos, dist.get_world_size(group))
    part = ulysses.local_slice(ids.size(1), group)
    inputs = dict(input_ids=ids[:, part], position_ids=pos[:, part], use_cache=False)
    device = ids.device
    with ulysses.ulysses_context(group, pos):
        if model.is_value:
            values = ulysses.gather_sequence(model.module(**inputs).logits[0, :, 0].float(), group)[:total]
            return {"values": _scatter(values[packed.window_src], packed.window_dst, shape)}
        src = packed.host_window_src
        mine = src[(src >= part.start) & (src < part.stop)]
        local = to_device_async(mine - part.start, device)
        next_ids = ids[0, to_device_async(np.minimum(mine + 1, total - 1), device)]
        out = model.head.log_probs(
            model.module, inputs, local, lambda x: x[0], next_ids, temperature, stats, shard=None
        )
    chunk = part.stop - part.start
    # A rank without window positions still joins the head's gradient (FSDP reduces it on every rank).
    anchor = out["log_probs"].sum() * 0.0

    def gathered(per_position: torch.Tensor) -> torch.Tensor:
        row = per_position.new_zeros(chunk).index_put((local,), per_position) + anchor
        return _scatter(ulysses.gather_sequence(row, group)[packed.window_src], packed.window_dst, shape)

    return _outputs(out, gathered)


def _forward_shared_prompts(model, tensors, layout: SharedPromptLayout, temperature, stats):
    """One forward row per prompt group, the prompt once and then its responses (`prefix_sharing`); only the
    columns that predict response tokens are projected to the vocabulary."""
    if model.takes_block_mask:  # the pattern is evaluated block by block
        mask = attention_masks.block_mask(layout.allowed, layout.length, layout.input_ids.device, rows=layout.groups)
    else:  # one (length x length) block per group
        mask = model.dense_mask(layout.attention_mask())
    inputs = dict(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=mask, use_cache=False)
    shape = (layout.num_rows, layout.response_length)
    if model.is_value:
        values = model.module(**inputs).logits[..., 0].reshape(-1).float()
        return {"values": _scatter(values[layout.predictor_of_valid], layout.valid_index, shape)}
    labels = tensors["input_ids"][:, -layout.response_length :].reshape(-1)[layout.valid_index]
    out = model.head.log_probs(
        model.module, inputs, layout.kept, lambda x: x.reshape(-1, x.size(-1)), labels, temperature, stats,
        rows=layout.kept_row_of_valid,
    )
    return _outputs(out, lambda values: _scatter(values, layout.valid_index, shape))
