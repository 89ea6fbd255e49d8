"""verl's generative reward model end to end on local Ray: the judge served as one replica split over the actor's
2 ranks (tensor parallel, its first rank taking the requests), then one replica per rank, in the same Ray session
(each run's judge, router and placement are released at its end), a custom reward function asking it over HTTP
from the scorer processes, in training and validation. (The worker test holds the replicas' own checks,
tests/workers/test_generative_reward.py.)"""

from __future__ import annotations

import textwrap

import pytest

from tests.trainer.e2e_runs import by_step, overrides, run, workspace  # noqa: F401  (fixtures)

JUDGE = '''
import json, urllib.request

def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                  reward_model_tokenizer, **kwargs):
    body = {"messages": [{"role": "user", "content": "Grade: " + solution_str}], "temperature": 0, "max_tokens": 4}
    request = urllib.request.Request(f"http://{reward_router_address}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = json.loads(response.read())["choices"][0]["message"]["content"]
    return float(len(reward_model_tokenizer.encode(text)) % 3) / 2
'''


@pytest.mark.slow  # a long end-to-end run; the judge, its router and the function's path are tested in every CI run
@pytest.mark.parametrize("judge_tp", [2, 1])
def test_grpo_judged_by_a_generative_reward_model(workspace, tmp_path, judge_tp):
    (tmp_path / "judge.py").write_text(textwrap.dedent(JUDGE))
    records = by_step(run(overrides(
        workspace, workspace / f"genrm_tp{judge_tp}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2", "trainer.test_freq=2",
        "reward_model.enable=True", "reward_model.use_reward_loop=True",
        f"reward_model.model.path={workspace / 'tiny'}", f"reward_model.rollout.tensor_model_parallel_size={judge_tp}",
        "reward_model.rollout.name=native", "reward_model.rollout.dtype=float32",
        "reward_model.rollout.response_length=8", "reward_model.rollout.prompt_length=256",
        f"custom_reward_function.path={tmp_path / 'judge.py'}", "reward_model.scoring.timeout_s=60",
    )))
    for step in (1, 2):
        assert records[step]["reward_model/judge_requests"] == 8.0  # 4 prompts x 2 samples, each judged once
        assert records[step]["reward/errors"] == 0 and records[step]["reward/timeouts"] == 0  # every judge answered
    assert any(key.startswith("val-core/") for key in records[2]), "validation is judged too"
