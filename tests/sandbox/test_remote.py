"""The SandboxFusion client against a stand-in server speaking SandboxFusion's run_code API (it runs each program
in hybridflow's local sandbox and answers a RunCodeResponse), and against servers that fail: code rows'
cases go to the server, test-code rows never do, and a server that cannot run the program is an error, never
a wrong answer."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards.config import SandboxFusionConfig
from hybridflow.rewards.manager.naive import NaiveRewardManager
from hybridflow.rewards.pool import ScoringConfig
from hybridflow.rewards.score import default_compute_score
from hybridflow.sandbox import SandboxError
from hybridflow.sandbox.remote import SandboxFusionEndpoint, result_from_response
from hybridflow.utils.config import ConfigFieldError
from tests.sandbox.sandbox_fusion_server import LIMITS, server  # noqa: F401 (a fixture)


ADD = {"fn_name": "add", "inputs": ["1\n2", "5\n7"], "outputs": ["3", "12"]}


def score(data_source: str, answer: str, ground_truth, endpoint: SandboxFusionEndpoint) -> dict:
    return default_compute_score(data_source, f"```python\n{answer}\n```", ground_truth, sandbox=LIMITS,
                                 remote_sandbox=endpoint)


def test_cases_run_on_the_server_with_verl_s_request(server) -> None:
    endpoint = SandboxFusionEndpoint(url=server.url, memory_limit_mb=300)
    assert score("apps", "def add(a, b):\n    return a + b", ADD, endpoint)["score"] == 1.0
    assert score("apps", "def add(a, b):\n    return a - b if a > 1 else a + b", ADD, endpoint)["score"] == 0.5
    assert len(server.requests) == 4
    first = server.requests[0]
    assert first["language"] == "python" and first["memory_limit_MB"] == 300 and first["stdin"] == "1\n2"
    assert {"compile_timeout", "run_timeout", "files", "fetch_files"} <= set(first) and 0 < first["run_timeout"] <= 8
    stdin_rows = {"inputs": ["2\n"], "outputs": ["4\n"]}
    assert score("code", "print(int(input()) * 2)", stdin_rows, endpoint)["score"] == 1.0
    assert server.requests[-1]["stdin"] == "2\n"


def test_test_code_rows_stay_in_the_local_harness(server) -> None:
    endpoint = SandboxFusionEndpoint(url=server.url)
    tests = "def check(candidate):\n    assert candidate(2) == 4\ncheck(double)\n"
    result = score("code", "def double(x):\n    return 2 * x", tests, endpoint)
    assert result["score"] == 1.0 and server.requests == []


def test_a_gateway_timeout_is_retried(server, monkeypatch) -> None:
    monkeypatch.setattr("hybridflow.sandbox.remote.time.sleep", lambda seconds: None)
    server.answers = [(504, "{}")]
    assert score("apps", "def add(a, b):\n    return a + b", ADD, SandboxFusionEndpoint(url=server.url))["score"] == 1.0
    assert len(server.requests) == 3  # the retried first case, then the second


@pytest.mark.parametrize("answer, message", [
    ((500, "{}"), "HTTP 500"),
    ((200, {"status": "SandboxError", "message": "no executor"}), "did not run the program"),
    ((200, "not json"), "not JSON"),
    ((200, {"status": "Success"}), "without a run_result"),
])
def test_a_server_that_cannot_run_the_program_raises(server, answer, message) -> None:
    server.answers = [answer]
    with pytest.raises(SandboxError, match=message):
        score("apps", "def add(a, b):\n    return a + b", ADD, SandboxFusionEndpoint(url=server.url))


def test_an_unreachable_server_names_the_key() -> None:
    with pytest.raises(SandboxError, match="could not be reached.*reward_model.sandbox_fusion.url"):
        SandboxFusionEndpoint(url="http://127.0.0.1:9/run_code").run_python("print(1)", wall_time_s=1)


def test_responses_map_to_sandbox_statuses() -> None:
    def run(status: str, code: int = 0) -> str:
        answer = {"status": "Failed", "run_result": {"status": status, "return_code": code, "stdout": "", "stderr": ""}}
        return result_from_response(answer, wall_s=0.1).status

    assert (run("Finished"), run("Finished", 1), run("TimeLimitExceeded"), run("Error", 1)) == (
        "ok", "error", "timeout", "error")
    compile_failed = {"status": "Failed", "compile_result": {"status": "Finished", "return_code": 1, "stderr": "x"},
                      "run_result": None}
    assert result_from_response(compile_failed, wall_s=0.1).status == "error"


class CharTokenizer:
    """One token per character (id = code point)."""

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(chr(t) for t in seq) for seq in sequences]


def test_the_reward_manager_sends_cases_from_its_scorer_processes(server) -> None:
    answer = "```python\ndef add(a, b):\n    return a + b\n```"
    responses = torch.tensor([[ord(c) for c in answer]])
    data = DataProto.from_dict(
        tensors={"prompts": torch.tensor([[ord("q")]]), "responses": responses,
                 "attention_mask": torch.ones((1, responses.size(1) + 1), dtype=torch.long)},
        non_tensors={"data_source": ["codecontests"], "reward_model": [{"ground_truth": json.dumps(ADD)}]})
    manager = NaiveRewardManager(CharTokenizer(), scoring=ScoringConfig(num_workers=1, sandbox=LIMITS),
                                 remote_sandbox=SandboxFusionConfig(url=server.url).endpoint())
    try:
        result = manager(data)
    finally:
        manager.close()
    assert result.reward_tensor.sum().item() == 1.0 and len(server.requests) == 2


def test_config_checks() -> None:
    assert SandboxFusionConfig().endpoint() is None
    assert SandboxFusionConfig(url="https://sandbox.example/run_code", memory_limit_mb=512).endpoint() == \
        SandboxFusionEndpoint(url="https://sandbox.example/run_code", memory_limit_mb=512)
    with pytest.raises(ConfigFieldError, match="http:// or https://"):
        SandboxFusionConfig(url="sandbox:8080/run_code")
    with pytest.raises(ConfigFieldError, match="max_concurrent=0"):
        SandboxFusionConfig(max_concurrent=0)
    from hybridflow.rewards.config import RewardModelConfig
    from hybridflow.rewards.pool import ScoringConfig

    fusion = SandboxFusionConfig(url="https://sandbox.example/run_code", max_concurrent=2)
    with pytest.raises(ConfigFieldError, match="max_concurrent=2 is below reward_model.scoring.num_workers=4"):
        RewardModelConfig(sandbox_fusion=fusion, scoring=ScoringConfig(num_workers=4))
    RewardModelConfig(sandbox_fusion=fusion, scoring=ScoringConfig(num_workers=2))
