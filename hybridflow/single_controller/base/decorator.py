"""`@register`: how a worker method's arguments are split across ranks and how results are collected.

A dispatch mode is a pair of functions registered under a name:
- `dispatch_fn(group, args, kwargs) -> Dispatched`: per-rank positional and keyword arguments,
- `collect_fn(group, outputs, dispatched) -> result`: one result from the per-rank outputs.

Built-in modes follow verl (`Dispatch.DP_COMPUTE_PROTO`, ...). Users add modes with `register_dispatch_mode`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.utils.registry import Registry

REGISTER_ATTR = "_hybridflow_register"


class Dispatch:
    """Names of the built-in dispatch modes (strings, so that custom modes are plain names too)."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRIC = "dp_compute_metric"
    DIRECT_ROLLOUT_METHOD = "direct_rollout_method"
    """Not a group call: each rank serves requests on its own (a generation server replica); the driver
    calls it per rank through `WorkerGroup.direct_callers(name)`."""


class Execute:
    """Which ranks run a method: every rank, or rank 0 only."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


class GroupInfo(Protocol):
    """What a dispatch function may ask of a worker group."""

    world_size: int

    def query_dispatch_info(self, mesh_name: str) -> list[tuple[int, int, bool]]: ...


@dataclass
class Dispatched:
    """Per-rank arguments produced by a dispatch function, plus what its collect function needs."""

    args: list[tuple] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)
    pad_size: int = 0
    collect_ranks: list[int] | None = None


@dataclass(frozen=True)
class DispatchMode:
    """A registered pair of dispatch and collect functions."""

    dispatch_fn: Callable[[GroupInfo, tuple, dict], Dispatched]
    collect_fn: Callable[[GroupInfo, list, Dispatched], Any]
    returns_proto: bool = False


DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode")


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[..., Any],
    collect_fn: Callable[..., Any],
    returns_proto: bool = False,
) -> str:
    """Add a custom dispatch mode; use the returned name (or `Dispatch.<name>`, as in verl) in
    `@register(dispatch_mode=...)`.

    hybridflow's form: `dispatch_fn(group, args, kwargs) -> Dispatched` and `collect_fn(group, outputs, dispatched)`.
    verl's form is taken as well: `dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`, each argument a
    list with one entry per rank, and `collect_fn(worker_group, outputs)`; it is told apart by the `*args`.
    """
    if _takes_verl_arguments(dispatch_fn):
        dispatch_fn = functools.partial(_verl_dispatch, dispatch_fn)
        collect_fn = functools.partial(_verl_collect, collect_fn)
    DISPATCH_MODES.register(name, DispatchMode(dispatch_fn, collect_fn, returns_proto))
    if name.isidentifier() and not hasattr(Dispatch, name):
        setattr(Dispatch, name, name)  # verl's Dispatch.register(name) makes Dispatch.<name>
    return name


def _takes_verl_arguments(dispatch_fn: Callable[..., Any]) -> bool:
    """Whether `dispatch_fn` is verl's form, `(worker_group, *args, **kwargs)`."""
    try:
        parameters = inspect.signature(dispatch_fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(parameter.kind is inspect.Parameter.VAR_POSITIONAL for parameter in parameters)


def _verl_dispatch(dispatch_fn: Callable[..., Any], group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    """A verl dispatch function's per-argument lists, turned into one argument set per rank."""
    split_args, split_kwargs = dispatch_fn(group, *args, **kwargs)
    return _per_rank_lists(group, tuple(split_args), dict(split_kwargs))


def _verl_collect(collect_fn: Callable[..., Any], group: GroupInfo, outputs: list, dispatched: Dispatched) -> Any:
    return collect_fn(group, outputs)


def get_dispatch_mode(name: str) -> DispatchMode:
    """The dispatch mode registered as `name` (KeyError lists the known ones)."""
    return DISPATCH_MODES.get(name)


# ---------------------------------------------------------------------------- built-in modes
def _replicate(group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    n = group.world_size
    return Dispatched(args=[args] * n, kwargs=[kwargs] * n)


def _per_rank_lists(group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    """Each argument is a list with one element per rank; rank i receives element i."""
    n = group.world_size
    for position, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"{type(value).__name__} of length {len(value)}" if hasattr(value, "__len__") else type(value).__name__
            raise ValueError(f"argument {position!r} must be a list with one entry per rank ({n}), got {got}")
    per_rank_args = [tuple(arg[i] for arg in args) for i in range(n)]
    per_rank_kwargs = [{key: value[i] for key, value in kwargs.items()} for i in range(n)]
    return Dispatched(args=per_rank_args, kwargs=per_rank_kwargs)


def _collect_list(group: GroupInfo, outputs: list, dispatched: Dispatched) -> list:
    return outputs


def _split_protos(args: tuple, kwargs: dict, chunks: int) -> Dispatched:
    """Chunk every DataProto (or future) argument into `chunks` parts; pad DataProtos cyclically first."""
    lengths = {len(value) for value in [*args, *kwargs.values()] if isinstance(value, DataProto)}
    if len(lengths) > 1:
        raise ValueError(f"DataProto arguments of one call must have the same length, got {sorted(lengths)}")
    pad_size = 0

    def split(value: Any) -> list:
        nonlocal pad_size
        if isinstance(value, DataProto):
            padded, pad_size = pad_dataproto_to_divisor(value, chunks)
            return padded.chunk(chunks)
        if isinstance(value, DataProtoFuture):
            return value.chunk(chunks)
        raise TypeError(
            f"DP_COMPUTE_PROTO arguments must be DataProto or DataProtoFuture, got {type(value).__name__}"
        )

    split_args = [split(value) for value in args]
    split_kwargs = {key: split(value) for key, value in kwargs.items()}
    return Dispatched(
        args=[tuple(parts[i] for parts in split_args) for i in range(chunks)],
        kwargs=[{key: parts[i] for key, parts in split_kwargs.items()} for i in range(chunks)],
        pad_size=pad_size,
    )


def _dp_compute_proto(group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    return _split_protos(args, kwargs, group.world_size)


def _dp_compute_proto_with_func(group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    if not args or not callable(args[0]):
        raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC needs a function as the first argument")
    dispatched = _split_protos(args[1:], kwargs, group.world_size)
    dispatched.args = [(args[0], *rank_args) for rank_args in dispatched.args]
    return dispatched


def _concat_protos(outputs: list) -> DataProto:
    for output in outputs:
        if not isinstance(output, DataProto):
            raise TypeError(f"a DataProto-collecting method returned {type(output).__name__}, not DataProto")
    return DataProto.concat(outputs)


def _collect_proto(group: GroupInfo, outputs: list, dispatched: Dispatched) -> DataProto:
    return _unpad(_concat_protos(outputs), outputs, dispatched)


def _unpad(collected: DataProto, outputs: list, dispatched: Dispatched) -> DataProto:
    """`collected` without the rows the dispatch padded: the padding is the batch's last rows, so each rank must
    return one row per row it was given, or a real row would be removed in place of a padding row."""
    if dispatched.pad_size:
        given = []
        for rank, rank_args in enumerate(dispatched.args):
            rank_kwargs = dispatched.kwargs[rank] if rank < len(dispatched.kwargs) else {}
            protos = [value for value in (*rank_args, *rank_kwargs.values()) if isinstance(value, DataProto)]
            if protos:
                given.append(len(protos[0]))
        returned = [len(output) for output in outputs]
        if len(given) == len(returned) and returned != given:
            raise ValueError(
                f"a DataProto-collecting method returned {returned} rows from ranks given {given}: the batch was "
                f"padded by {dispatched.pad_size} rows to split over {len(given)} ranks, and the padding can be "
                "removed only when each rank returns one row per input row. Return one row per row, or pass a "
                f"batch whose length divides by {len(given)}"
            )
    return unpad_dataproto(collected, dispatched.pad_size)


register_dispatch_mode(Dispatch.ONE_TO_ALL, _replicate, _collect_list)
register_dispatch_mode(Dispatch.ALL_TO_ALL, _per_rank_lists, _collect_list)
register_dispatch_mode(Dispatch.DP_COMPUTE, _per_rank_lists, _collect_list)
register_dispatch_mode(Dispatch.DP_COMPUTE_PROTO, _dp_compute_proto, _collect_proto, returns_proto=True)
register_dispatch_mode(
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, _dp_compute_proto_with_func, _collect_proto, returns_proto=True
)
register_dispatch_mode(Dispatch.DP_COMPUTE_METRIC, _dp_compute_proto, _collect_list)


def _refuse_group_call(group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    raise TypeError(
        "this method is registered with Dispatch.DIRECT_ROLLOUT_METHOD: call it on one rank through "
        "`group.direct_callers(name)[rank]`, not on the whole group"
    )


register_dispatch_mode(Dispatch.DIRECT_ROLLOUT_METHOD, _refuse_group_call, _collect_list)


# ---------------------------------------------------------------------------- mesh-aware mode
def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> str:
    """A dispatch mode for a named device mesh: one shard per data-parallel rank.

    Each worker reports `(dp_rank, dp_size, is_collect)` for `mesh_name` via
    `Worker.register_dispatch_collect_info`. Ranks of one data-parallel group (tensor- or
    sequence-parallel peers) receive the same shard; only the rank marked `is_collect` in each
    group contributes to the result. Returns the mode's name (created once per mesh name).
    """
    name = f"nd_compute_proto:{mesh_name}"
    if name in DISPATCH_MODES:
        return name

    def dispatch(group: GroupInfo, args: tuple, kwargs: dict) -> Dispatched:
        info = group.query_dispatch_info(mesh_name)
        dp_size = info[0][1]
        shards = _split_protos(args, kwargs, dp_size)
        return Dispatched(
            args=[shards.args[dp_rank] for dp_rank, _, _ in info],
            kwargs=[shards.kwargs[dp_rank] for dp_rank, _, _ in info],
            pad_size=shards.pad_size,
            collect_ranks=sorted((i for i, (_, _, keep) in enumerate(info) if keep), key=lambda i: info[i][0]),
        )

    def collect(group: GroupInfo, outputs: list, dispatched: Dispatched) -> DataProto:
        assert dispatched.collect_ranks is not None
        kept = [outputs[rank] for rank in dispatched.collect_ranks]
        shards = Dispatched(args=[dispatched.args[rank] for rank in dispatched.collect_ranks],
                            kwargs=[dispatched.kwargs[rank] for rank in dispatched.collect_ranks],
                            pad_size=dispatched.pad_size)
        return _unpad(_concat_protos(kept), kept, shards)

    return register_dispatch_mode(name, dispatch, collect, returns_proto=True)


# ---------------------------------------------------------------------------- the decorator
@dataclass(frozen=True)
class MethodSpec:
    """What `@register` recorded on a worker method."""

    dispatch_mode: str
    execute_mode: str
    blocking: bool
    materialize_futures: bool


def register(
    dispatch_mode: str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: str = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[Callable], Callable]:
    """Mark a `Worker` method as callable on a whole worker group.

    Args:
        dispatch_mode: a `Dispatch` name or a custom mode's name (`register_dispatch_mode`), or verl's dict
            `{"dispatch_fn": ..., "collect_fn": ...}`: how arguments are split and results collected.
        execute_mode: `Execute.ALL` runs on every rank, `Execute.RANK_ZERO` only on rank 0.
        blocking: False makes the group method return a future (`DataProtoFuture` for DataProto modes).
        materialize_futures: resolve `DataProtoFuture` arguments inside the worker before the call.
    """
    if isinstance(dispatch_mode, dict):  # verl's {"dispatch_fn": ..., "collect_fn": ...}
        missing = sorted({"dispatch_fn", "collect_fn"} - set(dispatch_mode))
        if missing:
            raise ValueError(f"a dispatch_mode dict needs 'dispatch_fn' and 'collect_fn', missing {missing}")
        functions = dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"]
        dispatch_mode = "custom:" + ":".join(f"{f.__module__}.{f.__qualname__}" for f in functions)
        if dispatch_mode not in DISPATCH_MODES:
            register_dispatch_mode(dispatch_mode, *functions)
    get_dispatch_mode(dispatch_mode)  # fail at import time on unknown names
    if execute_mode not in (Execute.ALL, Execute.RANK_ZERO):
        raise ValueError(f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}")
    if execute_mode == Execute.RANK_ZERO and dispatch_mode != Dispatch.ONE_TO_ALL:
        raise ValueError(
            f"execute_mode=Execute.RANK_ZERO runs rank 0 alone, but dispatch_mode={dispatch_mode!r} gives each rank "
            "its own share of the arguments (rank 0 would see only its share, and the rest would be dropped "
            "silently); use dispatch_mode=Dispatch.ONE_TO_ALL with it"
        )
    spec = MethodSpec(dispatch_mode, execute_mode, blocking, materialize_futures)

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            if spec.materialize_futures:
                args = tuple(_materialize(value) for value in args)
                kwargs = {key: _materialize(value) for key, value in kwargs.items()}
            result = func(self, *args, **kwargs)
            return _run_to_completion(result, func) if inspect.iscoroutine(result) else result

        setattr(inner, REGISTER_ATTR, spec)
        return inner

    return decorator


def _run_to_completion(coroutine: Any, func: Callable) -> Any:
    """An `async def` worker method's result (verl registers some): run in an event loop of this call's own, as
    worker methods run in threads without one. Inside a running loop it cannot block, so it is refused."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    coroutine.close()
    raise RuntimeError(f"{func.__qualname__} is an async @register method called from a running event loop; call "
                       "it from the driver's group method, or make it a plain method")


def _materialize(value: Any) -> Any:
    return value.get() if isinstance(value, DataProtoFuture) else value


def get_method_spec(method: Callable) -> MethodSpec | None:
    """The `MethodSpec` recorded by `@register`, or None for plain methods."""
    return getattr(method, REGISTER_ATTR, None)
