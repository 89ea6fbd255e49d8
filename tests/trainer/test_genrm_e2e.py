"""verl's generative reward model end to end on local Ray: the judge served as one replica split over the actor's
2 ranks (tensor parallel, its first rank taking the requests), a custom reward function asking it over HTTP from
the scorer processes, in training and validation. (One judge per rank is the worker test's layout,
tests/workers/test_generative_reward.py.)

Known issue: under pytest's session cluster a second judged run in the same Ray session hangs at its shutdown
(its ray.kill and remove_placement_group never reach the GCS), though three judged runs in one plain process
(tp 1, 2, 1) finish; so this file runs one judged run. The CLI runs one per process."""

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
def test_grpo_judged_by_a_tensor_parallel_generative_reward_model(workspace, tmp_path):
    (tmp_path / "judge.py").write_text(textwrap.dedent(JUDGE))
    records = by_step(run(overrides(
        workspace, workspace / "genrm_tp2", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2", "trainer.test_freq=2",
        "reward_model.enable=True", "reward_model.use_reward_loop=True",
        f"reward_model.model.path={workspace / 'tiny'}", "reward_model.rollout.tensor_model_parallel_size=2",
        "reward_model.rollout.name=native", "reward_model.rollout.dtype=float32",
        "reward_model.rollout.response_length=8", "reward_model.rollout.prompt_length=256",
        f"custom_reward_function.path={tmp_path / 'judge.py'}", "reward_model.scoring.timeout_s=60",
    )))
    for step in (1, 2):
        assert records[step]["reward_model/judge_requests"] == 8.0  # 4 prompts x 2 samples, each judged once
        assert records[step]["reward/errors"] == 0 and records[step]["reward/timeouts"] == 0  # every judge answered
    assert any(key.startswith("val-core/") for key in records[2]), "validation is judged too"
