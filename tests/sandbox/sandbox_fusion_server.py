"""A stand-in SandboxFusion server for tests: it speaks the run_code API and runs each program in hybridflow's
local sandbox, or answers what a test scripts."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_time_s=4.0, wall_time_s=8.0, memory_mb=512)


class StandIn:
    """A run_code server on a free local port; `answers` scripts the replies (HTTP status, body) before it
    falls back to running the program."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.answers: list[tuple[int, dict | str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                status, answer = owner.answers.pop(0) if owner.answers else (200, owner.run(body))
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def run(body: dict) -> dict:
        result = run_python(body["code"], stdin=body["stdin"] or "", limits=LIMITS)
        status = {"ok": "Finished", "timeout": "TimeLimitExceeded"}.get(result.status, "Error")
        return {"status": "Success" if result.ok else "Failed", "message": "", "compile_result": None,
                "run_result": {"status": status, "return_code": result.exit_code, "stdout": result.stdout,
                               "stderr": result.stderr, "execution_time": result.wall_s}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def server():
    stand_in = StandIn()
    yield stand_in
    stand_in.close()


@pytest.fixture()
def server():
    """A `StandIn` on a free local port, shut down after the test."""
    stand_in = StandIn()
    yield stand_in
    stand_in.close()
