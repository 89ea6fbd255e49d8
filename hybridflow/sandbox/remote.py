"""A remote SandboxFusion server (verl's `reward_model.sandbox_fusion.url`) as a place to run model-written
programs: one HTTP POST per run to its `run_code` endpoint, the answer read back as a `SandboxResult`.

The request is SandboxFusion's `RunCodeRequest` as verl sends it (`code`, `stdin`, `language`,
`compile_timeout`, `run_timeout`, `memory_limit_MB`, `files`, `fetch_files`); the answer is its
`RunCodeResponse`: `status` ('Success', 'Failed' or 'SandboxError') and `run_result`/`compile_result`
(`status` 'Finished', 'TimeLimitExceeded' or 'Error', `return_code`, `stdout`, `stderr`, `execution_time`).
The server isolates the program; this module only talks to it, with the standard library's HTTP client.

A server that cannot be reached, answers with an HTTP error, or reports `SandboxError` raises `SandboxError`
here: the program did not run, and the scorer calling this counts an error (`reward/errors`), never a wrong
answer. A 504 (gateway timeout) is retried, as verl does.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from hybridflow.sandbox.limits import SandboxError, SandboxResult
from hybridflow.utils.config import ConfigFieldError

__all__ = ["SandboxFusionEndpoint", "check_endpoint_url", "result_from_response"]

REQUEST_MARGIN_S = 10.0
"""Seconds the HTTP request may take beyond the program's compile and run timeouts (verl's API_TIMEOUT)."""


def check_endpoint_url(url: str, key: str) -> None:
    """`url` (the setting `key`) is an http(s) address; ConfigFieldError naming `key` otherwise."""
    if not url.startswith(("http://", "https://")):
        raise ConfigFieldError(key, f"{key}={url!r} must be an http:// or https:// address of SandboxFusion's "
                                    "run_code endpoint (e.g. http://localhost:8080/run_code)")


@dataclass(frozen=True, kw_only=True)
class SandboxFusionEndpoint:
    """Where and how to run programs remotely (picklable: scorer processes receive it)."""

    url: str
    """The `run_code` endpoint, e.g. http://localhost:8080/run_code."""
    memory_limit_mb: int = 1024
    """Memory limit of each program, sent as `memory_limit_MB`."""
    compile_timeout_s: float = 10.0
    """Sent as `compile_timeout` (compiled languages; Python's is not used)."""
    max_retries: int = 3
    """Attempts of a request answered with 504 (gateway timeout), 1 s, 2 s, ... apart."""

    def __post_init__(self) -> None:
        check_endpoint_url(self.url, "url")
        if self.memory_limit_mb <= 0:
            raise ValueError(f"memory_limit_mb={self.memory_limit_mb} must be > 0")
        if self.max_retries < 1:
            raise ValueError(f"max_retries={self.max_retries} must be >= 1")

    def run_python(self, code: str, *, stdin: str = "", wall_time_s: float) -> SandboxResult:
        """Run `code` (Python) on the server with `stdin`, at most `wall_time_s` seconds of run time."""
        return self.run_code(code, language="python", stdin=stdin, wall_time_s=wall_time_s)

    def run_code(self, code: str, *, language: str, stdin: str = "", wall_time_s: float) -> SandboxResult:
        """Run `code` in `language` (one of the server's: python, cpp, bash, ...) with `stdin`."""
        payload = json.dumps({
            "code": code, "stdin": stdin, "language": language, "compile_timeout": self.compile_timeout_s,
            "run_timeout": wall_time_s, "memory_limit_MB": self.memory_limit_mb, "files": {}, "fetch_files": [],
        }).encode()
        started = time.monotonic()
        answer = self._post(payload, timeout_s=self.compile_timeout_s + wall_time_s + REQUEST_MARGIN_S)
        return result_from_response(answer, wall_s=time.monotonic() - started, url=self.url)

    def _post(self, payload: bytes, timeout_s: float) -> dict:
        request = urllib.request.Request(self.url, data=payload, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        for attempt in range(1, self.max_retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as err:
                if err.code == 504 and attempt < self.max_retries:
                    time.sleep(attempt)
                    continue
                raise SandboxError(f"SandboxFusion at {self.url} answered HTTP {err.code} ({err.reason}) "
                                   f"on attempt {attempt} of {self.max_retries}") from err
            except (urllib.error.URLError, TimeoutError, OSError) as err:
                raise SandboxError(f"SandboxFusion at {self.url} could not be reached: {err}; check "
                                   "reward_model.sandbox_fusion.url") from err
            except json.JSONDecodeError as err:
                raise SandboxError(f"SandboxFusion at {self.url} answered with something that is not JSON: "
                                   f"{err}") from err
        raise AssertionError("unreachable: the last attempt returns or raises")


def result_from_response(answer: dict, *, wall_s: float, url: str = "the server") -> SandboxResult:
    """A `RunCodeResponse` as a `SandboxResult`: a run that finished with return code 0 is 'ok', one past its
    run timeout 'timeout', any other run or compile failure 'error'. SandboxError when the server itself failed
    or the answer has no result to read."""
    status = answer.get("status") if isinstance(answer, dict) else None
    if status not in ("Success", "Failed"):
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise SandboxError(f"SandboxFusion at {url} did not run the program (status {status!r}: {message})")
    compile_result = answer.get("compile_result") or {}
    if compile_result and (compile_result.get("status") != "Finished" or compile_result.get("return_code")):
        return SandboxResult(status="timeout" if compile_result.get("status") == "TimeLimitExceeded" else "error",
                             exit_code=compile_result.get("return_code"), stdout=compile_result.get("stdout") or "",
                             stderr=compile_result.get("stderr") or "", wall_s=wall_s, isolation=("sandbox_fusion",),
                             isolation_mode="remote")
    run_result = answer.get("run_result")
    if not isinstance(run_result, dict):
        raise SandboxError(f"SandboxFusion at {url} answered status {status!r} without a run_result")
    run_status, return_code = run_result.get("status"), run_result.get("return_code")
    if run_status == "TimeLimitExceeded":
        outcome = "timeout"
    elif run_status == "Finished" and return_code == 0:
        outcome = "ok"
    else:
        outcome = "error"
    return SandboxResult(status=outcome, exit_code=return_code, stdout=run_result.get("stdout") or "",
                         stderr=run_result.get("stderr") or "", wall_s=wall_s,
                         cpu_s=run_result.get("execution_time"), isolation=("sandbox_fusion",),
                         isolation_mode="remote")
