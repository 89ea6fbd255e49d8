"""`WorkerGroup`: the driver-side handle of N SPMD workers; each `@register`ed method becomes a group method."""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.single_controller.base.decorator import (
    Dispatch,
    Dispatched,
    Execute,
    MethodSpec,
    get_dispatch_mode,
    get_method_spec,
)


# Worker methods the group implements itself (with caching or before the group exists).
_GROUP_OWN_METHODS = frozenset({"query_dispatch_info", "get_master_addr_port"})



CONTROL_GROUP = "control"
"""A Ray concurrency group of one thread on workers that serve many blocking requests at once (the rollout
replicas' `generate_tokens`): calls made in it (`direct_callers(name, CONTROL_GROUP)`, e.g. aborting a step's
requests) run even while every default thread waits on a request."""

class WorkerError(RuntimeError):
    """A worker raised or died during a group call; names the rank, the method and (if known) the group."""

    def __init__(self, method: str, rank: int, detail: str, group: str = "") -> None:
        where = f" of worker group {group!r}" if group else ""
        super().__init__(f"worker rank {rank}{where} failed in {method!r}: {detail}")
        self.method = method
        self.rank = rank
        self.group = group


class WorkerTimeoutError(WorkerError):
    """Ranks did not answer a call (or a heartbeat) in time: hung, stopped, or waiting on a hung peer.

    `rank` is the first rank that did not answer and `ranks` all of them.
    """

    def __init__(self, method: str, ranks: list[int], detail: str, group: str = "") -> None:
        RuntimeError.__init__(self, f"worker group {group or '?'!r} timed out in {method!r}: {detail}")
        self.method = method
        self.rank = ranks[0]
        self.ranks = list(ranks)
        self.group = group


@dataclass(frozen=True)
class GroupShape:
    """The part of a worker group that collect functions may read; small enough to ship inside futures."""

    world_size: int


def _collect_with(collect_fn: Callable, shape: GroupShape, dispatched: Dispatched, outputs: list) -> Any:
    return collect_fn(shape, outputs, dispatched)


def registered_methods(worker_cls: type) -> dict[str, MethodSpec]:
    """Names and specs of every `@register`ed method of `worker_cls` (including inherited ones)."""
    methods = {}
    for name, member in inspect.getmembers(worker_cls, predicate=callable):
        spec = get_method_spec(member)
        if spec is not None:
            methods[name] = spec
    return methods


class WorkerGroup(abc.ABC):
    """Calls methods on every rank: split arguments (dispatch), run (execute), merge results (collect).

    Subclasses say how to run one method on a list of ranks: `_execute(method_name, ranks, args, kwargs)`
    returns per-rank handles, and `_resolve(handles, method_name, ranks)` turns them into values.
    """

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._dispatch_info_cache: dict[str, list[tuple[int, int, bool]]] = {}
        self._method_prefix = ""

    @property
    def world_size(self) -> int:
        return self._world_size

    # ------------------------------------------------------------------ subclass interface
    @abc.abstractmethod
    def _execute(self, method_name: str, ranks: list[int], args: list[tuple], kwargs: list[dict]) -> list[Any]:
        """Start `method_name` on `ranks` with per-rank arguments; return one handle per rank."""

    @abc.abstractmethod
    def _resolve(self, handles: list[Any], method_name: str, ranks: list[int]) -> list[Any]:
        """Wait for `handles`; raise `WorkerError` naming the first rank that failed."""

    @abc.abstractmethod
    def _direct_caller(
        self, rank: int, method_name: str, concurrency_group: str | None = None
    ) -> Callable[..., Awaitable[Any]]:
        """An async function calling `method_name` on `rank` alone (concurrent calls allowed)."""

    def direct_callers(self, name: str, concurrency_group: str | None = None) -> list[Callable[..., Awaitable[Any]]]:
        """One async function per rank calling the worker method `name` on that rank only.

        For `Dispatch.DIRECT_ROLLOUT_METHOD` methods (generation server replicas); awaiting many calls at
        once runs them concurrently in the workers. `concurrency_group`: run the calls on that group's threads
        (declared when the workers were made, `CONTROL_GROUP`), so that they never wait behind the default
        threads' backlog of requests.
        """
        return [
            self._direct_caller(rank, self._method_prefix + name, concurrency_group) for rank in range(self.world_size)
        ]

    def _make_future(self, handles: list[Any], collect: Callable[[list[Any]], Any], returns_proto: bool) -> Any:
        """What a non-blocking call returns; the default resolves at once (no asynchrony)."""
        return collect(self._resolve(handles, "<future>", list(range(len(handles)))))

    # ------------------------------------------------------------------ binding
    def _bind_worker_methods(self, worker_cls: type, prefix: str = "") -> list[str]:
        """Add a group method for each `@register`ed method of `worker_cls` (strip `prefix` from names)."""
        self._method_prefix = prefix
        bound = []
        for name, spec in registered_methods(worker_cls).items():
            if prefix and not name.startswith(prefix):
                continue
            public_name = name[len(prefix) :]
            if public_name in _GROUP_OWN_METHODS:
                continue
            if hasattr(self, public_name):
                raise ValueError(f"worker method {public_name!r} clashes with a WorkerGroup attribute; rename it")
            setattr(self, public_name, functools.partial(self._call, name, spec))
            bound.append(public_name)
        return bound

    def _call(self, method_name: str, spec: MethodSpec, *args: Any, **kwargs: Any) -> Any:
        mode = get_dispatch_mode(spec.dispatch_mode)
        dispatched = mode.dispatch_fn(self, args, kwargs)
        if len(dispatched.args) != self.world_size:
            raise ValueError(
                f"dispatch mode {spec.dispatch_mode!r} produced {len(dispatched.args)} argument sets "
                f"for {self.world_size} ranks"
            )
        if spec.execute_mode == Execute.RANK_ZERO:
            handles = self._execute(method_name, [0], dispatched.args[:1], dispatched.kwargs[:1])
            if not spec.blocking:
                return handles[0]
            return self._resolve(handles, method_name, [0])[0]
        ranks = list(range(self.world_size))
        handles = self._execute(method_name, ranks, dispatched.args, dispatched.kwargs)

        # A partial of module-level functions, not a closure over self: futures travel to other workers.
        collect = functools.partial(_collect_with, mode.collect_fn, GroupShape(self.world_size), dispatched)

        if not spec.blocking:
            return self._make_future(handles, collect, mode.returns_proto)
        return collect(self._resolve(handles, method_name, ranks))

    # ------------------------------------------------------------------ helpers
    def query_dispatch_info(self, mesh_name: str) -> list[tuple[int, int, bool]]:
        """Each rank's `(dp_rank, dp_size, is_collect)` for `mesh_name` (asked once, then cached)."""
        if mesh_name not in self._dispatch_info_cache:
            spec = MethodSpec(Dispatch.ONE_TO_ALL, Execute.ALL, True, False)
            method = f"{self._method_prefix}query_dispatch_info"
            info = [tuple(item) for item in self._call(method, spec, mesh_name)]
            sizes = {dp_size for _, dp_size, _ in info}
            if len(sizes) != 1:
                raise ValueError(f"ranks disagree on the dp size of mesh {mesh_name!r}: {sorted(sizes)}")
            self._dispatch_info_cache[mesh_name] = info
        return self._dispatch_info_cache[mesh_name]

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method_name` on every rank with the same arguments; return the per-rank results."""
        ranks = list(range(self.world_size))
        handles = self._execute(method_name, ranks, [args] * self.world_size, [kwargs] * self.world_size)
        return self._resolve(handles, method_name, ranks)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method_name` on rank 0 only and return its result."""
        return self._resolve(self._execute(method_name, [0], [args], [kwargs]), method_name, [0])[0]
