"""Toy workers for the controller tests: small enough to read, real enough to use gloo."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Execute, Worker, make_nd_compute_dataproto_dispatch_fn, register

TP_MESH = make_nd_compute_dataproto_dispatch_fn("toy_mesh")


class AllReduceWorker(Worker):
    """Joins a gloo group; methods cover each dispatch mode."""

    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        self.scale = scale
        self.value = torch.zeros(1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> int:
        self.init_distributed()
        # tp=2 pairs when world_size is 4; else every rank is its own dp rank
        tp = 2 if self.world_size % 2 == 0 and self.world_size > 2 else 1
        self.register_dispatch_collect_info("toy_mesh", self.rank // tp, self.world_size // tp, self.rank % tp == 0)
        return dist.get_world_size()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        tensor = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(tensor)
        return tensor.item() * self.scale + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x: int, y: int = 0) -> int:
        return x + y + 100 * self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, x: int) -> int:
        return x * x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict(
            {"y": data.batch["x"] * 2, "rank": torch.full((len(data),), self.rank)},
            meta_info={"metrics": {"rows": len(data)}},
        )
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_one(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["y"] + 1})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto) -> DataProto:
        time.sleep(0.2)
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, func, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": func(data.batch["x"])})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def row_sum(self, data: DataProto) -> dict:
        return {"sum": int(data.batch["x"].sum()), "rank": self.rank}

    @register(dispatch_mode=TP_MESH)
    def mesh_tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"], "rank": torch.full((len(data),), self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_only(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_on(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(1)
        time.sleep(30)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stall_before_all_reduce(self, rank: int) -> float:
        """`rank` hangs (as a deadlocked or stuck rank would); the others wait for it inside a gloo all-reduce."""
        if self.rank == rank:
            time.sleep(3600)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return tensor.item()


class ActorRole(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def act(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"a": data.batch["x"] + 10})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class CriticRole(Worker):
    def __init__(self, offset: int) -> None:
        super().__init__()
        self.offset = offset

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def judge(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"v": data.batch["x"] + self.offset})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class RendezvousProbe(Worker):
    """Records whether rank 0's rendezvous was known when `__init__` ran; joins the group in `init_model`."""

    def __init__(self) -> None:
        super().__init__()
        self.master_at_init = os.environ.get("MASTER_ADDR") or None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rendezvous_seen(self) -> tuple[str | None, str | None, float]:
        self.init_distributed()
        total = torch.ones(1)
        dist.all_reduce(total)
        return self.master_at_init, os.environ.get("MASTER_ADDR") or None, total.item()



class GatedServer(Worker):
    """A server whose requests wait until `release` is called (the generation server's abort, in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.released = threading.Event()

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def wait_for_release(self, timeout_s: float) -> bool:
        return self.released.wait(timeout_s)

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def release(self) -> int:
        self.released.set()
        return os.getpid()
