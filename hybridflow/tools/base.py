"""`BaseTool` (verl's tool interface: create / execute / calc_reward / release), the `TOOLS` registry and
the helpers every tool shares: per-trajectory instance state, argument validation, typed tool configs.

A tool implements `invoke(instance, parameters)`; `execute` validates the model's arguments against the
tool's schema first, times the call and turns model mistakes (bad arguments, or a `ToolError` raised by
`invoke`) into an error `ToolResponse` with `metrics["error"] = True`, so the agent loop never sees an
exception for something the model did. Every `execute` returns metrics with `latency_s`, `error` and
`timeout`.

Every call is bounded: after the tool's `timeout_s` (a key of every tool's YAML `config:`, default the
class's `default_timeout_s`, `DEFAULT_TIMEOUT_S` unless a tool says otherwise) `execute` stops waiting, cancels `invoke` and returns an error response with
`metrics["timeout"] = True`; the agent loop counts it (`tool/timeouts`) and goes on. The timeout can only
interrupt an `await`: `invoke` must never block the event loop (CPU work goes through `asyncio.to_thread`, as
the calculator does; a thread that outlives its timeout is abandoned, not killed, so the tool must also bound
its own work), and the code interpreter's sandbox is killed when its call is cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import numbers
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse, validate_arguments
from hybridflow.utils.registry import Registry

__all__ = ["DEFAULT_TIMEOUT_S", "TOOLS", "BaseTool", "ToolError", "ToolInstance", "build_tool_config",
           "read_timeout_s"]

TOOLS: Registry[type[BaseTool]] = Registry("tool")
"""Tool name -> `BaseTool` subclass, for `name:` entries of a tools YAML file."""

# Built-ins register lazily: the code interpreter needs the sandbox and search needs bm25s, and
# neither import should run unless that tool is used.
TOOLS.register_lazy("calculator", "hybridflow.tools.calculator:CalculatorTool")
TOOLS.register_lazy("code_interpreter", "hybridflow.tools.code_interpreter:CodeInterpreterTool")
TOOLS.register_lazy("search", "hybridflow.tools.search:SearchTool")
TOOLS.register_lazy("gsm8k_answer", "hybridflow.tools.gsm8k_answer:Gsm8kAnswerTool")
TOOLS.register_lazy("sandbox_fusion", "hybridflow.tools.sandbox_fusion:SandboxFusionTool")

ConfigT = TypeVar("ConfigT")

DEFAULT_TIMEOUT_S = 30.0
"""Seconds one tool call may take unless the tool's `config.timeout_s` says otherwise (verl's SandboxFusion
tool also defaults to 30 s)."""

_BASE_KEYS = ("type", "timeout_s")  # config keys every tool takes; `BaseTool` reads them, not the tool's dataclass
_ABANDONED: set[asyncio.Future] = set()  # timed-out calls finishing their clean-up; kept so they are not collected

logger = logging.getLogger(__name__)


def _forget(task: asyncio.Future) -> None:
    """Done callback of a timed-out call: drop it, logging an error its clean-up raised (else unretrieved)."""
    _ABANDONED.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("a timed-out tool call failed while stopping: %r", task.exception())


class ToolError(ValueError):
    """A mistake by the model that a tool reports back as text (e.g. an expression that does not parse).

    Raise it from `BaseTool.invoke`; `execute` turns it into an error `ToolResponse` with the message.
    """


@dataclass(kw_only=True)
class ToolInstance:
    """The state of one tool for one trajectory, from `create` to `release`."""

    instance_id: str
    """The id `create` returned."""

    create_kwargs: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments given to `create` (e.g. a `ground_truth` for `calc_reward`)."""

    num_calls: int = 0
    """`execute` calls so far, including failed ones."""

    num_errors: int = 0
    """`execute` calls that returned an error response."""

    state: dict[str, Any] = field(default_factory=dict)
    """Tool-specific state (e.g. the last result)."""


def build_tool_config(config_cls: type[ConfigT], config: Mapping[str, Any] | None, tool_name: str) -> ConfigT:
    """Build a tool's typed config dataclass from the YAML `config:` mapping.

    The mapping may carry verl's `type: native` and `timeout_s` (read by `BaseTool`); any other `type`, or a
    key that is not a field of `config_cls`, is a ValueError naming the key and the tool.
    """
    values = {key: value for key, value in (config or {}).items() if key not in _BASE_KEYS}
    kind = (config or {}).get("type", "native")
    if kind != "native":
        raise ValueError(f"tool {tool_name!r}: config.type={kind!r} is not supported; use 'native'")
    fields = {f.name for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"tool {tool_name!r}: unknown config keys {unknown}; known keys: "
                         f"{sorted(fields | set(_BASE_KEYS))}")
    try:
        return config_cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"tool {tool_name!r}: invalid config {values}: {err}") from err


def read_timeout_s(config: Mapping[str, Any] | None, tool_name: str, default: float = DEFAULT_TIMEOUT_S) -> float:
    """`config.timeout_s` (seconds, > 0), or `default` when the key is absent."""
    value = (config or {}).get("timeout_s", default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"tool {tool_name!r}: config.timeout_s must be a number of seconds > 0, got {value!r}")
    return float(value)


class BaseTool:
    """A tool the model can call, with per-trajectory instances (verl's `BaseTool` interface).

    Subclasses implement `invoke`, and may override `default_tool_schema` (so a YAML entry needs no
    `tool_schema`), `create`/`release` (to set up and tear down instance state) and `calc_reward`.
    """

    default_timeout_s: float = DEFAULT_TIMEOUT_S
    """`timeout_s` when the YAML `config:` gives none."""

    def __init__(self, config: Mapping[str, Any] | None = None,
                 tool_schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None) -> None:
        """Args:
            config: the YAML entry's `config:` mapping (tool-specific; see the subclass's config dataclass).
            tool_schema: the schema shown to the model; None uses `default_tool_schema()`.
        """
        if tool_schema is None:
            tool_schema = self.default_tool_schema()
            if tool_schema is None:
                raise ValueError(f"{type(self).__name__} has no default tool_schema; pass one")
        elif isinstance(tool_schema, Mapping):
            tool_schema = OpenAIFunctionToolSchema.from_dict(tool_schema)
        self.config: Any = dict(config or {})
        self.tool_schema: OpenAIFunctionToolSchema = tool_schema
        self.timeout_s: float = read_timeout_s(config, self.name, self.default_timeout_s)
        """Seconds one `execute` may take (`config.timeout_s`); past it the call returns an error."""
        self._instances: dict[str, ToolInstance] = {}

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema | None:
        """The schema used when none is configured; None means one must be given."""
        return None

    def check_timeout_above(self, run_limit_s: float, key: str) -> None:
        """`timeout_s` exceeds the tool's own run limit (the setting `key`): else the call is cut first and the
        run's own 'timeout' status never shows. ValueError naming both otherwise."""
        if self.timeout_s <= run_limit_s:
            raise ValueError(f"tool {self.name!r}: config.timeout_s={self.timeout_s:g} must exceed "
                             f"{key}={run_limit_s:g}; raise timeout_s")

    @property
    def name(self) -> str:
        """The function name the model calls this tool by (from the schema)."""
        return self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema to show the model (`.to_dict()` goes into the chat template's `tools`)."""
        return self.tool_schema

    def instance(self, instance_id: str) -> ToolInstance:
        """The live instance `instance_id`; a KeyError if it was never created or was released."""
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(f"tool {self.name!r} has no instance {instance_id!r}; call create() first "
                           f"(live instances: {len(self._instances)})") from None

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start per-trajectory state; return its id (a new uuid4 hex if `instance_id` is None).

        `kwargs` are kept in `ToolInstance.create_kwargs` (verl passes e.g. `ground_truth` here).
        """
        instance_id = instance_id if instance_id is not None else uuid.uuid4().hex
        if instance_id in self._instances:
            raise ValueError(f"tool {self.name!r} already has an instance {instance_id!r}; release it "
                             f"first or pass instance_id=None for a fresh id")
        self._instances[instance_id] = ToolInstance(instance_id=instance_id, create_kwargs=dict(kwargs))
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one call: validate `parameters`, call `invoke`, time it.

        Returns:
            (response for the model, step reward, metrics). Metrics always hold `latency_s` (float,
            seconds), `error` (bool: bad arguments, a `ToolError`, a timeout, or a failure the tool reported)
            and `timeout` (bool: the call ran past `timeout_s` and was stopped).
        """
        instance = self.instance(instance_id)
        start = time.perf_counter()
        instance.num_calls += 1
        problems = validate_arguments(self.tool_schema.function.parameters, parameters)
        if problems:
            response, reward, metrics = self._error_response("invalid arguments: " + "; ".join(problems)), 0.0, {}
            metrics["error"] = True
        else:
            try:
                result = await self._invoke_bounded(instance, parameters, **kwargs)
            except ToolError as err:
                result = self._error_response(str(err)), 0.0, {"error": True}
            except Exception as err:  # raised on the model's arguments: the model is told, as verl's loop does
                if not getattr(self, "_logged_failure", False):
                    self._logged_failure = True
                    logger.warning("tool %r raised on a call (it scores as a tool error; the model gets the "
                                   "message); first traceback:", self.name, exc_info=True)
                result = self._error_response(f"the tool failed: {type(err).__name__}: {err}"), 0.0, {"error": True}
            else:  # outside the handlers: a wrong return value is the tool's bug and stops the run
                self._check_result(result)
            response, reward, metrics = result
        metrics = {**metrics, "latency_s": time.perf_counter() - start, "error": bool(metrics.get("error", False)),
                   "timeout": bool(metrics.get("timeout", False))}
        instance.num_errors += int(metrics["error"])
        return response, reward, metrics

    async def _invoke_bounded(self, instance: ToolInstance, parameters: dict[str, Any],
                              **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """`invoke` in a task that is cancelled after `timeout_s` (a task, not `wait_for`, so that a
        TimeoutError raised by the tool itself is not taken for ours, and so that the caller need not wait
        for the cancelled call's clean-up)."""
        task = asyncio.ensure_future(self.invoke(instance, parameters, **kwargs))
        try:
            done, _ = await asyncio.wait([task], timeout=self.timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return task.result()
        task.cancel()
        _ABANDONED.add(task)
        task.add_done_callback(_forget)
        message = f"the call took longer than {self.timeout_s:g} s and was stopped; try a smaller input"
        return self._error_response(message), 0.0, {"error": True, "timeout": True}

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """The tool's work, with `parameters` already valid for the schema.

        Raise `ToolError` for a model mistake; return metrics with `error: True` for a failure that still
        has output to show (e.g. code that raised). `execute` adds `latency_s`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement invoke()")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's trajectory-level reward from this tool; 0.0 unless a subclass scores."""
        self.instance(instance_id)
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the instance's state. Releasing an unknown or already released id does nothing."""
        self._instances.pop(instance_id, None)

    def _error_response(self, message: str) -> ToolResponse:
        return ToolResponse(text=f"Error from tool '{self.name}': {message}")

    def _check_result(self, result: Any) -> None:
        """Raise unless `invoke` returned `(ToolResponse, reward, metrics)`, naming the tool and the contract (a bug in
        the tool's code, not the model's doing: it stops the run)."""
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], ToolResponse)
                and isinstance(result[1], numbers.Real) and isinstance(result[2], dict)):
            raise TypeError(
                f"tool {self.name!r} ({type(self).__name__}.invoke) must return (ToolResponse, reward as a number, "
                f"metrics dict); it returned {result!r:.200}"
            )
