"""Token-in-token-out generation server over any rollout backend, for agent loops.

Many agent loops (asyncio tasks in the driver) each send one request at a time: `generate(request_id,
prompt_ids, sampling_params) -> TokenOutput`. The server queues requests from any thread and a single engine
thread batches them: it takes the first waiting request, gathers more until none has arrived for
`batch_wait_s` (at most 10x that, up to `max_batch_size`), groups the requests by sampling parameters (a
group's requests may differ in `max_new_tokens`: it decodes to the largest and cuts each response to its own)
and runs each group as one `generate_sequences` call. While a batch runs, new requests queue up and form the
next batch, so loops that are busy with tools do not hold back the others (dynamic batching at request
granularity).

With a streaming backend (`supports_streaming`, the native engine) and `max_model_len` given, batching is
continuous instead: the engine thread runs one decode loop per sampling-parameter group, new requests join
it at the next decode step as slots free up, and each response is returned the moment it finishes. A
request that continues a finished one (same replica: the router keeps a conversation on one) reuses its
K/V and prefills only the new tokens.

The server lives in the rollout worker's process (the hybrid engine: it generates with the weights the actor
just handed over); `hybridflow.agents.server_manager` routes a conversation's requests to one replica.

A replica split over a tensor-parallel group (`rollout.tensor_model_parallel_size`, an engine with a `tp`) has a
server on every rank, but only the group's first rank (the leader) takes requests. Its engine thread tells the
others what it runs, through a broadcast in the group before each step that decides anything (a batch and its
sampling parameters; in a streaming run, the requests each decode step admits), and the followers run the same
calls with the same RNG state (the worker seeds the peers alike), so the group decodes in lock-step; only the
leader answers. A follower waits for the leader inside that broadcast; an idle leader sends a keep-alive every
`KEEPALIVE_S`, so the wait stays far below the process group's timeout (`actor_rollout_ref.nccl_timeout`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from hybridflow.engines.rollout.base import BaseRollout, SamplingParams
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)


KEEPALIVE_S = 60.0
"""A tensor-parallel leader with nothing to run tells its followers so this often, so that their wait for its next
step stays far below the process group's timeout however long the server idles."""
_IDLE = object()
"""`_RunSource.take`'s answer when a timed wait found no request (the leader then sends a keep-alive)."""


@dataclass(frozen=True)
class TokenOutput:
    """One response: generated ids (including the stop token, if any) and their log-probs."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    """'stop' (eos or a stop token ended it) or 'length' (max_new_tokens reached)."""


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future


def build_prompt_batch(prompts: Sequence[Sequence[int]], pad_token_id: int, min_width: int = 0) -> DataProto:
    """Left-padded `input_ids`, `attention_mask`, `position_ids` (bs, width) for token-id prompts: `width` is the
    longest prompt, or `min_width` if that is more (the agent loops pad to `rollout.prompt_length`, as the dataset
    pads single-turn prompts, so that `prompt_length/clip_ratio` means the same for both)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a generation request has an empty prompt; send at least one token")
    width = max(min_width, *(len(p) for p in prompts))
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": positions})


def split_token_outputs(output: DataProto, max_new_tokens: int) -> list[TokenOutput]:
    """Per row of a rollout's output: the response tokens under `response_mask` and their log-probs."""
    results = []
    for tokens, mask, log_probs in zip(
        output.batch["responses"], output.batch["response_mask"], output.batch["rollout_log_probs"]
    ):
        length = int(mask.sum())
        reason = "length" if length >= max_new_tokens else "stop"
        results.append(TokenOutput(tokens[:length].tolist(), log_probs[:length].tolist(), reason))
    return results


def cut_to_budget(output: TokenOutput, max_new_tokens: int) -> TokenOutput:
    """`output` limited to `max_new_tokens` tokens; a cut response finished by 'length'."""
    if len(output.token_ids) <= max_new_tokens:
        return output
    return TokenOutput(output.token_ids[:max_new_tokens], output.log_probs[:max_new_tokens], "length")


class GenerationServer:
    """Batches concurrent token-level requests onto one rollout backend (see the module docstring)."""

    def __init__(
        self,
        rollout: BaseRollout,
        pad_token_id: int,
        *,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.05,
        max_model_len: int | None = None,
        prefix_reuse: bool = True,
    ) -> None:
        """
        Args:
            max_batch_size: requests decoded together at most.
            batch_wait_s: (per-batch mode) how long the queue must be quiet before a batch starts.
            max_model_len: prompt + response tokens of the longest request; with a streaming backend it
                enables continuous batching (the KV cache is sized for it). None: per-batch mode.
            prefix_reuse: (continuous mode) keep finished requests' caches for their next turn.
        """
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.rollout = rollout
        self.tp = getattr(rollout, "tp", None)  # a tensor-parallel replica: the leader drives its peers
        self.max_model_len = max_model_len
        self.prefix_reuse = prefix_reuse
        self.streaming = max_model_len is not None and getattr(rollout, "supports_streaming", False)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.num_requests = 0
        self.num_batches = 0
        self.busy_s = 0.0
        self.num_decode_steps = 0
        self.decoded_rows = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.keepalives = 0
        """Keep-alives a tensor-parallel leader sent its followers while idle (`KEEPALIVE_S`)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (no-op if running)."""
        if not self.running:
            self._thread = threading.Thread(target=self._serve, name="generation-server", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the queued requests, then stop the engine thread."""
        if self.running:
            self._queue.put(None)
            self._thread.join()
        self._thread = None

    def stats(self) -> dict[str, float]:
        """Requests served, batches (streaming: decode runs) and seconds the engine was busy; mean_batch_size
        is requests per batch, or with streaming the mean number of sequences in a decode step."""
        stats = {"num_requests": self.num_requests, "num_batches": self.num_batches, "busy_s": self.busy_s}
        if not self.streaming:
            return {**stats, "mean_batch_size": self.num_requests / max(self.num_batches, 1)}
        return {
            **stats,
            "mean_batch_size": self.decoded_rows / max(self.num_decode_steps, 1),
            # Share of prompt tokens whose K/V came from the conversation's previous turn (prefix reuse).
            "prefix_reuse": self.reused_tokens / max(self.prompt_tokens, 1),
        }

    # ------------------------------------------------------------------ requests
    def submit(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: SamplingParams
    ) -> concurrent.futures.Future:
        """Queue one request; the future resolves to a `TokenOutput` (or the engine's exception)."""
        if sampling_params.n != 1:
            raise ValueError(f"a token request returns one response: sampling_params.n must be 1, got {sampling_params.n}")
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; send at least one token")
        if self.streaming and len(prompt_ids) + sampling_params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(prompt_ids)} prompt + {sampling_params.max_new_tokens} new tokens exceed "
                f"the server's max_model_len {self.max_model_len} (prompt_length + response_length)"
            )
        if not self.running:
            raise RuntimeError("the generation server is not running: wake the rollout up first")
        if self.tp is not None and not self.tp.is_leader:
            raise RuntimeError(
                f"rank {self.tp.rank} of a tensor-parallel replica follows its leader: send requests to the replica's "
                "first rank"
            )
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Request(request_id, list(prompt_ids), sampling_params, future))
        return future

    def generate(self, request_id: str, prompt_ids: Sequence[int], sampling_params: SamplingParams) -> TokenOutput:
        """Blocking `submit` (thread-safe: call it from many threads at once)."""
        return self.submit(request_id, prompt_ids, sampling_params).result()

    async def generate_async(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: SamplingParams
    ) -> TokenOutput:
        """`submit` awaited from an event loop."""
        return await asyncio.wrap_future(self.submit(request_id, prompt_ids, sampling_params))

    # ------------------------------------------------------------------ the engine thread
    def _serve(self) -> None:
        if self.tp is not None and not self.tp.is_leader:
            self._follow()
            return
        try:
            self._serve_streaming() if self.streaming else self._serve_batches()
        finally:
            self._tell_followers(("stop",))

    def _tell_followers(self, message: tuple) -> None:
        """A tensor-parallel leader: what its followers must run next (see the module docstring)."""
        if self.tp is not None:
            self.tp.broadcast_from_leader(message)
            self.keepalives += message[0] == "idle"

    def _follow(self) -> None:
        """A tensor-parallel follower's engine thread: run what the leader runs, answering nobody."""
        message = self.tp.broadcast_from_leader()
        while message[0] != "stop":
            kind, *args = message
            if kind == "idle":
                message = self.tp.broadcast_from_leader()
                continue
            try:
                if kind == "generate":
                    prompt_ids, params = args
                    prompts = build_prompt_batch(prompt_ids, self.pad_token_id)
                    prompts.meta_info.update(params.as_overrides())
                    self.rollout.generate_sequences(prompts)
                elif kind == "serve":
                    self.rollout.serve(_FollowerSource(self.tp), args[0], self.max_model_len, self.max_batch_size,
                                       self.prefix_reuse)
            except _LeaderMovedOn as moved:  # the leader's run ended early (it failed there): follow its next step
                logger.warning("tensor-parallel follower: the leader left its %s run early", kind)
                message = moved.message
                continue
            except Exception:  # noqa: BLE001 - the leader runs the same call and answers its callers with the error
                logger.exception("tensor-parallel follower: %s failed", kind)
            message = self.tp.broadcast_from_leader()

    def _next_request(self) -> _Request | None:
        """The next queued request (None: stop); a tensor-parallel leader keeps its followers' wait short while it
        waits (`KEEPALIVE_S`)."""
        while True:
            try:
                return self._queue.get(timeout=KEEPALIVE_S if self.tp is not None else None)
            except queue.Empty:
                self._tell_followers(("idle",))

    def _serve_batches(self) -> None:
        stopping = False
        while not stopping:
            first = self._next_request()
            if first is None:
                break
            batch = [first]
            # Gather until the queue has been quiet for batch_wait_s (at most 10x that in all): requests sent
            # together arrive a few milliseconds apart.
            hard_deadline = time.perf_counter() + 10 * self.batch_wait_s
            while len(batch) < self.max_batch_size:
                wait = min(self.batch_wait_s, hard_deadline - time.perf_counter())
                try:
                    request = self._queue.get(timeout=max(wait, 0.0))
                except queue.Empty:
                    break
                if request is None:
                    stopping = True
                    break
                batch.append(request)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Request]) -> None:
        # Requests that differ only in max_new_tokens (agent turns with different budgets left) share a
        # batch: it decodes up to the largest budget and each response is cut to its own.
        groups: dict[SamplingParams, list[_Request]] = {}
        for request in batch:
            groups.setdefault(_params_key(request.params), []).append(request)
        for key, requests in groups.items():
            start = time.perf_counter()
            params = dataclasses.replace(key, max_new_tokens=max(r.params.max_new_tokens for r in requests))
            try:
                prompts = build_prompt_batch([r.prompt_ids for r in requests], self.pad_token_id)
                prompts.meta_info.update(params.as_overrides())
                self._tell_followers(("generate", [r.prompt_ids for r in requests], params))
                outputs = split_token_outputs(self.rollout.generate_sequences(prompts), params.max_new_tokens)
                outputs = [cut_to_budget(out, r.params.max_new_tokens) for out, r in zip(outputs, requests)]
            except Exception as error:  # noqa: BLE001 - handed to every waiting caller, who re-raises it
                logger.exception("generation batch of %d requests failed", len(requests))
                for request in requests:
                    request.future.set_exception(error)
                continue
            finally:
                self.busy_s += time.perf_counter() - start
            self.num_batches += 1
            self.num_requests += len(requests)
            for request, output in zip(requests, outputs, strict=True):
                request.future.set_result(output)

    def _serve_streaming(self) -> None:
        pending: deque[_Request] = deque()  # dequeued, waiting for a run of their sampling parameters
        stopping = False
        while pending or not stopping:
            if not pending:
                first = self._next_request()
                if first is None:
                    break
                pending.append(first)
            source = _RunSource(self._queue, pending, _params_key(pending[0].params), stopping)
            params = dataclasses.replace(source.key, max_new_tokens=self.max_model_len - 1)
            start = time.perf_counter()
            try:
                self._tell_followers(("serve", params))
                engine_source = source if self.tp is None else _LeaderSource(source, self._tell_followers)
                stats = self.rollout.serve(
                    engine_source, params, self.max_model_len, self.max_batch_size, self.prefix_reuse
                )
            except Exception as error:  # noqa: BLE001 - handed to the callers in flight, who re-raise it
                logger.exception("streaming generation run failed with %d requests in flight", len(source.in_flight))
                for request in source.in_flight.values():
                    request.future.set_exception(error)
                stats = {}
            finally:
                self.busy_s += time.perf_counter() - start
            stopping = source.stopping
            self.num_batches += 1
            self.num_requests += source.num_finished
            self.num_decode_steps += int(stats.get("num_decode_steps", 0))
            self.decoded_rows += int(stats.get("decoded_rows", 0))
            self.prompt_tokens += int(stats.get("prompt_tokens", 0))
            self.reused_tokens += int(stats.get("reused_tokens", 0))


def _params_key(params: SamplingParams) -> SamplingParams:
    """Requests with equal keys decode together (they may differ in max_new_tokens)."""
    return dataclasses.replace(params, max_new_tokens=1)


class _RunSource:
    """The server's side of one streaming run (`RequestSource`): hands over queued requests of the run's
    sampling parameters and resolves their futures as responses finish."""

    def __init__(self, requests: queue.Queue, pending: deque[_Request], key: SamplingParams, stopping: bool) -> None:
        self.requests = requests
        self.pending = pending
        self.key = key
        self.stopping = stopping
        self.in_flight: dict[int, _Request] = {}
        self.num_finished = 0
        self._ids = itertools.count()

    def take(
        self, limit: int, block: bool, timeout: float | None = None
    ) -> list[tuple[Hashable, list[int], int]] | None | object:
        """`RequestSource.take`; with `timeout`, a blocking wait that finds nothing in that time returns `_IDLE`."""
        taken = [r for r in self.pending if _params_key(r.params) == self.key][:limit]
        for request in taken:
            self.pending.remove(request)
        while len(taken) < limit and not self.stopping:
            others_waiting = bool(self.pending)
            waits = block and not taken and not others_waiting  # wait only when the run is idle and nothing else waits
            try:
                request = self.requests.get(timeout=timeout) if waits else self.requests.get_nowait()
            except queue.Empty:
                if waits:
                    return _IDLE
                break
            if request is None:
                self.stopping = True
            elif _params_key(request.params) == self.key:
                taken.append(request)
            else:
                self.pending.append(request)
        if not taken and block:
            return None  # idle: stopping, or only requests with other parameters are left
        batch = []
        for request in taken:
            key = next(self._ids)
            self.in_flight[key] = request
            batch.append((key, request.prompt_ids, request.params.max_new_tokens))
        return batch

    def finish(self, key: Hashable, token_ids: list[int], log_probs: list[float], finish_reason: str) -> None:
        request = self.in_flight.pop(key)
        self.num_finished += 1
        request.future.set_result(TokenOutput(token_ids, log_probs, finish_reason))


class _LeaderMovedOn(Exception):
    """A follower's run got the leader's next message instead of admissions: the leader ended the run."""

    def __init__(self, message: tuple) -> None:
        super().__init__(message[0])
        self.message = message


class _LeaderSource:
    """A tensor-parallel leader's `RequestSource`: its run's source, with each decode step's admissions sent to the
    followers."""

    def __init__(self, source: _RunSource, tell: Callable[[tuple], None]) -> None:
        self.source, self.tell = source, tell

    def take(self, limit: int, block: bool) -> list[tuple[Hashable, list[int], int]] | None:
        while (requests := self.source.take(limit, block, timeout=KEEPALIVE_S)) is _IDLE:
            self.tell(("idle",))
        self.tell(("take", requests))
        return requests

    def finish(self, key: Hashable, token_ids: list[int], log_probs: list[float], finish_reason: str) -> None:
        self.source.finish(key, token_ids, log_probs, finish_reason)


class _FollowerSource:
    """A tensor-parallel follower's `RequestSource`: the leader's admissions, step by step; responses go nowhere."""

    def __init__(self, tp) -> None:
        self.tp = tp

    def take(self, limit: int, block: bool) -> list[tuple[Hashable, list[int], int]] | None:
        message = self.tp.broadcast_from_leader()
        while message[0] == "idle":
            message = self.tp.broadcast_from_leader()
        if message[0] != "take":  # the leader left this run (it failed there): never decode out of step
            raise _LeaderMovedOn(message)
        return message[1]

    def finish(self, key: Hashable, token_ids: list[int], log_probs: list[float], finish_reason: str) -> None:
        pass
