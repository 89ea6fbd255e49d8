"""The one `Registry` type through which losses, estimators, engines, rewards and tools are extended."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object table. Registering a name twice is an error; an unknown name lists the known ones.

    Optional backends register lazily with `register_lazy(name, "module:attr")`: the import runs when the
    name is first requested, and an import failure is raised again (with its cause) at that moment.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register `obj` under `name`; without `obj`, return a decorator."""
        if obj is not None:
            self._add(name, obj)
            return obj

        def decorator(target: T) -> T:
            self._add(name, target)
            return target

        return decorator

    def register_lazy(self, name: str, target: str) -> None:
        """Register `name` as `"package.module:attribute"`, imported on first `get`."""
        self._check_free(name)
        if ":" not in target:
            raise ValueError(f"lazy {self.kind} target must look like 'module:attribute', got {target!r}")
        self._lazy[name] = target

    def get(self, name: str) -> T:
        """Return the object registered as `name`; raise `KeyError` listing known names if absent."""
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            module_name, attr = self._lazy[name].split(":", 1)
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:
                raise ImportError(
                    f"{self.kind} {name!r} needs module {module_name!r}, which failed to import: {err}"
                ) from err
            obj = getattr(module, attr)
            del self._lazy[name]
            self._entries[name] = obj
            return obj
        raise KeyError(f"unknown {self.kind} {name!r}; known: {sorted(self.names())}")

    def loaded(self) -> dict[str, T]:
        """The entries that hold their object now: registered with one, or lazy ones already requested (what a
        user registered in code, without importing a lazy backend)."""
        return dict(self._entries)

    def names(self) -> list[str]:
        """All registered names (eager and lazy), sorted."""
        return sorted([*self._entries, *self._lazy])

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _check_free(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty str, got {name!r}")
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")

    def _add(self, name: str, obj: T) -> None:
        self._check_free(name)
        self._entries[name] = obj
