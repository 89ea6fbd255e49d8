"""`Worker`: the base class of every SPMD worker (one per rank) that a worker group drives."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from hybridflow import env
from hybridflow.single_controller.base.decorator import Dispatch, Execute, register
from hybridflow.single_controller.base.stacks import install_stack_dump
from hybridflow.utils import shared_path
from hybridflow.utils.process_memory import MemoryReport, read_memory_report
from hybridflow.utils.device import get_dist_backend, get_torch_device

if TYPE_CHECKING:
    from hybridflow.utils.step_profiler import ProfileRequest


def find_free_port() -> int:
    """A TCP port that was free a moment ago on this host. Another process may take it before it is bound again:
    where this process will listen itself, prefer `listen_for_rendezvous` (the port stays bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


_RENDEZVOUS_STORES: dict[str, dist.TCPStore] = {}
"""The rendezvous stores this process listens on, by port: rank 0 binds its store when it picks the port and joins
the group through it, so no other process can take the port in between (colocated role workers share one)."""


def listen_for_rendezvous(world_size: int) -> str:
    """Start rank 0's torch.distributed store on a port the OS picks, keep it open, and return the port."""
    store = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)
    _RENDEZVOUS_STORES[str(store.port)] = store
    return str(store.port)


def get_node_ip() -> str:
    """This host's IP as other nodes see it (Ray's view when Ray runs, else a best guess)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def get_node_id() -> str:
    """The Ray node (raylet) hosting this process, as a hex id; "" outside Ray. Two raylets on one host differ."""
    try:
        import ray
    except ImportError:
        return ""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


class ProcessInfo(NamedTuple):
    """Where a worker process runs."""

    node_ip: str
    pid: int
    node_id: str
    """Ray node id (hex); "" outside Ray."""


class Worker:
    """Knows its rank, world size and rendezvous; subclasses add `@register`ed methods.

    The worker group exports `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `LOCAL_WORLD_SIZE` before constructing the
    worker. It starts all ranks at once (each process imports torch and the model code: seconds per rank), and
    rank 0 chooses the rendezvous after its construction, so every rank learns `MASTER_ADDR`/`MASTER_PORT` just after its
    `__init__`, before any other call. Join the process group with `self.init_distributed()` (or
    `init_process_group()` with `env://` on ranks other than 0: rank 0 already listens on the port through
    `listen_for_rendezvous`) in `init_model` or later, never in `__init__`.
    """

    def __init__(self) -> None:
        self._rank = env.dist_rank()
        self._world_size = env.dist_world_size()
        self._local_rank = env.dist_local_rank()
        self._master_addr = env.dist_master_addr()
        self._master_port = env.dist_master_port()
        self._local_mode = env.local_mode()
        self._dispatch_info: dict[str, tuple[int, int, bool]] = {}
        if not self._local_mode:  # a hung call's timeout asks every worker process for its stacks
            install_stack_dump()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def init_distributed(self, backend: str | None = None, timeout_s: float | None = None) -> None:
        """Join the group's torch.distributed process group (gloo on CPU, nccl on CUDA) once per process; its
        collectives fail after `timeout_s` seconds of waiting (None: torch's default)."""
        if self._local_mode and self._world_size > 1:
            raise RuntimeError(
                f"local mode runs all {self._world_size} ranks in one process, so collectives cannot work; "
                "use world_size=1 in local mode (trainer.n_gpus_per_node=1) or run on Ray"
            )
        if dist.is_initialized():
            return
        # Colocated role workers are built before rank 0 chooses the rendezvous: read it now.
        self._master_addr = self._master_addr or env.dist_master_addr()
        self._master_port = self._master_port or env.dist_master_port()
        if self._master_addr is None or self._master_port is None:
            raise RuntimeError("MASTER_ADDR/MASTER_PORT are not set: create this worker through a worker group")
        # On GPUs, bind this process to its device before anything touches CUDA: otherwise the first CUDA call
        # (e.g. inside init_device_mesh with parameter offload) picks LOCAL_RANK, an invalid ordinal where Ray shows
        # each worker one GPU.
        device = get_torch_device(env.dist_local_rank())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Rank 0 joins through the store it listens on; the others connect to it.
        store = _RENDEZVOUS_STORES.pop(self._master_port, None) if self._rank == 0 else None
        if store is None:
            store = dist.TCPStore(
                self._master_addr, int(self._master_port), self._world_size, is_master=self._rank == 0,
                timeout=default_pg_timeout,  # what tcp:// rendezvous waits: peers may start minutes apart
            )
        dist.init_process_group(
            backend=backend or get_dist_backend(),
            store=store,
            rank=self._rank,
            world_size=self._world_size,
            device_id=device if device.type == "cuda" else None,
            **({} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}),
        )

    def register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Say which data-parallel shard this rank takes for `mesh_name` and whether its output is kept."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self._dispatch_info[mesh_name] = (dp_rank, dp_size, is_collect)

    # Methods below are called by the worker group itself.
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def query_dispatch_info(self, mesh_name: str) -> tuple[int, int, bool]:
        """This rank's `(dp_rank, dp_size, is_collect)` for `mesh_name`."""
        if mesh_name not in self._dispatch_info:
            raise KeyError(
                f"rank {self._rank} registered no dispatch info for mesh {mesh_name!r}; call "
                "register_dispatch_collect_info in init_model"
            )
        return self._dispatch_info[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def get_master_addr_port(self) -> tuple[str, str]:
        """Rank 0 picks the rendezvous address and a port for the group (its store listens there from now on), and
        keeps them itself."""
        if self._master_addr is None or self._master_port is None:
            # A one-rank group forms no process group here (a library such as vLLM may form its own on the port).
            port = listen_for_rendezvous(self._world_size) if self._world_size > 1 else str(find_free_port())
            self._master_addr, self._master_port = get_node_ip(), port
            env.set_dist_env(self._rank, self._world_size, self._local_rank, self._master_addr, self._master_port)
        return self._master_addr, self._master_port

    def set_master_addr_port(self, master_addr: str, master_port: str) -> None:
        """Learn rank 0's rendezvous after construction (the group calls it on every other rank at start)."""
        self._master_addr, self._master_port = master_addr, master_port
        env.set_dist_env(self._rank, self._world_size, self._local_rank, master_addr, master_port)

    def arm_memory_watchdog(self, budget_gb: float | None, node_pids: list[int], interval_s: float) -> bool:
        """Watch this node's worker processes (`node_pids`) against the memory budget during calls
        (`utils.memory_watchdog`; 90% of the node's memory when `budget_gb` is None). The trainer calls it on every
        process once the workers are up; True when armed (Linux /proc only)."""
        from hybridflow.utils.memory_watchdog import MemoryWatchdog, node_budget_bytes

        if not Path("/proc/self/statm").is_file():
            return False
        if getattr(self, "_memory_watchdog", None) is not None:
            self._memory_watchdog.stop()
        self._memory_watchdog = MemoryWatchdog(node_budget_bytes(budget_gb), node_pids, interval_s)
        self._memory_watchdog.start()
        return True

    def process_info(self) -> ProcessInfo:
        """Where this worker runs. A Ray group asks once at start, to log the placement and name hung ranks."""
        return ProcessInfo(get_node_ip(), os.getpid(), get_node_id())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def memory_report(self) -> MemoryReport:
        """This process's RSS and peak RSS since its last report (and device peak): the driver's memory watch asks
        after every step."""
        return read_memory_report(get_node_ip())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, request: ProfileRequest) -> bool:
        """Start recording this process for a profiled step, if its rank is one of `request.ranks`
        (`global_profiler`); True when it records."""
        from hybridflow.utils.step_profiler import StepProfiler

        if self._rank not in request.ranks:
            return False
        if getattr(self, "_step_profiler", None) is not None:
            raise RuntimeError(f"rank {self._rank}: start_profile while a profile is recording; stop_profile first")
        self._step_profiler = StepProfiler(request, self._rank, get_torch_device(self._local_rank))
        self._step_profiler.start()
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> list[str]:
        """End this process's recording and write its files; their paths (none when it was not recording)."""
        profiler, self._step_profiler = getattr(self, "_step_profiler", None), None
        return [] if profiler is None else profiler.stop()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_pid(self) -> int:
        """The OS process id hosting this worker (to check colocation)."""
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def view_run_dir(self, root: str, token: str, resume_dir: str | None) -> shared_path.PathView:
        """What this process sees of the driver's run directory and resume checkpoint: before training the driver
        checks that every rank shares them (`trainer.checkpointing.check_shared_dirs`)."""
        info = self.process_info()
        resume = None if resume_dir is None else Path(resume_dir)
        return shared_path.view_run_dir(
            Path(root), token, resume, rank=self._rank, node_ip=info.node_ip, node_id=info.node_id
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def remove_run_dir_probes(self, root: str, token: str) -> None:
        """Delete the probe files of check `token` that this process sees (on a node-local directory only a
        worker of that node can)."""
        shared_path.remove_probes(Path(root), token)
