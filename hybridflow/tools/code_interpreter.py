"""The `code_interpreter` tool: runs the model's Python code in `hybridflow.sandbox` and returns its output.

The response is the program's stdout; when the run fails (an exception, a timeout, a memory or output
limit) it also carries a short tail of stderr and the sandbox status, so the model can fix its code. The
whole text is cut to `max_output_chars`. Sandbox limits come from the tool's `config.limits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.sandbox import SandboxLimits, SandboxResult, run_python_async
from hybridflow.tools.base import BaseTool, ToolInstance, build_tool_config
from hybridflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CodeInterpreterConfig", "CodeInterpreterTool", "format_sandbox_result"]


@dataclass(frozen=True, kw_only=True)
class CodeInterpreterConfig:
    """Sandbox limits and output size of the code interpreter (the YAML entry's `config:`)."""

    limits: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `hybridflow.sandbox.SandboxLimits` (cpu_time_s, wall_time_s, memory_mb,
    output_bytes, disk_mb, isolation, ...); unset ones keep the sandbox's defaults. `isolation: none` runs
    the model's code without namespaces (only where the machine has none; the default requires them)."""

    max_output_chars: int = 4000
    """The response text is cut to this many characters (stdout is cut first; the cut is marked)."""

    stderr_tail_chars: int = 1000
    """On a failed run, this many characters from the end of stderr are shown."""

    def __post_init__(self) -> None:
        if self.max_output_chars <= 0:
            raise ValueError(f"code_interpreter config.max_output_chars must be > 0, got {self.max_output_chars}")
        if self.stderr_tail_chars < 0:
            raise ValueError(f"code_interpreter config.stderr_tail_chars must be >= 0, got {self.stderr_tail_chars}")


def _truncate(text: str, max_chars: int) -> str:
    """At most `max_chars` characters: the start of `text`, with a marker when it was cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[truncated; {len(text)} characters in all]"
    if max_chars <= len(marker):
        return text[:max_chars]
    return text[: max_chars - len(marker)] + marker


def format_sandbox_result(result: SandboxResult, max_output_chars: int, stderr_tail_chars: int) -> str:
    """The model-facing text of one run: stdout, plus a stderr tail and the status when it failed.

    At most `max_output_chars` characters; stdout is cut first, so the failure report stays visible.
    """
    report = []
    if not result.ok:
        stderr = (result.stderr or "").strip("\n")
        if stderr and stderr_tail_chars > 0:
            tail = stderr[-stderr_tail_chars:]
            report.append(("[stderr]\n" if len(tail) == len(stderr) else "[stderr, last part]\n...") + tail)
        report.append(f"[status: {result.status}, exit code: {result.exit_code}]")
    stdout = (result.stdout or "").rstrip("\n")
    if not stdout and not report:
        return "(no output; use print() to show values)"
    suffix = "\n".join(report)
    room = max_output_chars - len(suffix) - (1 if suffix and stdout else 0)
    stdout = _truncate(stdout, room) if room > 0 else ""
    return _truncate("\n".join(part for part in (stdout, suffix) if part), max_output_chars)


class CodeInterpreterTool(BaseTool):
    """Executes Python code in an isolated sandbox process; `metrics["error"]` is set when the run failed."""

    # The call's timeout also covers the wait for a sandbox slot (`max_concurrent_runs()`, shared by the
    # process): hundreds of concurrent calls of a few seconds each queue for longer than 30 s. The run itself
    # is bounded by the sandbox's own `limits.wall_time_s`.
    default_timeout_s = 120.0

    def __init__(self, config: dict[str, Any] | None = None,
                 tool_schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.config: CodeInterpreterConfig = build_tool_config(CodeInterpreterConfig, config, self.name)
        try:
            self.limits = SandboxLimits(**self.config.limits)
        except (TypeError, ValueError) as err:
            raise ValueError(f"tool {self.name!r}: invalid config.limits {self.config.limits}: {err}") from err
        self.check_timeout_above(self.limits.wall_time_s, "config.limits.wall_time_s")

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """`code_interpreter(code: string)`."""
        return OpenAIFunctionToolSchema.with_string_argument(
            "code_interpreter",
            "Run a Python 3 program and return what it prints (stdout). Only the standard library is available, "
            "there is no network, and time and memory are limited.",
            "code", "The Python program; print() the values you want to see.",
        )

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run `parameters["code"]`; metrics add the sandbox `status` and its `sandbox_wall_s`.

        A failing program is an error response; a `SandboxError` (the sandbox itself could not run) is not
        the model's doing and propagates to the caller.
        """
        result = await run_python_async(parameters["code"], limits=self.limits)
        text = format_sandbox_result(result, self.config.max_output_chars, self.config.stderr_tail_chars)
        metrics = {"error": not result.ok, "status": result.status, "sandbox_wall_s": result.wall_s}
        return ToolResponse(text=text), 0.0, metrics
