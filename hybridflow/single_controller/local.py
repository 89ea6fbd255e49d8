"""Local mode: every worker of a group lives in the driver's process, so `breakpoint()` and debuggers work.

Same API as `RayWorkerGroup`. Calls run rank after rank, so workers that use collectives need
`world_size=1` here (a gloo group of one); `Worker.init_distributed` says so if asked for more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from hybridflow import env
from hybridflow.single_controller.base.worker import find_free_port
from hybridflow.single_controller.base.worker_group import WorkerError, WorkerGroup
from hybridflow.single_controller.ray.base import RayClassWithInitArgs


class LocalWorkerGroup(WorkerGroup):
    """Runs `world_size` workers in this process; calls execute eagerly, rank by rank."""

    def __init__(self, cls_with_init: RayClassWithInitArgs, world_size: int = 1, method_prefix: str = "") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        port = str(find_free_port())
        self._workers = []
        # Workers read rank, rendezvous and local mode from the environment in Worker.__init__ and keep them;
        # the driver's environment is restored afterwards so nothing leaks into Ray workers started later.
        with env.scoped_environ():
            env.set_local_mode(True)
            for rank in range(world_size):
                env.set_dist_env(rank, world_size, rank, "127.0.0.1", port)
                self._workers.append(cls_with_init.cls(*cls_with_init.args, **cls_with_init.kwargs))
        super().__init__(world_size=world_size)
        self._worker_cls = cls_with_init.cls
        self._bind_worker_methods(self._worker_cls, prefix=method_prefix)

    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    def spawn(self, prefix_set: list[str]) -> dict[str, LocalWorkerGroup]:
        """Per-role views of a colocated group (sharing the same worker objects)."""
        views = {}
        for role in prefix_set:
            view = object.__new__(LocalWorkerGroup)
            WorkerGroup.__init__(view, world_size=self.world_size)
            view._workers, view._worker_cls = self._workers, self._worker_cls
            view._bind_worker_methods(self._worker_cls, prefix=f"{role}__")
            views[role] = view
        return views

    def check_alive(self, timeout_s: float) -> int:
        """The heartbeat of `RayWorkerGroup`: workers in the driver's process are alive while it is."""
        return self.world_size

    def _execute(self, method_name: str, ranks: list[int], args: list[tuple], kwargs: list[dict]) -> list[Any]:
        results = []
        for rank, rank_args, rank_kwargs in zip(ranks, args, kwargs, strict=True):
            try:
                results.append(getattr(self._workers[rank], method_name)(*rank_args, **rank_kwargs))
            except Exception as err:  # re-raised with the rank and method, like the Ray group
                raise WorkerError(method_name, rank, f"it raised {type(err).__name__}: {err}") from err
        return results

    def _resolve(self, handles: list[Any], method_name: str, ranks: list[int]) -> list[Any]:
        return handles

    def _direct_caller(
        self, rank: int, method_name: str, concurrency_group: str | None = None
    ) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._workers[rank], method_name)  # every call gets its own thread: no groups needed

        async def call(*args: Any, **kwargs: Any) -> Any:
            # A thread per call, as a threaded Ray actor would: blocking workers batch concurrent calls.
            return await asyncio.to_thread(method, *args, **kwargs)

        return call
