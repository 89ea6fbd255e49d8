"""Ray implementation of the controller: resource pools (placement groups), remote classes, worker groups."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

try:  # Ray is needed only to start actors; local mode (LocalWorkerGroup) runs without it
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _ray_import_error:
    ray = None
    _RAY_ERROR: ImportError | None = _ray_import_error
else:
    _RAY_ERROR = None

from hybridflow.protocol import DataProtoFuture
from hybridflow.single_controller.base.worker import ProcessInfo
from hybridflow.single_controller.base.worker_group import WorkerError, WorkerGroup, WorkerTimeoutError
from hybridflow.single_controller.ray.hang_stacks import write_hang_report

logger = logging.getLogger(__name__)

# How long a placement group may wait for resources that exist but are held by other jobs.
PLACEMENT_TIMEOUT_S = 60.0
# How long a query of Ray's control store (GCS: the node table, free resources) may take. Ray's Python calls for them
# have no timeout, and a C call cannot be interrupted by pytest-timeout or Ctrl-C: a lost GCS would hang the driver.
GCS_TIMEOUT_S = 60.0
# How long an actor may take to come up (Ray starts a process, imports torch): generous, but bounded.
ACTOR_START_TIMEOUT_S = 300.0
# What to raise when a call or the start of the workers times out (the trainer's key in parentheses).
_CALL_SETTING = "rpc_timeout_s (trainer.rpc_timeout_s)"
_START_SETTING = f"rpc_timeout_s (trainer.rpc_timeout_s) above the {ACTOR_START_TIMEOUT_S:g} s that starting may take"


def require_ray() -> None:
    """Raise a clear ImportError when Ray is not installed (local mode does not need it)."""
    if ray is None:
        raise ImportError(
            "this needs Ray (pip install ray==2.60.0); to run without Ray use trainer.local_mode=True"
        ) from _RAY_ERROR


_T = TypeVar("_T")


def ask_gcs(what: str, query: Callable[[], _T], timeout_s: float = GCS_TIMEOUT_S) -> _T:
    """`query()` (a call to Ray's GCS) in a daemon thread; a `TimeoutError` naming `what` after `timeout_s`.

    The thread of a query that never returns is left behind (it cannot be stopped), and as a daemon it does not keep
    the process alive."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, query()))
        except BaseException as error:  # handed to the caller below, which raises it again  # noqa: BLE001
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=f"gcs query: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(
            f"Ray's GCS did not answer {what} within {timeout_s:g} s: the cluster's head node is down or overloaded "
            "(check `ray status`, and RAY_ADDRESS if you joined a cluster)"
        )
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


_PEER_GRACE_S = 2.0
"""How long a failed call waits for the other ranks' outcomes, to name a dead rank rather than a peer that saw it."""


class RayResourcePool:
    """One STRICT_SPREAD placement group of one bundle per node: bundle `i` holds the `process_on_nodes[i]` ranks of
    node `i`, each rank `num_cpus_per_worker` CPUs (1 GPU with `use_gpu`), shared by `max_colocate_count` actors
    (verl's default 10: worker groups made on one pool colocate, each actor asking for a tenth of its rank's share).

    STRICT_SPREAD puts every bundle on a distinct Ray node (by node id: two raylets on one host are two nodes) or
    places none. One STRICT_PACK group per node could land two "nodes" on one machine; node affinity would make
    the driver choose node ids that Ray's scheduler knows better.
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 10,
        num_cpus_per_worker: float = 1.0,
        name_prefix: str = "hybridflow",
    ) -> None:
        require_ray()
        if not process_on_nodes or any(count <= 0 for count in process_on_nodes):
            raise ValueError(f"process_on_nodes must be positive counts, got {process_on_nodes}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.num_cpus_per_worker = num_cpus_per_worker
        self.name_prefix = name_prefix
        self._placement_group: PlacementGroup | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def node_bundles(self) -> list[dict[str, float]]:
        """Resources of each node's bundle: its ranks' CPUs (and GPUs)."""
        bundles = []
        for count in self.process_on_nodes:
            bundle = {"CPU": count * self.num_cpus_per_worker}
            if self.use_gpu:
                bundle["GPU"] = float(count)
            bundles.append(bundle)
        return bundles

    def get_placement_group(self) -> PlacementGroup:
        """Create (once) and return the placement group, waiting until it is placed.

        A cluster with too few nodes able to hold a node bundle fails at once; one whose resources are taken
        fails after `PLACEMENT_TIMEOUT_S`. Both errors say what was asked and what the cluster has.
        """
        if self._placement_group is None:
            self._check_enough_nodes()
            name = f"{self.name_prefix}_{uuid.uuid4().hex[:8]}"
            group = placement_group(self.node_bundles(), strategy="STRICT_SPREAD", name=name)
            ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                remove_placement_group(group)  # a pending group would take its CPUs as soon as they free up
                raise RuntimeError(
                    f"{self._request()}; it was not placed within {PLACEMENT_TIMEOUT_S:g} s, as other jobs hold "
                    f"resources: free now {_wanted(ask_gcs('the free resources', ray.available_resources))}. The "
                    f"cluster has {describe_cluster()}"
                )
            self._placement_group = group
        return self._placement_group

    def _check_enough_nodes(self) -> None:
        """Fail fast when fewer alive nodes than the pool's nodes could hold even its smallest node bundle."""
        smallest = min(self.node_bundles(), key=lambda bundle: bundle["CPU"])
        nodes = ask_gcs("the node table (to check the cluster can hold the pool)", ray.nodes)
        hosts = [node for node in nodes if node["Alive"] and _fits(smallest, node["Resources"])]
        if len(hosts) < len(self.process_on_nodes):
            raise RuntimeError(
                f"{self._request()}, but only {len(hosts)} node(s) of the cluster have that much. The cluster has "
                f"{describe_cluster()}. Lower the pool's nnodes / n_gpus_per_node (trainer.* or rollout.*), or add "
                "nodes (`ray start --address=<head>:6379` on each; the embedded cluster has one node) and join the "
                "cluster with RAY_ADDRESS"
            )

    def _request(self) -> str:
        bundles = [_wanted(bundle) for bundle in self.node_bundles()]
        each = f"{bundles[0]} each" if bundles.count(bundles[0]) == len(bundles) else " + ".join(map(str, bundles))
        return (
            f"resource pool {self.name_prefix!r} needs {len(bundles)} distinct Ray node(s) with {each} "
            f"(ranks per node {self.process_on_nodes}, {self.num_cpus_per_worker:g} CPU per rank)"
        )

    def release(self) -> None:
        """Remove the placement group (the actors in it must be gone)."""
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
        self._placement_group = None


def node_ranks(process_on_nodes: list[int]) -> list[range]:
    """The global ranks on each node, in order: node 0 hosts ranks 0..n0-1, node 1 the next n1, and so on."""
    starts = [sum(process_on_nodes[:node]) for node in range(len(process_on_nodes))]
    return [range(start, start + count) for start, count in zip(starts, process_on_nodes)]


def _fits(bundle: dict[str, float], resources: dict[str, float]) -> bool:
    return all(resources.get(name, 0.0) >= amount for name, amount in bundle.items())


def _wanted(resources: dict[str, float]) -> dict[str, float]:
    """The resources placement asks for (CPU, GPU), without Ray's memory and node labels."""
    return {name: resources.get(name, 0.0) for name in ("CPU", "GPU") if name == "CPU" or resources.get(name)}


def describe_cluster() -> str:
    """The connected cluster's alive nodes with their total CPUs and GPUs (the run log, placement errors)."""
    nodes = [node for node in ask_gcs("the node table", ray.nodes) if node["Alive"]]
    listed = ", ".join(
        f"node {node['NodeID'][:12]} ({node['NodeManagerAddress']}) {_wanted(node['Resources'])}" for node in nodes
    )
    return f"{len(nodes)} alive node{'s' if len(nodes) != 1 else ''}: {listed}"


class RayClassWithInitArgs:
    """A worker class plus its constructor arguments, turned into Ray actors by a worker group."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        """`cls`: the worker class, or (as verl requires it) `ray.remote(cls)`, whose class is taken."""
        self.cls = getattr(cls, "__ray_actor_class__", cls)
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Extra `ray.remote` options (e.g. `runtime_env`) for every actor made from this class."""
        self.options.update(options)

    def create_actor(
        self,
        placement_group: PlacementGroup,
        bundle_index: int,
        num_cpus: float,
        num_gpus: float,
        env_vars: dict[str, str],
        name: str,
    ) -> ray.actor.ActorHandle:
        """Start one actor in `placement_group`'s bundle `bundle_index` with the given environment."""
        options = dict(self.options)
        runtime_env = dict(options.pop("runtime_env", {}))
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env_vars}
        groups = options.pop("concurrency_groups", None)  # a class option of Ray's, refused by `.options()`
        remote_cls = ray.remote(concurrency_groups=groups)(self.cls) if groups else ray.remote(self.cls)
        return remote_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index
            ),
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            runtime_env=runtime_env,
            name=name,
            **options,
        ).remote(*self.args, **self.kwargs)


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per bundle of a `RayResourcePool`; every `@register`ed method becomes a group method.

    A call waits at most `rpc_timeout_s` (None: no limit) for every rank. The first rank that raises or dies
    stops the call at once with a `WorkerError` naming the group (`name`), the method and the rank, with the
    worker's traceback; ranks that do not answer in time stop it with a `WorkerTimeoutError` naming them, their
    pids and nodes. `check_alive` is a heartbeat for between calls.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        worker_handles: list[ray.actor.ActorHandle] | None = None,
        method_prefix: str = "",
        worker_cls: type | None = None,
        rpc_timeout_s: float | None = None,
        name: str | None = None,
        process_info: list[ProcessInfo] | None = None,
        stack_dump_dir: str | None = None,
    ) -> None:
        require_ray()
        if rpc_timeout_s is not None and not rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be > 0 seconds or None (no limit), got {rpc_timeout_s}")
        self.rpc_timeout_s = rpc_timeout_s
        self.name = name or name_prefix or "hybridflow"
        # Where a timeout writes every rank's Python stacks (trainers: the run directory).
        self.stack_dump_dir = Path(stack_dump_dir or tempfile.gettempdir())
        self._method_prefix = method_prefix
        self._process_info = list(process_info) if process_info else None
        if worker_handles is not None:
            if worker_cls is None:
                raise ValueError("worker_cls is needed when attaching to existing worker_handles")
            self._workers = list(worker_handles)
            self._worker_cls = worker_cls
        else:
            if resource_pool is None or ray_cls_with_init is None:
                raise ValueError("RayWorkerGroup needs a resource_pool and a ray_cls_with_init")
            self._worker_cls = ray_cls_with_init.cls
            self._workers = self._start_workers(resource_pool, ray_cls_with_init, name_prefix or "hybridflow")
        super().__init__(world_size=len(self._workers))
        self._bind_worker_methods(self._worker_cls, prefix=method_prefix)

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        return list(self._workers)

    @property
    def process_info(self) -> list[ProcessInfo] | None:
        """Each rank's node IP, pid and Ray node id, as the workers reported them at start (None if attached)."""
        return None if self._process_info is None else list(self._process_info)

    def _start_workers(
        self, pool: RayResourcePool, cls_with_init: RayClassWithInitArgs, name_prefix: str
    ) -> list[ray.actor.ActorHandle]:
        group = pool.get_placement_group()
        world_size = pool.world_size
        num_cpus = pool.num_cpus_per_worker / pool.max_colocate_count
        num_gpus = (1 / pool.max_colocate_count) if pool.use_gpu else 0
        ranks_by_node = node_ranks(pool.process_on_nodes)
        slots = [(node, local) for node, ranks in enumerate(ranks_by_node) for local in range(len(ranks))]  # per rank
        workers: list[ray.actor.ActorHandle] = []
        master = {"MASTER_ADDR": "", "MASTER_PORT": ""}  # rank 0 must not inherit a stale rendezvous
        # Starting a process and importing torch may take long on a busy machine, but not forever.
        start_timeout_s = None if self.rpc_timeout_s is None else max(ACTOR_START_TIMEOUT_S, self.rpc_timeout_s)
        # All ranks start at once; rank 0 then chooses the rendezvous and the others learn it before any other call.
        for rank, (node, local_rank) in enumerate(slots):
            env_vars = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                        "LOCAL_WORLD_SIZE": str(len(ranks_by_node[node]))}
            env_vars.update(master)
            suffix = f"{name_prefix}_{ray.get_runtime_context().get_job_id()}_{id(self):x}_{rank}"
            workers.append(cls_with_init.create_actor(group, node, num_cpus, num_gpus, env_vars, suffix))
        handles = [workers[0].get_master_addr_port.remote()]
        addr, port = self._wait(handles, "get_master_addr_port", [0], start_timeout_s, _START_SETTING)[0]
        handles = [actor.set_master_addr_port.remote(addr, port) for actor in workers[1:]]
        self._wait(handles, "__init__", list(range(1, world_size)), start_timeout_s, _START_SETTING)
        handles = [actor.process_info.remote() for actor in workers]
        self._process_info = self._wait(handles, "__init__", list(range(world_size)), start_timeout_s, _START_SETTING)
        logger.info("%s", self.describe_ranks())
        return workers

    def describe_ranks(self) -> str:
        """Where each rank runs (Ray node id, IP, pid), one line per rank; logged when the workers start."""
        info = self._process_info or []
        nodes = len({process.node_id for process in info})
        lines = [f"[placement] {self.name}: {len(info)} ranks on {nodes} Ray node{'s' if nodes != 1 else ''}"]
        lines += [
            f"  rank {rank}: node {process.node_id}, ip {process.node_ip}, pid {process.pid}"
            for rank, process in enumerate(info)
        ]
        return "\n".join(lines)

    def spawn(self, prefix_set: list[str]) -> dict[str, RayWorkerGroup]:
        """Split a colocated group into one group per role (named after it), sharing the same actors."""
        return {
            role: RayWorkerGroup(
                worker_handles=self._workers, method_prefix=f"{role}__", worker_cls=self._worker_cls,
                rpc_timeout_s=self.rpc_timeout_s, name=role, process_info=self._process_info,
                stack_dump_dir=str(self.stack_dump_dir),
            )
            for role in prefix_set
        }

    def check_alive(self, timeout_s: float) -> int:
        """Heartbeat: every worker process must answer a no-op within `timeout_s`. A dead one raises `WorkerError`,
        one that does not answer (hung, stopped, its node gone) `WorkerTimeoutError`. Returns the number of
        processes. Call it between group calls: an actor runs one call at a time, so a ping waits behind a long one."""
        ranks = list(range(len(self._workers)))
        handles = [worker.__ray_ready__.remote() for worker in self._workers]
        self._wait(handles, "heartbeat", ranks, timeout_s, "the heartbeat timeout (trainer.heartbeat_timeout_s)")
        return len(ranks)

    # ------------------------------------------------------------------ execution
    def _execute(self, method_name: str, ranks: list[int], args: list[tuple], kwargs: list[dict]) -> list[Any]:
        return [
            getattr(self._workers[rank], method_name).remote(*rank_args, **rank_kwargs)
            for rank, rank_args, rank_kwargs in zip(ranks, args, kwargs, strict=True)
        ]

    def _resolve(self, handles: list[Any], method_name: str, ranks: list[int]) -> list[Any]:
        """Wait for all ranks, at most `rpc_timeout_s`; the first failure (error or dead process) raises at once."""
        return self._wait(handles, method_name, ranks, self.rpc_timeout_s, _CALL_SETTING)

    def _wait(
        self, handles: list[Any], method_name: str, ranks: list[int], timeout_s: float | None, setting: str
    ) -> list[Any]:
        method = self._public_name(method_name)
        pending = {handle: position for position, handle in enumerate(handles)}
        results: list[Any] = [None] * len(handles)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not ready and time.monotonic() < deadline:
                continue  # ray.wait can return a few microseconds before its timeout: wait out the rest
            if not ready:
                missing = sorted(ranks[position] for position in pending.values())
                raise self._timeout_error(method, missing, ranks, timeout_s, setting)
            for handle in ready:
                position = pending.pop(handle)
                try:
                    results[position] = self._get(handle, method, ranks[position])
                except WorkerError as error:
                    root = self._root_cause(error, pending, method, ranks)
                    raise root from (root.__cause__ if root is not error else error.__cause__)
        return results

    def _root_cause(self, error: WorkerError, pending: dict[Any, int], method: str, ranks: list[int]) -> WorkerError:
        """A rank that raised may only have seen a peer die inside a collective (e.g. gloo's "connection closed"):
        give the other ranks `_PEER_GRACE_S` to report, and name a dead one first."""
        if not pending or isinstance(error.__cause__, ray.exceptions.RayActorError):
            return error
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_PEER_GRACE_S)
        for handle in ready:
            try:
                ray.get(handle)
            except ray.exceptions.RayActorError as err:
                rank = ranks[pending[handle]]
                first_line = str(error).splitlines()[0]
                detail = f"{self._death_detail(err)}\n(rank {error.rank} failed after it: {first_line})"
                death = WorkerError(method, rank, detail, self.name)
                death.__cause__ = err
                return death
            except Exception:  # noqa: BLE001  (another rank's own error: the first one stays the report)
                continue
        return error

    def _get(self, handle: Any, method: str, rank: int) -> Any:
        try:
            return ray.get(handle)
        except ray.exceptions.RayTaskError as err:  # its str carries the worker's traceback
            raise WorkerError(method, rank, f"it raised:\n{err}", self.name) from err
        except ray.exceptions.RayActorError as err:
            raise WorkerError(method, rank, self._death_detail(err), self.name) from err

    def _death_detail(self, err: Exception) -> str:
        # A crash's Python traceback (faulthandler, on in Ray workers) goes to the worker's stderr: Ray's log of
        # that pid, which the driver also prints with log_to_driver.
        return (
            f"its process died ({type(err).__name__}): {err}\nA crash's traceback, if the process printed one, "
            "is in that worker's log (Ray's logs/worker-*-<pid>.err, also printed by the driver under its pid)"
        )

    def _timeout_error(
        self, method: str, missing: list[int], ranks: list[int], timeout_s: float | None, setting: str
    ) -> WorkerTimeoutError:
        answered = sorted(set(ranks) - set(missing))
        where = ", ".join(self._describe_rank(rank) for rank in missing)
        detail = (
            f"{'rank' if len(missing) == 1 else 'ranks'} {where} did not answer within {timeout_s:g} s "
            f"({f'ranks {answered} did' if answered else 'no rank answered'}). A hung rank (a deadlock, a "
            f"collective waiting on a hung or dead peer, a stopped process) stops the run here; if the call is "
            f"only slow, raise {setting}.{self._hang_stacks(method, missing)}"
        )
        return WorkerTimeoutError(method, missing, detail, self.name)

    def _hang_stacks(self, method: str, missing: list[int]) -> str:
        """Every rank's Python stacks written to a file; the part of the timeout's message that names it."""
        if self._process_info is None:
            return " `py-spy dump --pid <pid>` on that node shows where a rank waits."
        try:
            _, summary = write_hang_report(self.stack_dump_dir, self.name, method, self._process_info, missing)
        except OSError as err:  # the timeout is the report; a stack file that cannot be written must not hide it
            logger.warning("could not write the hung ranks' stacks to %s: %s", self.stack_dump_dir, err)
            return f" Their stacks could not be written to {self.stack_dump_dir}: {err}"
        return "\n" + summary

    def _describe_rank(self, rank: int) -> str:
        if self._process_info is None:
            return str(rank)
        process = self._process_info[rank]
        return f"{rank} (pid {process.pid} on {process.node_ip}, Ray node {process.node_id[:12]})"

    def _public_name(self, method_name: str) -> str:
        prefix = self._method_prefix
        return method_name[len(prefix):] if prefix and method_name.startswith(prefix) else method_name

    def _direct_caller(
        self, rank: int, method_name: str, concurrency_group: str | None = None
    ) -> Callable[..., Awaitable[Any]]:
        handle = self._workers[rank]
        method = self._public_name(method_name)
        actor_method = getattr(handle, method_name)
        if concurrency_group is not None:
            actor_method = actor_method.options(concurrency_group=concurrency_group)

        async def call(*args: Any, **kwargs: Any) -> Any:
            ref = actor_method.remote(*args, **kwargs)
            try:
                return await asyncio.wait_for(_awaited(ref), self.rpc_timeout_s)
            except asyncio.TimeoutError as err:
                raise self._timeout_error(method, [rank], [rank], self.rpc_timeout_s, _CALL_SETTING) from err
            except ray.exceptions.RayTaskError as err:
                raise WorkerError(method, rank, f"it raised:\n{err}", self.name) from err
            except ray.exceptions.RayActorError as err:
                raise WorkerError(method, rank, self._death_detail(err), self.name) from err

        return call

    def _make_future(self, handles: list[Any], collect: Callable[[list[Any]], Any], returns_proto: bool) -> Any:
        if returns_proto:
            return DataProtoFuture(collect_fn=collect, futures=handles)
        return handles

    def shutdown(self) -> None:
        """Kill every actor of this group."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)


async def _awaited(ref: Any) -> Any:
    """An ObjectRef as a coroutine (for `asyncio.wait_for`)."""
    return await ref
