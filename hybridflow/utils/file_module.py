"""Import a user's code: a Python file by path (verl's `custom_reward_function.path`, `data.custom_cls.path`), once
per process, under a module name derived from the path; or a class by dotted path (`class_name` of the tools and
interaction files)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType


def import_file(path: str, prefix: str, key: str) -> ModuleType:
    """The module of the Python file `path` (absolute), imported on first use under `{prefix}{hash of path}` and
    registered in `sys.modules` (so the file's classes and functions pickle by reference). `key` names the setting
    in errors: FileNotFoundError for a missing file, ValueError for one Python cannot load."""
    module_name = prefix + hashlib.sha1(path.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key} not found: {path}")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{key} is not a loadable Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]  # a failed import is retried, not half-registered
        raise
    return module


def import_dotted(path: str, where: str, example: str, verl_hint: str = "") -> object:
    """The object at dotted `path` ('package.module.Name'); a ValueError names `where`.class_name and the cause,
    adding `verl_hint` when the module is verl's (verl is not installed beside hybridflow)."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}.class_name={path!r} must be a dotted path like {example!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        hint = f"; {verl_hint}" if verl_hint and module_name.split(".")[0] == "verl" else ""
        raise ValueError(f"{where}.class_name={path!r}: cannot import module {module_name!r}: {err}{hint}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise ValueError(f"{where}.class_name={path!r}: module {module_name!r} has no attribute {attr!r}") from err
