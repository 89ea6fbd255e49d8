"""The `sandbox_fusion` tool: verl's SandboxFusionTool. Runs the model's code on a SandboxFusion server
(`config.sandbox_fusion_url`, its run_code endpoint) and returns what it printed.

The YAML `config:` takes verl's keys: `sandbox_fusion_url` (required), `default_timeout` (seconds of run time),
`default_language`, `memory_limit_mb`, `rate_limit` (requests in flight at once from this process),
`num_workers` (threads that wait on the server; requests beyond them queue) and `enable_global_rate_limit`
(verl shares one limit across its processes through a Ray actor; here every tool runs in the one process that
drives the agent loops, so the limit is that process's, true either way). A call may pass `timeout` and
`language` when the tool's schema offers them; a `timeout` can shorten the run, never lengthen it past
`default_timeout`.

The reply is the code interpreter's (`format_sandbox_result`): stdout, and on a failed run a tail of stderr and
the status, where verl's reply is 'no stdout here'. A server that cannot be reached or cannot run the code is
an error reply to the model and counts in the tool's error metrics; the agent loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

from hybridflow.sandbox import SandboxError, SandboxResult
from hybridflow.sandbox.remote import SandboxFusionEndpoint, check_endpoint_url
from hybridflow.tools.base import BaseTool, ToolError, ToolInstance, build_tool_config
from hybridflow.tools.code_interpreter import CodeInterpreterTool, format_sandbox_result
from hybridflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["SandboxFusionTool", "SandboxFusionToolConfig"]


@dataclass(frozen=True, kw_only=True)
class SandboxFusionToolConfig:
    """verl's SandboxFusionTool config keys (the YAML entry's `config:`)."""

    sandbox_fusion_url: str = ""
    """The server's run_code endpoint (http:// or https://); required."""
    default_timeout: float = 30.0
    """Seconds of run time a call gets (a call's own `timeout` may only shorten it)."""
    default_language: str = "python"
    """The language of the code when a call does not name one (any the server runs)."""
    memory_limit_mb: int = 1024
    """Memory limit of each run on the server."""
    rate_limit: int = 10
    """Requests in flight to the server at once from this process."""
    num_workers: int = 10
    """Threads that wait on the server's answers."""
    enable_global_rate_limit: bool = True
    """verl: share rate_limit across processes; here all calls come from one process (see the module doc)."""
    max_output_chars: int = 4000
    """The reply is cut to this many characters."""
    stderr_tail_chars: int = 1000
    """On a failed run, this many characters from the end of stderr are shown."""

    def __post_init__(self) -> None:
        if not self.sandbox_fusion_url:
            raise ValueError("config.sandbox_fusion_url is not set: give the server's run_code "
                             "endpoint (e.g. http://localhost:8080/run_code), or use the local `code_interpreter`")
        check_endpoint_url(self.sandbox_fusion_url, "config.sandbox_fusion_url")
        for name in ("default_timeout", "memory_limit_mb", "rate_limit", "num_workers", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.{name}={getattr(self, name)} must be > 0")


class SandboxFusionTool(BaseTool):
    """Executes code on a SandboxFusion server; `metrics["error"]` is set when the run failed."""

    default_timeout_s = 120.0

    def __init__(self, config: dict[str, Any] | None = None,
                 tool_schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.config: SandboxFusionToolConfig = build_tool_config(SandboxFusionToolConfig, config, self.name)
        self.endpoint = SandboxFusionEndpoint(url=self.config.sandbox_fusion_url,
                                              memory_limit_mb=self.config.memory_limit_mb)
        self.check_timeout_above(self.config.default_timeout, "config.default_timeout")
        self._threads = concurrent.futures.ThreadPoolExecutor(self.config.num_workers, thread_name_prefix=self.name)
        # held by the thread that waits on the server: bounds requests in flight whichever event loop calls
        self._in_flight = threading.BoundedSemaphore(self.config.rate_limit)

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """The code interpreter's `code_interpreter(code: string)`, verl's schema for this tool too."""
        return CodeInterpreterTool.default_tool_schema()

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run `parameters["code"]` on the server; metrics add the run's `status`."""
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("give the program to run as the string argument 'code'")
        run_time = self.config.default_timeout
        if isinstance(parameters.get("timeout"), int | float) and parameters["timeout"] > 0:
            run_time = min(float(parameters["timeout"]), run_time)
        language = str(parameters.get("language") or self.config.default_language)

        def run() -> SandboxResult:
            with self._in_flight:
                return self.endpoint.run_code(code, language=language, wall_time_s=run_time)

        try:
            result = await asyncio.get_running_loop().run_in_executor(self._threads, run)
        except SandboxError as err:
            return ToolResponse(text=f"[the code could not be run: {err}]"), 0.0, {"error": True,
                                                                                    "status": "server_error"}
        text = format_sandbox_result(result, self.config.max_output_chars, self.config.stderr_tail_chars)
        return ToolResponse(text=text), 0.0, {"error": not result.ok, "status": result.status}
