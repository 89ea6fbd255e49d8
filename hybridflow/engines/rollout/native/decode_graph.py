"""The native rollout's decode step with static shapes, replayed from CUDA graphs on CUDA devices.

A decode step of the torch-ops forward launches about fifteen kernels per layer; on a GPU with a small model
the host cannot issue them as fast as the GPU runs them (issue 25: about 35 ms per step of HF generate on an
H200 for a 135M model), so the step is captured once per shape and replayed as one graph launch.

Capture needs every input and output of the step at a fixed shape and address:
- rows: the batcher pads the active slots to a bucket (`decode_rows`: powers of two from 8 on CUDA, so that
  few graphs, each with its own logits buffer, cover every batch);
- span: the attended cache width is a static value per bucket (`decode_span`): the whole cache length on CUDA,
  with the per-slot lengths masked on the device; on CPU it is rounded up to `CPU_SPAN_MULTIPLE` so that a step
  does not attend to the whole cache (measured in docs/performance.md);
- no host synchronisation inside the step: the batcher checks for finished sequences every k steps only.

`DecodeStep` runs the same function eagerly on every other device (CPU, or a tensor-parallel shard whose
all-reduce is not captured), so the shapes seen on CPU are the shapes a GPU captures.
"""

from __future__ import annotations

import logging

import torch

from hybridflow.engines.rollout.native.kv_cache import KVCache
from hybridflow.engines.rollout.native.model import LlamaFamilyForward

logger = logging.getLogger(__name__)

CPU_SPAN_MULTIPLE = 64
"""Attention span of a CPU decode step: the longest cached length + 1, rounded up to this many positions
(static for 64 steps at a time); see `decode_span`."""
ROWS_MULTIPLE = 8
"""Decode steps with torch ops run on a multiple of this many slots (idle slots fill the gap): on the 2-core
AVX2 CPU a step of 15 or 63 rows took 1.27-1.6x longer than one of 16 or 64 rows (docs/performance.md). With
the compiled kernels a step of 15 or 63 rows costs the same as one of 16 or 64 (0.97-1.00x): padding gains
nothing there, so kernel steps run unpadded."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def decode_rows(num_active: int, num_slots: int, *, graphs: bool, kernels: bool) -> int:
    """Slots a decode step computes for `num_active` active ones (the rest are idle padding slots).

    Graph replay: the next power of two from `ROWS_MULTIPLE` (one graph per bucket); torch ops: the next multiple
    of `ROWS_MULTIPLE`; the CPU kernels: exactly `num_active`. Never more than the cache's `num_slots`.
    """
    if kernels:
        return num_active
    if graphs:
        return min(max(ROWS_MULTIPLE, 1 << (num_active - 1).bit_length()), num_slots)
    return min(round_up(num_active, ROWS_MULTIPLE), num_slots)


def decode_span(span: int, max_len: int, span_multiple: int | None) -> int:
    """The static attention width of a step whose longest slot needs `span` positions: `max_len` (the whole
    cache, one shape for the run) when `span_multiple` is None, else `span` rounded up to it, capped at `max_len`."""
    if span_multiple is None:
        return max_len
    return min(round_up(span, span_multiple), max_len)


class DecodeStep:
    """`LlamaFamilyForward.decode` at static shapes: captured per `(rows, span)` into a CUDA graph when `graphs`
    is true (CUDA only), run eagerly otherwise. Graphs are dropped when the cache, the rope tables or the weights
    move to other memory (a new reservation, `sleep`/`wake_up`, replaced parameters)."""

    def __init__(self, forward: LlamaFamilyForward, cache: KVCache, graphs: bool, *, compiled: bool = False) -> None:
        """compiled: the step through `torch.compile` (inductor; one compilation per static shape, before a graph
        captures it). Not with the CPU kernels, whose calls it cannot trace."""
        if compiled and forward.kernels is not None:
            raise ValueError("compile_decode needs the torch-ops decode step; build the rollout with kernels='torch'")
        self.forward = forward
        self.cache = cache
        self.graphs = graphs
        self.step = torch.compile(forward.decode, dynamic=False) if compiled else forward.decode
        """The step function: `forward.decode`, or its compiled form."""
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self._pool = None
        self._addresses: tuple[int, ...] = ()
        self.num_captures = 0
        """Graphs captured so far (a test and the GPU profile read it)."""

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, span: int) -> torch.Tensor:
        """tokens, positions, lengths: (rows,) int64 (see `LlamaFamilyForward.decode`); span: the static
        attention width -> float32 logits (rows, vocab). With graphs the result is a buffer that the next replay
        of the same bucket overwrites: read it before the next step."""
        if not self.graphs:
            return self.step(tokens, positions, lengths, span, self.cache)
        addresses = self._memory_addresses()
        if addresses != self._addresses:
            self.reset()
            self._addresses = addresses
        key = (tokens.numel(), span)
        entry = self._captured.get(key)
        if entry is None:
            entry = self._capture(tokens, positions, lengths, span)
            self._captured[key] = entry
        graph, inputs, logits = entry
        for buffer, value in zip(inputs, (tokens, positions, lengths)):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return logits

    def reset(self) -> None:
        """Drop every captured graph (their memory returns to the caching allocator)."""
        self._captured.clear()
        self._pool = None

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, span: int):
        inputs = (tokens.clone(), positions.clone(), lengths.clone())
        # Warm-up on a side stream, as torch.cuda.graphs asks; it writes the same K/V the replay writes.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*inputs, span, self.cache)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one pool: buckets replay one at a time
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.step(*inputs, span, self.cache)
        self.num_captures += 1
        logger.debug("native rollout: captured the decode step for %d rows x %d span", tokens.numel(), span)
        return graph, inputs, logits

    def _memory_addresses(self) -> tuple[int, ...]:
        """Where the graphs' fixed operands live: the cache tensors, the rope tables and the weights."""
        return (
            *(t.data_ptr() for t in (*self.cache.keys, *self.cache.values)),
            *self.forward.operand_addresses(),
        )
