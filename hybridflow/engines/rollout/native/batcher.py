"""Continuous batching for the native rollout: admit prompts into free cache slots, decode all active
slots one token per step, retire finished sequences and refill their slots from the waiting queue.

Row layout: prompt `p` with `n` samples produces output rows `p * n + [0, n)`. A prompt is admitted only when
`n` slots are free; its prefill runs once and its K/V and first-token logits are shared by the `n` samples.
Admitted prompts are sorted by length and prefilled in chunks of at most `max_prefill_tokens` padded tokens.

`serve` is the same loop for the generation server: requests that arrive while others decode are admitted
into free slots at the next step, and each response is handed back as soon as it finishes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridflow.engines.rollout.base import ABORTED, SamplingParams
from hybridflow.engines.rollout.native.decode_graph import (
    CPU_SPAN_MULTIPLE,
    ROWS_MULTIPLE,
    DecodeStep,
    decode_rows,
    decode_span,
    round_up,
)
from hybridflow.engines.rollout.native.kv_cache import KVCache
from hybridflow.engines.rollout.native.model import LlamaFamilyForward
from hybridflow.engines.rollout.native.prefix_cache import PrefixCache
from hybridflow.engines.rollout.native.sampler import sample_tokens

logger = logging.getLogger(__name__)

def serving_capacity_within(slots: int, prefix_reuse: bool) -> int:
    """The most rows `serve` can decode when the cache may hold `slots` slots: its decode slots are padded to a
    multiple of `ROWS_MULTIPLE`, and prefix reuse parks as many finished sequences again. 0 if none fit."""
    capacity = slots // 2 if prefix_reuse else slots
    while capacity > 0 and round_up(capacity, ROWS_MULTIPLE) + (capacity if prefix_reuse else 0) > slots:
        capacity -= 1
    return capacity


@dataclass
class GenerationResult:
    """Generated tokens per output row, right-padded."""

    tokens: torch.Tensor
    """(rows, max_new_tokens) int64, pad id after the last generated token."""
    log_probs: torch.Tensor
    """(rows, max_new_tokens) float32, 0 after the last generated token."""
    num_generated: torch.Tensor
    """(rows,) int64, tokens generated including the stop token."""
    stats: dict[str, float] = field(default_factory=dict)
    """Wall times in seconds (`prefill_s`, `decode_s`, `first_token_s`) and `num_decode_steps`."""
    aborted: torch.Tensor | None = None
    """(rows,) bool on the host with `finish_after`: the rows ended with no tokens (over-sampling); else None."""

    def response_mask(self) -> torch.Tensor:
        """(rows, max_new_tokens) int64: 1 on the generated tokens (stop token included), 0 on padding."""
        steps = torch.arange(self.tokens.size(1), device=self.tokens.device)
        return (steps[None, :] < self.num_generated[:, None]).long()


@dataclass
class _SlotState:
    """Per-slot decode state; slots `[0, num_active)` are in use."""

    row: torch.Tensor  # output row of the sequence in the slot
    length: torch.Tensor  # tokens in its cache (= cache position of the next token)
    position: torch.Tensor  # rope position of the next token
    count: torch.Tensor  # tokens generated so far
    token: torch.Tensor  # last generated token (the next input)

    @classmethod
    def empty(cls, num_slots: int, device: torch.device) -> _SlotState:
        return cls(*(torch.zeros(num_slots, dtype=torch.long, device=device) for _ in range(5)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.row, self.length, self.position, self.count, self.token


@dataclass
class _Run:
    """Everything one `generate` call works on."""

    prompts: list[torch.Tensor]  # on the host (see `ContinuousBatcher.generate`)
    positions: list[torch.Tensor]
    params: SamplingParams
    stop_ids: torch.Tensor
    tokens: torch.Tensor
    log_probs: torch.Tensor
    num_generated: torch.Tensor
    slots: _SlotState
    pad_id: int
    capacity: int  # sequences decoded at once (<= the cache's slots, which include padding rows)
    limits: torch.Tensor | None = None  # (rows,) new-token limit per row; None: params.max_new_tokens for all
    on_retire: Callable[[list[int], list[int]], None] | None = None  # finished rows and their slots
    decode_slots: int | None = None  # slots a decode step may pad into; None: the whole cache
    num_active: int = 0
    span: int = 0  # at least 1 + the longest cached length among active slots: the attention width of the next step
    unchecked_steps: int = 0  # decode steps since finished sequences were last retired
    num_finished: int = 0  # rows retired so far
    start: float = field(default_factory=time.perf_counter)
    stats: dict[str, float] = field(
        default_factory=lambda: {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "num_decode_steps": 0,
                                 "decoded_rows": 0}
    )

    @classmethod
    def create(
        cls,
        prompts: list[torch.Tensor],
        positions: list[torch.Tensor],
        params: SamplingParams,
        stop_ids: list[int],
        pad_id: int,
        capacity: int,
        num_rows: int,
        width: int,
        num_slots: int,
        device: torch.device,
        **extra,
    ) -> _Run:
        """A run with empty outputs for `num_rows` rows of up to `width` tokens, over `num_slots` cache slots.

        The outputs have one more column, `width`, where decode steps write the tokens of sequences that finished
        since the last retirement (see `ContinuousBatcher._decode_step`); `GenerationResult` leaves it out.
        """
        return cls(
            prompts=prompts,
            positions=positions,
            params=params,
            stop_ids=torch.tensor(stop_ids, device=device),
            tokens=torch.full((num_rows, width + 1), pad_id, dtype=torch.long, device=device),
            log_probs=torch.zeros((num_rows, width + 1), dtype=torch.float32, device=device),
            num_generated=torch.zeros(num_rows, dtype=torch.long, device=device),
            slots=_SlotState.empty(num_slots, device),
            pad_id=pad_id,
            capacity=capacity,
            **extra,
        )


class RequestSource(Protocol):
    """Where `ContinuousBatcher.serve` gets requests and delivers responses (the generation server)."""

    def take(self, limit: int, block: bool) -> list[tuple[Hashable, list[int], int]] | None:
        """Up to `limit` new `(key, prompt_ids, max_new_tokens)`; with `block`, wait for at least one.

        Returns None to end the run (stop requested, or only requests this run cannot take are left).
        """

    def finish(self, key: Hashable, token_ids: list[int], log_probs: list[float], finish_reason: str) -> None:
        """Deliver one finished response."""

    def abort_requested(self) -> bool:
        """True: end every sequence of the run now ('abort', with its tokens so far); checked once per step."""


@dataclass
class _Serving:
    """What `serve` tracks besides its `_Run`: the request in each output row, the free rows, the rows
    waiting for a slot and the prefix cache. A delivered response frees its row for the next request."""

    run: _Run
    source: RequestSource
    max_len: int
    prefix_cache: PrefixCache
    keys: list[Hashable | None]  # the source's key of the request in each row
    prompt_ids: list[list[int]]  # each row's prompt, to match against parked sequences
    free_rows: list[int]
    waiting: deque[int] = field(default_factory=deque)

    def take(self) -> list[tuple[Hashable, list[int], int]] | None:
        """New requests for the free rows, waiting for one while nothing is admitted or waiting; None ends
        the run (the source ended and nothing is left to decode)."""
        idle = self.run.num_active == 0 and not self.waiting
        requests = self.source.take(len(self.free_rows), block=idle) if self.free_rows else []
        if requests is None:
            return None if idle else []  # finish what is admitted; the source is asked again next step
        return requests

    def enqueue(self, key: Hashable, prompt: list[int], max_new_tokens: int) -> None:
        """Put a request into a free row (cleared) and queue the row for a slot."""
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(
                f"request {key!r}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed the "
                f"server's max_len {self.max_len}"
            )
        run, row = self.run, self.free_rows.pop()
        self.keys[row] = key
        self.prompt_ids[row] = list(prompt)
        run.prompts[row] = torch.tensor(prompt, dtype=torch.long)  # on the host, as `generate`'s prompts
        run.positions[row] = torch.arange(len(prompt))
        run.stats["prompt_tokens"] += len(prompt)
        run.limits[row] = max_new_tokens
        run.tokens[row] = run.pad_id
        run.log_probs[row] = 0.0
        run.num_generated[row] = 0
        self.waiting.append(row)

    def deliver(self, rows: list[int], slots: list[int]) -> None:
        """`_Run.on_retire`: park each finished sequence's cache, hand its response to the source and free
        its row. Runs before the slots are compacted, while they still hold the sequences' K/V."""
        run = self.run
        for row, slot in zip(rows, slots):
            count, limit = int(run.num_generated[row]), int(run.limits[row])
            response = run.tokens[row, :count].tolist()
            cached = int(run.slots.length[slot])  # prompt + response, less the last token (never fed)
            self.prefix_cache.park(slot, (self.prompt_ids[row] + response)[:cached])
            reason = "length" if count >= limit else "stop"
            self._hand_over(row, response, run.log_probs[row, :count].tolist(), reason)

    def abort(self) -> None:
        """End every sequence now (`RequestSource.abort_requested`): those decoding with their tokens so far, those
        waiting for a slot with none; nothing is parked (no next turn follows an aborted request)."""
        run, s = self.run, self.run.slots
        active = slice(0, run.num_active)
        counts = s.count[active].tolist()
        for row, count in zip(s.row[active].tolist(), counts):
            self._hand_over(row, run.tokens[row, :count].tolist(), run.log_probs[row, :count].tolist(), ABORTED)
        while self.waiting:
            self._hand_over(self.waiting.popleft(), [], [], ABORTED)
        for tensor in s.tensors():
            tensor[active] = 0  # freed slots: valid padding rows for `_decode_step`
        run.num_active, run.span, run.unchecked_steps = 0, 0, 0

    def _hand_over(self, row: int, token_ids: list[int], log_probs: list[float], reason: str) -> None:
        self.source.finish(self.keys[row], token_ids, log_probs, reason)
        self.keys[row] = None
        self.free_rows.append(row)


class ContinuousBatcher:
    """Runs one generation request (a list of prompts) to completion over `max_num_seqs` cache slots.

    Decode steps have static shapes (`decode_graph.py`): the rows are padded to a bucket, the attention span is
    static per bucket, and finished sequences are found (a host synchronisation) only every
    `done_check_interval` steps. In between, a finished sequence keeps its slot; its step neither advances it nor
    writes its output row, so the results do not depend on the interval.
    """

    def __init__(
        self,
        forward: LlamaFamilyForward,
        cache: KVCache,
        max_num_seqs: int,
        max_prefill_tokens: int,
        *,
        done_check_interval: int = 1,
        graphs: bool = False,
        span_multiple: int | None = CPU_SPAN_MULTIPLE,
        compiled: bool = False,
    ) -> None:
        """done_check_interval: decode steps between retirements of finished sequences (1: every step);
        graphs: replay decode steps from CUDA graphs (`DecodeStep`); span_multiple: see `decode_span`;
        compiled: the decode step through `torch.compile` (`DecodeStep`)."""
        if done_check_interval < 1:
            raise ValueError(f"done_check_interval must be >= 1, got {done_check_interval}")
        self.forward = forward
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.done_check_interval = done_check_interval
        self.span_multiple = span_multiple
        self.decode = DecodeStep(forward, cache, graphs, compiled=compiled)

    @torch.inference_mode()
    def slot_limit(self, max_seqs: int | None) -> int:
        """Cache slots a `generate` call may hold: `max_num_seqs`, or fewer under a memory budget's `max_seqs`."""
        return min(self.max_num_seqs, max_seqs or self.max_num_seqs)

    def generate(
        self,
        prompts: list[torch.Tensor],
        positions: list[torch.Tensor],
        params: SamplingParams,
        stop_ids: list[int],
        pad_id: int,
        max_seqs: int | None = None,
        finish_after: int | None = None,
    ) -> GenerationResult:
        """Generate `params.n` responses per prompt.

        prompts, positions: per prompt, (prompt_len,) int64 token ids and rope positions (no padding), on the
            host: the prefill sends each chunk to the device in one copy.
        max_seqs: cache slots this call may hold at most (a memory budget), below `max_num_seqs`; None: no limit.
        finish_after: once this many rows have ended, the rest end with no tokens (`GenerationResult.aborted`;
            verl's over-sampling); None: every row runs to its end.
        """
        n, max_new = params.n, params.max_new_tokens
        limit = self.slot_limit(max_seqs)
        if n > limit:
            raise ValueError(
                f"n={n} > {limit} cache slots: the n samples of a prompt share one prefill and need n slots at once; "
                + ("raise max_num_seqs" if limit == self.max_num_seqs else "raise rollout.gpu_memory_utilization")
            )
        device = self.cache.device
        num_rows = len(prompts) * n
        max_prompt_len = max(p.numel() for p in prompts)
        max_position = int(torch.stack([pos[-1] for pos in positions]).max()) + max_new + 1  # one read, not per prompt
        capacity = min(limit, num_rows)
        padded = round_up(capacity, ROWS_MULTIPLE)
        self.cache.reserve(padded if padded <= limit else capacity, max_prompt_len + max_new)
        self.forward.bind(max_position)
        run = _Run.create(
            prompts, positions, params, stop_ids, pad_id, capacity, num_rows, max_new, self.cache.num_slots, device
        )
        return self._loop(run, deque(range(len(prompts))), finish_after)

    @torch.inference_mode()
    def serve(
        self,
        params: SamplingParams,
        stop_ids: list[int],
        pad_id: int,
        max_len: int,
        source: RequestSource,
        max_seqs: int | None = None,
        prefix_reuse: bool = True,
    ) -> dict[str, float]:
        """Decode requests from `source` until it returns None: continuous batching across requests.

        Every step first takes as many new requests as there are free rows, admits waiting ones into free
        slots (prefill), then decodes all active slots one token; a finished response is delivered at once
        and its slot and row are reused. All requests of a run share `params` except `max_new_tokens`
        (per request). A request must satisfy len(prompt) + max_new_tokens <= max_len (the cache length).
        At most `max_seqs` (default `max_num_seqs`) are decoded at once. When `source.abort_requested()` (asked
        once per step, a host flag), every sequence ends at once with its tokens so far. Returns the run's stats
        (`decoded_rows / num_decode_steps` is the mean batch of a decode step).

        Prefix reuse: a finished sequence's K/V stay in one of `max_seqs` parking slots (a `PrefixCache`;
        least recently parked evicted first). A request whose prompt starts with a parked sequence's tokens
        (the next turn of a conversation: previous prompt + response + new messages) takes over that cache
        and prefills only the rest (`stats`: `prefix_hits`, `reused_tokens` of `prompt_tokens`). Parked
        caches live as long as the run, which ends before weights change (the server stops around weight
        updates).
        """
        if params.n != 1:
            raise ValueError(f"serve decodes one response per request, got n={params.n}")
        serving = self._start_serving(params, stop_ids, pad_id, max_len, source, max_seqs, prefix_reuse)
        while (requests := serving.take()) is not None:
            for key, prompt, max_new_tokens in requests:
                serving.enqueue(key, prompt, max_new_tokens)
            if source.abort_requested():
                self._retire(serving.run)  # those that ended since the last check end as they are
                serving.abort()
                continue
            self._resume_prefixes(serving)
            self._fill_slots(serving.run, serving.waiting)
            if serving.run.num_active:
                self._step(serving.run)
        return dict(serving.run.stats)

    def _start_serving(
        self,
        params: SamplingParams,
        stop_ids: list[int],
        pad_id: int,
        max_len: int,
        source: RequestSource,
        max_seqs: int | None,
        prefix_reuse: bool,
    ) -> _Serving:
        """Reserve the cache (decode slots, then as many parking slots) and start an empty run of `capacity`
        rows, which `_Serving.enqueue` fills as requests arrive."""
        device = self.cache.device
        capacity = min(self.max_num_seqs, max_seqs or self.max_num_seqs)
        park_base = round_up(capacity, ROWS_MULTIPLE)  # decode steps never pad into the parking slots
        park_slots = capacity if prefix_reuse else 0
        self.cache.reserve(park_base + park_slots, max_len)
        self.forward.bind(max_len)
        empty = [torch.empty(0, dtype=torch.long)] * capacity
        run = _Run.create(
            list(empty), list(empty), params, stop_ids, pad_id, capacity, capacity, max_len, self.cache.num_slots,
            device, limits=torch.zeros(capacity, dtype=torch.long, device=device), decode_slots=park_base,
        )
        run.stats.update(prefix_hits=0, reused_tokens=0, prompt_tokens=0)
        serving = _Serving(
            run=run,
            source=source,
            max_len=max_len,
            prefix_cache=PrefixCache(self.cache, range(park_base, park_base + park_slots)),
            keys=[None] * capacity,
            prompt_ids=[[] for _ in range(capacity)],
            free_rows=list(range(capacity - 1, -1, -1)),
        )
        run.on_retire = serving.deliver
        return serving

    def _resume_prefixes(self, serving: _Serving) -> None:
        """Start waiting requests that continue a parked sequence from its cache (they prefill only their
        new tokens), while slots are free; then retire those whose first token already ends them."""
        run = serving.run
        for row in list(serving.waiting):
            if run.num_active >= run.capacity:
                break
            found = serving.prefix_cache.longest_prefix(serving.prompt_ids[row])
            if found is not None:
                serving.waiting.remove(row)
                self._resume(run, row, *found)
        self._retire(run)

    def _resume(self, run: _Run, row: int, park_slot: int, reused: int) -> None:
        """Start `row` in the next free slot from a parked cache holding its first `reused` prompt tokens."""
        start = time.perf_counter()
        slot = run.num_active
        prompt, positions = run.prompts[row], run.positions[row]  # on the host
        self.cache.copy_slot(park_slot, slot, reused)
        device = self.cache.device
        logits = self.forward.extend(
            prompt[reused:].to(device, non_blocking=True), positions[reused:].to(device, non_blocking=True),
            self.cache, slot, reused,
        )
        tokens, log_probs = sample_tokens(logits, run.params, self.forward.kernels)
        s = run.slots
        s.row[slot], s.length[slot], s.position[slot] = row, prompt.numel(), positions[-1] + 1
        s.count[slot], s.token[slot] = 1, tokens[0]
        run.tokens[row, 0], run.log_probs[row, 0] = tokens[0], log_probs[0]
        run.num_active += 1
        run.span = max(run.span, prompt.numel() + 1)
        run.stats["prefix_hits"] += 1
        run.stats["reused_tokens"] += reused
        run.stats["prefill_s"] += time.perf_counter() - start

    # ------------------------------------------------------------------ the loop
    def _loop(self, run: _Run, waiting: deque[int], finish_after: int | None = None) -> GenerationResult:
        start, captures_before, aborted = time.perf_counter(), self.decode.num_captures, None
        while True:
            if finish_after is not None and run.num_finished >= finish_after:
                aborted = self._abort_rest(run, waiting)
                break
            self._fill_slots(run, waiting)
            if run.num_active == 0:
                break
            self._step(run)
        run.stats["total_s"] = time.perf_counter() - start
        # CUDA graphs captured in this call: each costs a warm-up and a capture of the whole step, and they are
        # dropped whenever the cache moves (sleep/wake_up between steps), so a count above 0 every step is a cost
        run.stats["decode_graph_captures"] = self.decode.num_captures - captures_before
        logger.debug("native rollout: %s", run.stats)
        return GenerationResult(run.tokens[:, :-1], run.log_probs[:, :-1], run.num_generated, dict(run.stats), aborted)

    def _abort_rest(self, run: _Run, waiting: deque[int]) -> torch.Tensor:
        """End the sequences still decoding and the prompts still waiting: their rows keep no tokens. Returns the
        (rows,) bool mask of those rows, on the host."""
        self._retire(run)  # those that ended since the last check end as they are
        n, s = run.params.n, run.slots
        rows = s.row[: run.num_active].tolist() + [p * n + i for p in waiting for i in range(n)]
        waiting.clear()
        aborted = torch.zeros(run.num_generated.numel(), dtype=torch.bool)
        aborted[rows] = True
        on_device = aborted.to(run.num_generated.device)
        run.num_generated[on_device], run.tokens[on_device], run.log_probs[on_device] = 0, run.pad_id, 0.0
        for tensor in s.tensors():
            tensor[: run.num_active] = 0
        run.num_active, run.stats["aborted_rows"] = 0, len(rows)
        return aborted

    def _fill_slots(self, run: _Run, waiting: deque[int]) -> None:
        """Admit waiting prompts while `n` slots are free; retiring after each admission frees the slots of
        sequences whose first token already ends them."""
        while waiting and run.capacity - run.num_active >= run.params.n:
            self._admit(run, waiting)
            self._retire(run)

    def _admit(self, run: _Run, waiting: deque[int]) -> None:
        """Move as many waiting prompts as fit into free slots, prefilling them in length-sorted chunks."""
        n = run.params.n
        take = min(len(waiting), (run.capacity - run.num_active) // n)
        chosen = sorted((waiting.popleft() for _ in range(take)), key=lambda p: run.prompts[p].numel())
        chunk: list[int] = []
        for prompt in chosen:
            padded = (len(chunk) + 1) * run.prompts[prompt].numel()  # sorted: this prompt is the longest
            if chunk and padded > self.max_prefill_tokens:
                self._prefill(run, chunk)
                chunk = []
            chunk.append(prompt)
        if chunk:
            self._prefill(run, chunk)

    def _prefill(self, run: _Run, chunk: list[int]) -> None:
        n = run.params.n
        start = time.perf_counter()
        device = self.cache.device
        # The chunk's layout is built on the host (prompts live there) and sent in one non-blocking copy per
        # tensor: no per-prompt copy or launch, and nothing that waits for the device.
        sizes = [run.prompts[p].numel() for p in chunk]
        ids = torch.full((len(chunk), max(sizes)), run.pad_id, dtype=torch.long)
        pos = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # right-pad: real tokens first
            ids[i, : sizes[i]] = run.prompts[p]
            pos[i, : sizes[i]] = run.positions[p]
        host_rows = (torch.tensor(chunk)[:, None] * n + torch.arange(n)).reshape(-1)
        host_last = torch.stack([run.positions[p][-1] for p in chunk])
        ids, pos, lengths, rows, last_positions = (
            tensor.to(device, non_blocking=True) for tensor in (ids, pos, torch.tensor(sizes), host_rows, host_last)
        )
        first = run.num_active
        logits = self.forward.prefill(ids, pos, lengths - 1, self.cache, first, n)
        logits = logits.repeat_interleave(n, dim=0) if n > 1 else logits
        tokens, log_probs = sample_tokens(logits, run.params, self.forward.kernels)
        slots = slice(first, first + len(chunk) * n)
        run.slots.row[slots] = rows
        run.slots.length[slots] = lengths.repeat_interleave(n)
        run.slots.position[slots] = (last_positions + 1).repeat_interleave(n)
        run.slots.count[slots] = 1
        run.slots.token[slots] = tokens
        run.tokens[rows, 0] = tokens
        run.log_probs[rows, 0] = log_probs
        run.num_active += len(chunk) * n
        run.span = max(run.span, max(sizes) + 1)
        run.stats["prefill_tokens"] += sum(sizes)
        run.stats["prefill_s"] += time.perf_counter() - start
        run.stats.setdefault("first_token_s", time.perf_counter() - run.start)

    def _step(self, run: _Run) -> None:
        """One decode step of every active slot, then retirement, counted in the run's stats."""
        start, rows = time.perf_counter(), run.num_active
        self._decode_step(run)
        run.unchecked_steps += 1
        if run.unchecked_steps >= self.done_check_interval:
            self._retire(run)
        run.stats["decode_s"] += time.perf_counter() - start
        run.stats["num_decode_steps"] += 1
        run.stats["decoded_rows"] += rows

    def _decode_step(self, run: _Run) -> None:
        """One token for every active slot, without a host synchronisation. A slot whose sequence finished since
        the last retirement still runs (its shape is part of the step) but stays as it was: its sampled token
        goes to the outputs' spare last column, and its length, position, count and token do not change."""
        s, active = run.slots, slice(0, run.num_active)
        live = ~self._finished(run)
        # Idle slots past the active ones pad the step (their state is zero: they write at cache position 0
        # of a free slot, which admission overwrites); their logits are dropped.
        num_rows = decode_rows(
            run.num_active,
            min(self.cache.num_slots, run.decode_slots or self.cache.num_slots),
            graphs=self.decode.graphs,
            kernels=self.forward.kernels is not None,
        )
        span = decode_span(min(run.span, self.cache.max_len), self.cache.max_len, self.span_multiple)
        padded = slice(0, num_rows)
        logits = self.decode(s.token[padded], s.position[padded], s.length[padded], span)
        tokens, log_probs = sample_tokens(logits[active], run.params, self.forward.kernels)
        rows, counts = s.row[active], s.count[active]
        columns = torch.where(live, counts, run.tokens.size(1) - 1)
        run.tokens[rows, columns] = tokens
        run.log_probs[rows, columns] = log_probs
        step = live.long()
        s.length[active] += step
        s.position[active] += step
        s.count[active] += step
        s.token[active] = torch.where(live, tokens, s.token[active])
        run.span += 1  # an upper bound: finished slots do not grow

    def _finished(self, run: _Run) -> torch.Tensor:
        """(num_active,) bool on the device: the sequence in the slot has ended (stop token or length limit)."""
        s, active = run.slots, slice(0, run.num_active)
        limits = run.params.max_new_tokens if run.limits is None else run.limits[s.row[active]]
        return torch.isin(s.token[active], run.stop_ids) | (s.count[active] >= limits)

    def _retire(self, run: _Run) -> None:
        """Record finished sequences and compact the active slots into `[0, num_active)`."""
        s, active = run.slots, slice(0, run.num_active)
        run.unchecked_steps = 0
        done = self._finished(run)
        if not bool(done.any()):
            return
        finished = s.row[active][done]
        run.num_finished += finished.numel()
        run.num_generated[finished] = s.count[active][done]
        if run.on_retire is not None:  # before compaction: the finished slots still hold their K/V
            run.on_retire(finished.tolist(), done.nonzero().squeeze(1).tolist())
        kept = (~done).nonzero().squeeze(1)
        num_kept = kept.numel()
        holes = done[:num_kept].nonzero().squeeze(1)
        movers = kept[kept >= num_kept]
        if holes.numel():
            self.cache.move_slots(movers, holes, int(s.length[movers].max()))
            for tensor in s.tensors():
                tensor[holes] = tensor[movers]
        for tensor in s.tensors():
            tensor[num_kept : run.num_active] = 0  # freed slots: valid padding rows for `_decode_step`
        run.num_active = num_kept
        run.span = int(s.length[:num_kept].max()) + 1 if num_kept else 0

