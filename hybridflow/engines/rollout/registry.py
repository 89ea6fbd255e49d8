"""The rollout-backend registry (`actor_rollout_ref.rollout.name`) and what each backend can do (its `RolloutSpec`).

Config and validation code asks the spec, never the name: "may bypass mode take this backend's log-probs" is
`rollout_spec(name).log_probs_match_trainer`, not `name == "native"`. The module imports no torch: backends
register by import path and load on the first `ROLLOUTS.get`, and a spec's model and installation checks are named
by import path too, so the checks before Ray read them cheaply. A user's backend registers with
`register_rollout(name, "module:Class", RolloutSpec(...))` (or `ROLLOUTS.register(name)(cls)`, declaring nothing).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.utils.registry import Registry

__all__ = ["ROLLOUTS", "RolloutSpec", "backends_with", "register_rollout", "rollout_spec"]


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """What a rollout backend can do; the config checks and the worker read these, not names."""

    returns_log_probs: bool = False
    """Returns `rollout_log_probs`, the sampled tokens' log-probs (rollout correction compares them)."""
    log_probs_match_trainer: bool = False
    """Its log-probs match the training engine's (to about 1e-4): bypass mode may take them as the old log-probs."""
    tensor_parallel: bool = False
    """Splits one replica over ranks (`tensor_model_parallel_size` > 1)."""
    tensor_parallel_note: str = ""
    """Why not, where it is worth saying (appended to the refusal)."""
    tensor_parallel_on_cpu: bool = True
    """Splits a replica over CPU ranks too (vllm: only over accelerators; its CPU engine runs in a child process
    outside the trainer's process group)."""
    ends_batches_early: bool = False
    """Its batch generation (mode=sync) can end once enough rows have ended (`rollout.over_sample_rate`; the
    constructor's `over_sample_rate`)."""
    streams_requests: bool = False
    """Serves agent-loop requests by continuous batching (its class's `supports_streaming`): new requests join a
    running decode, and an abort ends the sequences being decoded at the next step."""
    runs_vision: bool = False
    """Takes image inputs (vision-language models)."""
    records_routing: bool = False
    """Records each token's experts for router replay (sync generation)."""
    reads_engine_keys: bool = False
    """Reads its engine's own keys from the rollout section (`enforce_eager`, `max_num_batched_tokens`, ...), which
    other backends would ignore and therefore refuse."""
    engine_keys: tuple[str, ...] = ()
    """Of those engine keys, the ones this backend reads too (through its class's `kwargs_from_config`); the others
    stay refused for it."""
    model_check: str | None = None
    """'module:function' taking a model's config.json (a mapping) and returning why the backend cannot run it, or
    None; torch-free, run before Ray."""
    install_check: str | None = None
    """'module:function' raising ImportError or ValueError when the backend's packages are missing or in versions
    that do not work together; run before Ray."""

    def unsupported_model_reason(self, config: Mapping[str, Any]) -> str | None:
        """Why this backend cannot run a model with this config.json, or None (also when it declares no check)."""
        return None if self.model_check is None else _resolve(self.model_check)(config)

    def check_installed(self) -> None:
        """Raise ImportError or ValueError if the backend's packages cannot be used here."""
        if self.install_check is not None:
            _resolve(self.install_check)()


ROLLOUTS: Registry[Any] = Registry("rollout")
_SPECS: dict[str, RolloutSpec] = {}


def register_rollout(name: str, target: str, spec: RolloutSpec | None = None) -> None:
    """Register backend `name` as 'module:Class' (imported on first `ROLLOUTS.get`) with its spec."""
    ROLLOUTS.register_lazy(name, target)
    _SPECS[name] = spec or RolloutSpec()


def rollout_spec(name: str) -> RolloutSpec:
    """What backend `name` can do; an unknown name raises `KeyError` listing the known ones. A backend registered
    on the bare registry (`ROLLOUTS.register`) declared nothing."""
    if name not in ROLLOUTS:
        raise KeyError(f"unknown {ROLLOUTS.kind} {name!r}; known: {ROLLOUTS.names()}")
    return _SPECS.get(name, RolloutSpec())


def backends_with(capability: str) -> list[str]:
    """The registered backends whose spec has `capability` (a `RolloutSpec` flag), sorted: what an error lists."""
    return [name for name in ROLLOUTS.names() if getattr(rollout_spec(name), capability)]


def _resolve(target: str) -> Callable[..., Any]:
    module, attribute = target.split(":", 1)
    return getattr(importlib.import_module(module), attribute)


register_rollout("hf", "hybridflow.engines.rollout.hf:HFRollout", RolloutSpec(
    returns_log_probs=True, runs_vision=True, records_routing=True, tensor_parallel=True, ends_batches_early=True,
))
register_rollout("native", "hybridflow.engines.rollout.native:NativeRollout", RolloutSpec(
    returns_log_probs=True, log_probs_match_trainer=True, tensor_parallel=True, streams_requests=True,
    ends_batches_early=True,
    engine_keys=("enforce_eager", "max_num_seqs", "max_num_batched_tokens"),
    model_check="hybridflow.engines.rollout.native_support:native_unsupported_reason",
))
register_rollout("vllm", "hybridflow.engines.rollout.vllm:VLLMRollout", RolloutSpec(
    returns_log_probs=True, reads_engine_keys=True, tensor_parallel=True, tensor_parallel_on_cpu=False,
    install_check="hybridflow.engines.rollout.vllm_versions:check_installed_vllm_versions",
))
