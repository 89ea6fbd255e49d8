"""Custom reward functions loaded from a Python file (verl's `custom_reward_function.path` / `.name`).

The function is called as `fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)`
and returns a float or a dict with 'score'; an `async def` function is run to completion (verl's reward loop takes
both). `load_custom_reward_fn` checks the file and the function in the driver; the returned `FileRewardFunction` is
picklable (path + name), and each scorer process loads the file once on first use.

With a generative reward model (`GenerativeRewardFunction`) each call also gets verl's `reward_router_address`
(the served model's `host:port`, `rewards.genrm_router`) and `reward_model_tokenizer` (its tokenizer, loaded once
per scorer process).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.utils.file_module import import_file

__all__ = ["FileRewardFunction", "GenerativeRewardFunction", "load_custom_reward_fn", "takes_keywords"]

_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}  # per process: (path, name) -> function
_TOKENIZERS: dict[str, Any] = {}  # per process: path -> the reward model's tokenizer
GENRM_KEYWORDS = ("reward_router_address", "reward_model_tokenizer")


def _load_function(path: str, name: str) -> Callable[..., Any]:
    key = (path, name)
    if key not in _LOADED:
        module = import_file(path, "hybridflow_custom_reward_", "custom_reward_function.path")
        function = getattr(module, name, None)
        if function is None:
            raise AttributeError(f"custom_reward_function.name={name!r} is not defined in {path}")
        if not callable(function):
            raise TypeError(f"custom_reward_function.name={name!r} in {path} is not callable")
        _LOADED[key] = function
    return _LOADED[key]


@dataclass(frozen=True)
class FileRewardFunction:
    """A reward function named by file path and function name, with fixed extra keyword arguments."""

    path: str
    name: str
    reward_kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, **kwargs: Any) -> Any:
        result = _load_function(self.path, self.name)(**kwargs, **self.reward_kwargs)
        return asyncio.run(result) if inspect.isawaitable(result) else result

    def function(self) -> Callable[..., Any]:
        """The loaded function itself."""
        return _load_function(self.path, self.name)

    def prepare(self) -> None:
        """Import the file in this process (the scorer pool does it before a call's timeout starts)."""
        self.function()


@dataclass(frozen=True)
class GenerativeRewardFunction(FileRewardFunction):
    """A custom reward function that judges with the served generative reward model: every call gets the router's
    address and the reward model's tokenizer (from `tokenizer_path`) as verl's reward loop passes them."""

    router_address: str = ""
    tokenizer_path: str = ""

    def __call__(self, **kwargs: Any) -> Any:
        if self.tokenizer_path not in _TOKENIZERS:
            from hybridflow.models import load_tokenizer

            _TOKENIZERS[self.tokenizer_path] = load_tokenizer(self.tokenizer_path)
        return super().__call__(
            **kwargs, reward_router_address=self.router_address,
            reward_model_tokenizer=_TOKENIZERS[self.tokenizer_path],
        )


def takes_keywords(function: Callable[..., Any], names: tuple[str, ...]) -> bool:
    """Whether `function` accepts every one of `names` as a keyword (or has **kwargs)."""
    return _keyword_error(function, names) is None


def call_error(function: Callable[..., Any], names: Iterable[str]) -> TypeError | None:
    """Why `function` cannot be called with exactly the keywords `names` (one it lacks, or a parameter without a
    default they leave out), or None (also for a builtin, whose signature is unknown)."""
    return _keyword_error(function, names, complete=True)


def _keyword_error(function: Callable[..., Any], names: Iterable[str], complete: bool = False) -> TypeError | None:
    """Why `function` cannot take `names` as keywords (with `complete`, as its whole call), or None (also for a
    builtin, whose signature is unknown)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return None
    try:
        (signature.bind if complete else signature.bind_partial)(**dict.fromkeys(names))
    except TypeError as err:
        return err
    return None


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score",
                          reward_kwargs: dict[str, Any] | None = None) -> FileRewardFunction:
    """Load `name` from the Python file `path` now (errors surface at startup) and return a picklable caller.

    Raises:
        FileNotFoundError: `path` does not exist (names the path).
        AttributeError: the file defines no `name` (names the function and the path).
    """
    resolved = str(Path(path).expanduser().resolve())
    if not os.path.isfile(resolved):
        raise FileNotFoundError(f"custom_reward_function.path not found: {path}")
    function = _load_function(resolved, name)
    reward_kwargs = dict(reward_kwargs or {})
    _check_accepts(function, reward_kwargs, name, resolved)
    return FileRewardFunction(resolved, name, reward_kwargs)


def _check_accepts(function: Callable[..., Any], reward_kwargs: dict[str, Any], name: str, path: str) -> None:
    """Raise unless `function` takes every name of `reward_kwargs` as a keyword (the scorer's own arguments differ by
    reward manager: naive and batch name them differently)."""
    err = _keyword_error(function, reward_kwargs)
    if err is not None:
        raise TypeError(
            f"custom_reward_function.name={name!r} in {path} does not take custom_reward_function.reward_kwargs "
            f"{sorted(reward_kwargs)}: {err}; add them to its parameters (or **kwargs)"
        )
