"""The driver-side client of the generation servers: routes requests to rollout replicas.

Requests of one conversation (one `request_id`) go to the same replica, so an engine with prefix caching
can reuse the conversation's KV cache; a new conversation goes to the replica with the fewest requests in
flight. The mapping is an LRU of bounded size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from hybridflow.engines.rollout.base import ABORTED, SamplingParams
from hybridflow.engines.rollout.server import TokenOutput

ReplicaCall = Callable[..., Awaitable[Any]]
"""`await call(request_id, prompt_ids, sampling_params) -> TokenOutput` on one replica."""

MAX_REQUESTS_AFTER_ABORT = 64
"""Requests one trajectory may send after its first aborted answer: every one is answered at once, empty, so a loop
that never checks `finish_reason == 'abort'` would spin; past this many it fails, naming the fix."""


class AsyncLLMServerManager:
    """Sticky, least-loaded routing of token requests over replica callers (`WorkerGroup.direct_callers`)."""

    def __init__(self, replicas: Sequence[ReplicaCall], max_cache_size: int = 10_000) -> None:
        if not replicas:
            raise ValueError("AsyncLLMServerManager needs at least one replica")
        self.replicas = list(replicas)
        self.max_cache_size = max_cache_size
        self.in_flight = [0] * len(self.replicas)
        self.routed = [0] * len(self.replicas)
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self.aborted: dict[str, int] = {}
        """Request id -> aborted answers it got (finish_reason 'abort', `GenerationServer.abort`); the caller clears
        it at each step."""

    def replica_for(self, request_id: str) -> int:
        """The replica serving `request_id` (chosen now if new)."""
        if request_id in self._sticky:
            self._sticky.move_to_end(request_id)
            return self._sticky[request_id]
        replica = min(range(len(self.replicas)), key=lambda i: (self.in_flight[i], self.routed[i]))
        self._sticky[request_id] = replica
        if len(self._sticky) > self.max_cache_size:
            self._sticky.popitem(last=False)
        return replica

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> TokenOutput:
        """One request; returns the replica's `TokenOutput`."""
        replica = self.replica_for(request_id)
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        try:
            output = await self.replicas[replica](request_id, prompt_ids, sampling_params)
        finally:
            self.in_flight[replica] -= 1
        if output.finish_reason == ABORTED:
            self.aborted[request_id] = self.aborted.get(request_id, 0) + 1
            if self.aborted[request_id] > MAX_REQUESTS_AFTER_ABORT:
                raise RuntimeError(
                    f"trajectory {request_id!r} sent {MAX_REQUESTS_AFTER_ABORT} more requests after over-sampling "
                    "aborted its step; an agent loop must return once a turn's finish_reason is 'abort' "
                    "(AgentLoopBase), or set actor_rollout_ref.rollout.over_sample_rate=0"
                )
        return output
