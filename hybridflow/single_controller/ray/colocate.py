"""Colocation: one actor process hosting several roles (actor, rollout, ref, critic...), split back per role."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.single_controller.base.decorator import REGISTER_ATTR
from hybridflow.single_controller.base.worker import Worker
from hybridflow.single_controller.base.worker_group import registered_methods
from hybridflow.single_controller.ray.base import RayClassWithInitArgs

ROLE_SEPARATOR = "__"


def _role_method(role: str, name: str, spec: Any) -> Callable:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role_workers[role], name)(*args, **kwargs)

    method.__name__ = f"{role}{ROLE_SEPARATOR}{name}"
    # The role's own method materializes futures itself; the fused one only forwards.
    setattr(method, REGISTER_ATTR, spec)
    return method


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """A class whose one actor per rank constructs every role's worker; methods are named `{role}__{method}`.

    Use `RayWorkerGroup(pool, create_colocated_worker_cls({...})).spawn(roles)` to get one group per role.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for role in class_dict:
        if ROLE_SEPARATOR in role or not role.isidentifier():
            raise ValueError(f"role name {role!r} must be an identifier without {ROLE_SEPARATOR!r}")
    roles = {role: (item.cls, item.args, item.kwargs) for role, item in class_dict.items()}

    class ColocatedWorker(Worker):
        """Hosts the workers of several roles in one process (same rank, same environment)."""

        def __init__(self) -> None:
            super().__init__()
            self.role_workers = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in roles.items()}

    for role, (cls, _, _) in roles.items():
        for name, spec in registered_methods(cls).items():
            setattr(ColocatedWorker, f"{role}{ROLE_SEPARATOR}{name}", _role_method(role, name, spec))
    ColocatedWorker.__name__ = ColocatedWorker.__qualname__ = "Colocated_" + "_".join(roles)
    fused = RayClassWithInitArgs(ColocatedWorker)
    for item in class_dict.values():
        fused.update_options(item.options)
    return fused
