"""verl's generative reward model (reward loop + custom reward function): the judge served by
`GenerativeRewardWorker`, its OpenAI-style HTTP router, and the reward function that posts to it from a scorer
process; the requests are the judge's own greedy generations; bad requests and configs are refused naming why."""

from __future__ import annotations

import asyncio
import json
import textwrap
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from hybridflow.engines.rollout import SamplingParams
from hybridflow.models import build_causal_lm, load_tokenizer, save_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.rewards import get_reward_manager_cls
from hybridflow.rewards.config import RewardModelConfig
from hybridflow.rewards.genrm_router import ChatCompletionsRouter, parse_chat_request
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.generative_judge import GenerativeJudge, JudgedRewardManager
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.generative_reward import GenerativeRewardWorker
from hybridflow.workers.reward_config import RewardModelModelConfig, RewardModelWorkerConfig, RewardServingConfig

JUDGE = '''
import asyncio, json, urllib.request

PROMPT = "Is this answer right? {answer}"

async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer, **kwargs):
    body = {"model": "judge", "messages": [{"role": "user", "content": PROMPT.format(answer=solution_str)}],
            "temperature": 0, "max_tokens": 6}

    def post():
        request = urllib.request.Request(f"http://{reward_router_address}/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    completion = await asyncio.get_running_loop().run_in_executor(None, post)
    text = completion["choices"][0]["message"]["content"]
    return {"score": float(len(reward_model_tokenizer.encode(text)) % 2), "judgement": text}
'''


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("genrm") / "judge", seed=5))


def judge_group(judge_dir: str, free_cache: bool = True) -> LocalWorkerGroup:
    config = RewardModelWorkerConfig(
        enable=True, use_reward_loop=True, model=RewardModelModelConfig(path=judge_dir),
        rollout=RewardServingConfig(name="native", tensor_model_parallel_size=1, dtype="float32", prompt_length=64,
                                    response_length=8, free_cache_engine=free_cache),
    )
    group = LocalWorkerGroup(RayClassWithInitArgs(GenerativeRewardWorker, config, WorkerRuntimeConfig(seed=0)))
    group.init_model()
    return group


def post(address: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def greedy(judge_dir: str, messages: list[dict], max_new_tokens: int) -> str:
    tokenizer = load_tokenizer(judge_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = build_causal_lm(judge_dir).generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                                  pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_requests_are_parsed_or_refused_naming_the_field():
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_k": 4,
                                  "max_completion_tokens": 7, "n": 2, "model": "m"}, 8)
    assert (request.sampling.temperature, request.sampling.top_k, request.sampling.max_new_tokens) == (0.5, 4, 7)
    assert request.n == 2 and request.model == "m"
    bad = [({"messages": [], }, "messages"), ({"messages": [{"role": "user"}]}, "messages"),
           ({"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, r"\['stop'\]"),
           ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
           ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n must be"),
           ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9}, "exceeds the served response length")]
    for body, match in bad:
        with pytest.raises(ValueError, match=match):
            parse_chat_request(body, 8)


def test_the_router_answers_with_the_judges_greedy_generation(judge_dir):
    group = judge_group(judge_dir)
    router = ChatCompletionsRouter("127.0.0.1", max_tokens=8, max_model_len=72)
    try:
        messages = [{"role": "user", "content": "Is 2 + 2 = 4 right?"}]
        status, payload = post(router.address, {"messages": messages})
        assert status == 503 and "not attached" in payload["error"]["message"]
        router.attach(group.direct_callers("generate_tokens"), load_tokenizer(judge_dir))
        status, payload = post(router.address, {"messages": messages, "temperature": 0})
        assert status == 503 and "asleep" in payload["error"]["message"], payload
        group.wake_up_server()
        status, payload = post(router.address, {"messages": messages, "temperature": 0, "max_tokens": 6, "n": 2})
        assert status == 200, payload
        assert payload["object"] == "chat.completion" and len(payload["choices"]) == 2
        expected = greedy(judge_dir, messages, 6)
        assert [choice["message"]["content"] for choice in payload["choices"]] == [expected, expected]
        assert payload["usage"]["completion_tokens"] > 0
        status, payload = post(router.address, {"messages": messages, "logprobs": True})
        assert status == 400 and "logprobs" in payload["error"]["message"]
        assert post(router.address, {"messages": messages}, path="/v1/completions")[0] == 404
        assert "reward_model/server/num_requests" in group.sleep_server()[0]
    finally:
        router.close()


def test_a_replica_that_does_not_answer_in_time_gives_504(judge_dir):
    """A stuck judge costs the request its timeout (the scorer's), not the router's thread forever."""
    async def stuck(request_id, prompt_ids, sampling_params):
        await asyncio.sleep(30)

    router = ChatCompletionsRouter("127.0.0.1", max_tokens=8, max_model_len=72, request_timeout_s=0.3)
    try:
        router.attach([stuck], load_tokenizer(judge_dir))
        status, payload = post(router.address, {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 504 and "within 0.3 s" in payload["error"]["message"]
    finally:
        router.close()


def test_a_reward_function_in_a_scorer_process_judges_through_the_router(judge_dir, tmp_path):
    """The run's path: a judged reward manager wakes the judge, the async reward function posts from a scorer
    process with verl's keywords, and the judge sleeps again after the batch."""
    (tmp_path / "judge.py").write_text(textwrap.dedent(JUDGE))
    config = load_config([
        f"data.train_files={tmp_path / 'none.parquet'}", f"actor_rollout_ref.model.path={judge_dir}",
        "reward_model.enable=True", "reward_model.use_reward_loop=True", f"reward_model.model.path={judge_dir}",
        "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.response_length=8",
        "reward_model.rollout.name=native", "reward_model.rollout.dtype=float32",
        f"custom_reward_function.path={tmp_path / 'judge.py'}", "reward_model.scoring.num_workers=2",
        "reward_model.scoring.timeout_s=60",
    ])
    assert config.generative_reward_model and not config.reward_model_only
    judge = GenerativeJudge(config)
    tokenizer = load_tokenizer(judge_dir)
    try:
        compute_score = judge.reward_function(str(tmp_path / "judge.py"), "compute_score", {})
        manager = JudgedRewardManager(
            get_reward_manager_cls("naive").from_config(tokenizer, compute_score, RewardModelConfig(
                scoring=config.reward_model.scoring), config.data), judge)
        judge.attach(judge_group(judge_dir))
        result = manager(_batch(tokenizer, ["4", "five", "22"]))
        assert result.metrics["reward_model/judge_requests"] == 3.0
        judgements = result.extra_info["judgement"]
        for answer, judgement in zip(["4", "five", "22"], judgements):
            messages = [{"role": "user", "content": f"Is this answer right? {answer}"}]
            assert judgement == greedy(judge_dir, messages, 6)
        replica = judge.group.direct_callers("generate_tokens")[0]
        with pytest.raises(RuntimeError, match="asleep"):  # the judge sleeps between batches
            asyncio.run(replica("x", [1, 2], SamplingParams(max_new_tokens=2)))
        manager.close()
    finally:
        judge.close()


def _batch(tokenizer, answers: list[str]) -> DataProto:
    responses = [tokenizer(answer, add_special_tokens=False)["input_ids"] for answer in answers]
    width = max(map(len, responses))
    prompt = torch.tensor([[5, 6, 7]] * len(answers))
    response = torch.full((len(answers), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(answers), width), dtype=torch.long)
    for row, ids in enumerate(responses):
        response[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    attention = torch.cat([torch.ones_like(prompt), mask], dim=1)
    return DataProto.from_dict(
        tensors={"prompts": prompt, "responses": response, "input_ids": torch.cat([prompt, response], 1),
                 "attention_mask": attention, "response_mask": mask},
        non_tensors={"data_source": np.array(["judge"] * len(answers), dtype=object),
                     "reward_model": np.array([{"ground_truth": "4"}] * len(answers), dtype=object)},
    )


def test_configs_that_cannot_be_served_are_refused_before_ray(judge_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]], "data_source": ["x"],
                             "reward_model": [{"ground_truth": "1"}]}), data)
    (tmp_path / "judge.py").write_text(textwrap.dedent(JUDGE))
    (tmp_path / "plain.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                       "    return 0.0\n")
    base = [f"data.train_files={data}", f"actor_rollout_ref.model.path={judge_dir}", "reward_model.enable=True",
            "reward_model.use_reward_loop=True", f"reward_model.model.path={judge_dir}", "data.train_batch_size=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "reward_model.rollout.name=native", f"custom_reward_function.path={tmp_path / 'judge.py'}"]
    one = "reward_model.rollout.tensor_model_parallel_size=1"
    validate_config(load_config([*base, one]))
    cases = [
        ([], r"reward_model.rollout.tensor_model_parallel_size=2, .* over 1 ranks"),  # verl's default: 2 ranks
        ([one, "reward_model.rollout.expert_parallel_size=2"], r"expert_parallel_size=2 with a generative reward"),
        ([one, "reward_model.rollout.name=vllm"], r"reward_model.rollout.name='vllm'"),
        ([one, f"custom_reward_function.path={tmp_path / 'plain.py'}"],
         r"does not take \['reward_router_address', 'reward_model_tokenizer'\]"),
        ([one, "reward_model.rule_reward_coef=0.5"], "rule_reward_coef=0.5 with a generative reward model"),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            validate_config(load_config([*base, *extra]))
