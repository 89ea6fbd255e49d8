"""Backend-independent controller pieces: `Worker`, `WorkerGroup`, `register`, `Dispatch`, `Execute`."""

from hybridflow.single_controller.base.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from hybridflow.single_controller.base.worker import Worker
from hybridflow.single_controller.base.worker_group import CONTROL_GROUP, WorkerError, WorkerGroup, WorkerTimeoutError

__all__ = [
    "CONTROL_GROUP",
    "Dispatch",
    "Execute",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeoutError",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
]
