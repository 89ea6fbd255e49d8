"""The reward sections of the RL trainer: `reward_model.*` (reward manager, scoring limits, DAPO's overlong
penalty) and `custom_reward_function.*` (a user scorer loaded from a file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hybridflow.rewards.pool import ScoringConfig
from hybridflow.sandbox.remote import SandboxFusionEndpoint, check_endpoint_url
from hybridflow.utils.config import ConfigFieldError, changed_leaves, unsupported

__all__ = ["CustomRewardFunctionConfig", "OverlongBufferConfig", "RewardModelConfig"]


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """verl's `reward_model.overlong_buffer`."""

    enable: bool = False
    """Add the soft overlong penalty."""

    len: int = 0
    """Buffer length in tokens before `max_resp_len` over which the penalty ramps up."""

    penalty_factor: float = 1.0
    """The penalty at `max_resp_len` (the ramp's depth)."""

    log: bool = False
    """Also return per-sample `overlong_reward` and `overlong` in `RewardResult.extra_info`."""

    max_resp_len: Optional[int] = None
    """The length at which the penalty reaches penalty_factor (verl's reward_model.reward_kwargs.max_resp_len);
    None: data.max_response_length."""

    def resolved_max_resp_len(self, max_response_length: int) -> int:
        """max_resp_len, or the rollout's data.max_response_length when unset."""
        return self.max_resp_len if self.max_resp_len is not None else max_response_length

    def check_len(self, max_response_length: int) -> None:
        """The buffer lies inside the response: 0 < len < max_resp_len (data.max_response_length when unset)."""
        limit = self.resolved_max_resp_len(max_response_length)
        if not 0 < self.len < limit:
            raise ValueError(
                f"reward_model.overlong_buffer.len={self.len} must be in 1..max_resp_len-1 = 1..{limit - 1} "
                "(below reward_model.overlong_buffer.max_resp_len, or data.max_response_length when it is unset)"
            )


@dataclass(frozen=True, kw_only=True)
class SandboxFusionConfig:
    """verl's SandboxFusion server for code rewards (`reward_model.sandbox_fusion.*`). With a url, the code
    scorers run their test cases there (stdin/stdout and call-based cases, the rows verl sends to it) instead of
    in hybridflow's local sandbox (reward_model.scoring.sandbox). Test-code rows (HumanEval's `check`) stay in
    the local harness: on the server the tests would share the program's process, where it can forge them."""

    url: Optional[str] = None
    """The server's run_code endpoint (http:// or https://); None runs every case in the local sandbox."""
    max_concurrent: int = 64
    """Requests in flight to the server at once, at most. Each scorer process sends one at a time, so
    reward_model.scoring.num_workers must not exceed it (checked)."""
    memory_limit_mb: int = 1024
    """Memory limit of each program on the server (sent as memory_limit_MB)."""

    def __post_init__(self) -> None:
        if self.url is not None:
            check_endpoint_url(self.url, "url")
        if self.max_concurrent < 1:
            raise ConfigFieldError("max_concurrent", f"max_concurrent={self.max_concurrent} must be >= 1")
        if self.memory_limit_mb < 1:
            raise ConfigFieldError("memory_limit_mb", f"memory_limit_mb={self.memory_limit_mb} must be >= 1")

    def check_scorer_processes(self, num_workers: int, workers_key: str) -> None:
        """With a url, the scorer processes (`workers_key`) do not outnumber max_concurrent: each keeps one request
        in flight to the server."""
        if self.url is not None and num_workers > self.max_concurrent:
            raise ConfigFieldError(
                "sandbox_fusion.max_concurrent",
                f"reward_model.sandbox_fusion.max_concurrent={self.max_concurrent} is below {workers_key}="
                f"{num_workers}: each scorer process keeps one request in flight to the server; raise "
                f"max_concurrent or lower {workers_key} to it")

    def endpoint(self) -> Optional[SandboxFusionEndpoint]:
        """The server to send code scorers' cases to, or None (no url)."""
        return None if self.url is None else SandboxFusionEndpoint(url=self.url, memory_limit_mb=self.memory_limit_mb)


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """How responses are scored by rules: a reward manager over per-`data_source` scorers (the learned reward
    model's settings are the worker's, `workers.reward_config.RewardModelWorkerConfig`)."""

    reward_manager: str = "naive"
    """naive | batch | dapo | prime (verl's name for per-sample scoring in a process pool with a timeout: naive's
    behaviour), or a registered custom manager."""
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    """verl's remote code sandbox: with a url, code scorers' test cases run there."""
    launch_reward_fn_async: bool = unsupported(False, "scoring runs in the driver's scorer pool between stages")
    """Score in the background while the next stage runs."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Where scorers run and how long one may take (a raising or hung scorer scores 0 and is counted)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong penalty (reward_manager=dapo)."""
    rule_reward_coef: float = 0.0
    """With a reward model (reward_model.enable): weight of the rule-based score (custom_reward_function or the
    data_source's scorer) added to the model's score; 0 uses the model's score alone, as verl does."""

    def __post_init__(self) -> None:
        self.sandbox_fusion.check_scorer_processes(self.scoring.num_workers, "reward_model.scoring.num_workers")


@dataclass(frozen=True, kw_only=True)
class CustomRewardFunctionConfig:
    """A user scoring function loaded from a file."""

    path: Optional[str] = None
    """Python file defining the function (`~` is expanded); None uses the built-in scorers by data_source."""
    name: Optional[str] = "compute_score"
    """Function name in that file (None only without a path, as verl's test scripts set it)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function on every call (verl's custom_reward_function.reward_kwargs, set as
    +custom_reward_function.reward_kwargs.NAME=VALUE). The function must accept them; checked before Ray starts."""

    def __post_init__(self) -> None:
        if self.path is not None and not self.name:
            raise ConfigFieldError(
                "name", f"name={self.name!r} with path={self.path!r}: name the scoring function in that file"
            )
        if self.path is None and self.name not in (None, "compute_score"):
            raise ConfigFieldError(
                "name", f"name={self.name!r} names a function in custom_reward_function.path's file, and no path is "
                "set: set custom_reward_function.path, or drop the name"
            )
        if self.reward_kwargs and self.path is None:
            raise ConfigFieldError(
                "reward_kwargs",
                f"reward_kwargs={dict(self.reward_kwargs)} are passed to custom_reward_function.path's function, and "
                "no path is set: set custom_reward_function.path, or drop the reward_kwargs",
            )


def built_in_scorer_settings(section: Any) -> dict[str, Any]:
    """The settings of the built-in scorers that a reward section (`reward_model.*` of train or score) sets off
    their defaults, by full key: the local sandbox's limits and the remote sandbox's url."""
    changed: dict[str, Any] = {}
    if section.sandbox_fusion.url is not None:
        changed["reward_model.sandbox_fusion.url"] = section.sandbox_fusion.url
    for key, value, _ in changed_leaves("reward_model.scoring.sandbox", section.scoring.sandbox, ScoringConfig().sandbox):
        changed[key] = value
    return changed


def built_in_scorer_settings_error(custom: CustomRewardFunctionConfig, changed: dict[str, Any]) -> str | None:
    """Why settings of the built-in scorers (`changed`: key -> value, those set off their defaults, e.g. the local
    sandbox's limits, sandbox_fusion.url, format_score) cannot apply: custom_reward_function.path replaces those
    scorers, and, as in verl, its function is not given them. None where nothing is set or no path replaces them."""
    if custom.path is None or not changed:
        return None
    settings = ", ".join(f"{key}={value!r}" for key, value in changed.items())
    return (
        f"{settings} configure the built-in scorers, but custom_reward_function.path={custom.path!r} replaces them "
        "and its function is not given them: drop them, or pass what the function needs as "
        "+custom_reward_function.reward_kwargs.NAME=VALUE"
    )
