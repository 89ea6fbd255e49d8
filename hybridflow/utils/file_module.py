"""Import a user's Python file by path (verl's `custom_reward_function.path`, `data.custom_cls.path`), once per
process, under a module name derived from the path."""

from __future__ import annotations

import hashlib
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
