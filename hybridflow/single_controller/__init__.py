"""The single controller: a driver calls methods on groups of SPMD workers (Ray actors or local objects)."""

from hybridflow.single_controller.base import (
    CONTROL_GROUP,
    Dispatch,
    Execute,
    Worker,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)

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
