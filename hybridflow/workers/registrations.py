"""What a driver registered in its own process reaches the Ray workers.

A researcher registers a policy loss (or a training engine, a rollout) in the driver script, as the docs show
(`@register_policy_loss("my_loss")`), and names it in the config. The driver's check sees the name; the loss runs
in the Ray workers, whose processes import hybridflow afresh and would not hold it. So the trainer ships every
entry of these registries that hybridflow itself did not register (`driver_registrations`, pickled by value, so
the defining module need not be importable on the workers) inside the workers' runtime config, and each worker
installs them before it builds anything (`install_registrations`).
"""

from __future__ import annotations

import importlib
from typing import Any

import cloudpickle

__all__ = ["WORKER_REGISTRIES", "driver_registrations", "install_registrations"]

WORKER_REGISTRIES: dict[str, str] = {
    "policy loss": "hybridflow.algorithms.policy_loss_registry:POLICY_LOSSES",
    "training engine": "hybridflow.engines.training:TRAINING_ENGINES",
    "rollout": "hybridflow.engines.rollout.registry:ROLLOUTS",
}
"""Registries read inside worker processes: kind -> 'module:attribute'."""


def _registry(kind: str) -> Any:
    module, attribute = WORKER_REGISTRIES[kind].split(":")
    return getattr(importlib.import_module(module), attribute)


def _registered_outside_hybridflow(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module != "hybridflow" and not module.startswith("hybridflow.")


def _pickle_by_value(obj: Any) -> bytes:
    """`obj` with its code: a function or class of a user module is rebuilt on the worker without importing it."""
    import sys

    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    by_value = module is not None and module.__name__ != "__main__"
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def driver_registrations() -> dict[str, dict[str, bytes]]:
    """kind -> name -> pickled object, for each entry of `WORKER_REGISTRIES` registered outside hybridflow."""
    shipped: dict[str, dict[str, bytes]] = {}
    for kind in WORKER_REGISTRIES:
        registry = _registry(kind)
        entries = {name: obj for name, obj in registry.loaded().items() if _registered_outside_hybridflow(obj)}
        if entries:
            shipped[kind] = {name: _pickle_by_value(obj) for name, obj in entries.items()}
    return shipped


def install_registrations(shipped: dict[str, dict[str, bytes]]) -> None:
    """Register the driver's entries in this process (a name this process already holds is left as it is: the
    driver's and the worker's are then the same registration, e.g. in local mode)."""
    for kind, entries in shipped.items():
        registry = _registry(kind)
        for name, payload in entries.items():
            if name in registry:
                continue
            try:
                obj = cloudpickle.loads(payload)
            except Exception as err:
                raise RuntimeError(
                    f"the {kind} {name!r} registered in the driver could not be rebuilt in this worker "
                    f"({type(err).__name__}: {err}); define it in a module the workers can import"
                ) from err
            registry.register(name, obj)
