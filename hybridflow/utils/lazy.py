"""Package `__init__`s whose public names load on first use, so that light submodules import alone.

A package's config section (`algorithms/config.py`, `data/config.py`, ...) is a submodule, and importing a
submodule runs its package's `__init__` first. When that `__init__` imports the package's torch and transformers
code eagerly, reading the config schema costs seconds (7.2 s of a 4.6-11.4 s config error, issue 30). With
`lazy_exports` the `__init__` names its public objects and the submodules that hold them; the first access of
any of them imports all those submodules (so their registrations run together, as the eager `__init__` did).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public name N lives in submodule `exports[N]`."""

    def load_all() -> dict[str, Any]:
        namespace = vars(importlib.import_module(package))
        for submodule in dict.fromkeys(exports.values()):
            module = importlib.import_module(f"{package}.{submodule}")
            for name, source in exports.items():
                if source == submodule:
                    namespace[name] = getattr(module, name)
        return namespace

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return load_all()[name]

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *exports})

    return __getattr__, __dir__
