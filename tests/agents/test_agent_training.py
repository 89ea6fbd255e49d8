"""Agent loops with a real tiny model: the generation server in the worker, masks in the update, GRPO end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hybridflow.agents.interactions import BaseInteraction
from hybridflow.agents.manager import AgentLoopManager
from hybridflow.engines.rollout import SamplingParams
from hybridflow.protocol import DataProto


def worker_group(model_dir: str):
    from hybridflow.single_controller.local import LocalWorkerGroup
    from hybridflow.single_controller.ray import RayClassWithInitArgs
    from hybridflow.workers import ActorRolloutRefWorker
    from hybridflow.engines.rollout import MultiTurnConfig, RolloutConfig
    from hybridflow.engines.training import OptimConfig
    from hybridflow.models.config import ModelConfig
    from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig, WorkerRuntimeConfig

    config = ActorRolloutRefConfig(
        model=ModelConfig(path=model_dir),
        actor=ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2)),
        rollout=RolloutConfig(
            name="native", mode="async", temperature=1.0, prompt_length=64, response_length=24,
            multi_turn=MultiTurnConfig(enable=True, max_tokens_per_turn=6),
        ),
    )
    runtime = WorkerRuntimeConfig(seed=0, num_threads=1)
    group = LocalWorkerGroup(RayClassWithInitArgs(ActorRolloutRefWorker, config, "actor_rollout", runtime), world_size=1)
    group.init_model()
    return group, config


def agent_prompts(n: int) -> DataProto:
    messages = np.empty(n, dtype=object)
    kwargs = np.empty(n, dtype=object)
    for i in range(n):
        messages[i] = [{"role": "user", "content": f"What is {i} + 1?"}]
        kwargs[i] = {"name": "feedback", "data_source": "openai/gsm8k", "ground_truth": str(i + 1)}
    ids = torch.ones((n, 2), dtype=torch.long)  # the loop renders raw_prompt itself; these are placeholders
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": ids, "position_ids": ids.cumsum(-1) - 1},
        non_tensors={"raw_prompt": messages, "interaction_kwargs": kwargs},
    )


class AlwaysWrong(BaseInteraction):
    """A user who answers every turn with the same retry request (scores 0)."""

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "Wrong, try again.", 0.0, {}


def test_mask_zero_tokens_do_not_change_the_update(tmp_path):
    """Perturbing advantages and old log-probs at tool/user positions (mask 0) leaves the update identical."""
    from hybridflow.models import load_tokenizer, save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "tiny", num_layers=2, hidden=64, seed=0))
    tokenizer = load_tokenizer(model_dir)
    group_a, config = worker_group(model_dir)
    group_b, _ = worker_group(model_dir)
    interactions = {"feedback": AlwaysWrong()}  # user turns (mask 0) without a scorer process
    manager = AgentLoopManager(group_a, config.rollout, tokenizer, 24, interactions=interactions)
    with pytest.raises(TypeError, match="direct_callers"):  # a per-replica method, not a group call
        group_a.generate_tokens("r", [1, 2], SamplingParams())
    torch.manual_seed(0)
    batch = manager.generate_sequences(agent_prompts(4))
    mask = batch.batch["response_mask"]
    attended = batch.batch["attention_mask"][:, -mask.size(1):]
    assert ((attended == 1) & (mask == 0)).any(), "the user's feedback must be in the trajectories with mask 0"
    assert batch.meta_info["metrics"]["num_turns/max"] >= 3
    assert batch.meta_info["metrics"]["rollout_server/mean_batch_size"] > 1  # concurrent loops were batched
    assert batch.meta_info["metrics"]["rollout_server/prefix_reuse"] > 0  # later turns reused their caches
    batch.meta_info = {}
    old = group_a.compute_log_prob(batch)
    # The engine scores the whole trajectory: its log-probs of model tokens match what the server sampled.
    diff = (old.batch["old_log_probs"] - batch.batch["rollout_log_probs"])[mask.bool()].abs().max()
    assert diff < 1e-4, float(diff)
    batch.batch["old_log_probs"] = old.batch["old_log_probs"]
    batch.batch["advantages"] = torch.linspace(-1, 1, 4)[:, None].expand_as(mask).contiguous()
    perturbed = DataProto.from_dict(tensors={k: v.clone() for k, v in batch.batch.items()}, meta_info=dict(batch.meta_info))
    noise = torch.randn(mask.shape) * 5
    for key in ("advantages", "old_log_probs"):
        perturbed.batch[key] = torch.where(mask.bool(), perturbed.batch[key], noise)
    metrics_a = group_a.update_actor(batch).meta_info["metrics"]
    metrics_b = group_b.update_actor(perturbed).meta_info["metrics"]
    params_a = dict(group_a.workers[0].actor_engine.named_full_params())
    params_b = dict(group_b.workers[0].actor_engine.named_full_params())
    assert metrics_a["actor/grad_norm"][0] > 0 and metrics_b["actor/pg_loss"] == metrics_a["actor/pg_loss"]
    for name, value in params_a.items():
        assert torch.equal(value, params_b[name]), name


class ScriptedFirstTurnServer:
    """The real generation server, except that a trajectory's first turn is a fixed calculator call: a random tiny
    model never writes one, and the tool path (parsing, running the tool, mask-0 tool tokens) must run end to end."""

    def __init__(self, server, tokenizer, expression: str) -> None:
        call = {"name": "calculator", "arguments": {"expression": expression}}
        self.ids = tokenizer(f"<tool_call>\n{json.dumps(call)}\n</tool_call>", add_special_tokens=False)["input_ids"]
        self.server, self.first = server, True

    async def generate(self, request_id, prompt_ids, params):
        from hybridflow.engines.rollout.server import TokenOutput

        if not self.first:
            return await self.server.generate(request_id, prompt_ids, params)
        self.first = False
        return TokenOutput(token_ids=list(self.ids), log_probs=[0.0] * len(self.ids), finish_reason="stop")


def register_scripted_tool_agent() -> None:
    import dataclasses

    from hybridflow.agents.base import AGENT_LOOPS
    from hybridflow.agents.tool_agent import ToolAgentLoop

    if "scripted_tool_agent" in AGENT_LOOPS.names():
        return

    @AGENT_LOOPS.register("scripted_tool_agent")
    class ScriptedToolAgent(ToolAgentLoop):
        async def run(self, messages, sampling_params, **kwargs):
            server = ScriptedFirstTurnServer(self.context.server, self.context.tokenizer, "6 * 7 + 3")
            self.context = dataclasses.replace(self.context, server=server)
            return await super().run(messages, sampling_params, **kwargs)


REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 11) / 10.0
'''


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_grpo_with_tool_agent_end_to_end(tmp_path, ray_cluster):
    """hybridflow train with rollout.mode=async, the tool agent, a calculator tool and a feedback interaction."""
    from hybridflow.models import save_tiny_model
    from hybridflow.trainer.config import load_config, validate_config
    from hybridflow.trainer.run import run_ppo

    save_tiny_model(tmp_path / "tiny", num_layers=2, hidden=64, seed=0)
    register_scripted_tool_agent()  # agent loops run in the driver: a loop registered here is used by the run
    rows = []
    for i in range(8):
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Compute {i} * 7 + 3."}],
            "reward_model": {"style": "rule", "ground_truth": str(i * 7 + 3)},
            "extra_info": {"index": i, "interaction_kwargs": {"name": "feedback", "data_source": "openai/gsm8k",
                                                              "ground_truth": str(i * 7 + 3)}},
            "agent_name": "scripted_tool_agent" if i % 2 == 0 else "tool_agent",
        })
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    (tmp_path / "interaction.yaml").write_text("interaction:\n  - name: feedback\n    type: answer_feedback\n")
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    args = [
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "data.max_prompt_length=512",
        "data.max_response_length=96",  # room for the scripted call, its result and a feedback turn
        "data.return_raw_chat=True",
        f"actor_rollout_ref.model.path={tmp_path / 'tiny'}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=6",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'interaction.yaml'}",
        "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
    ]
    config = load_config(args)
    run_ppo(config, validate_config(config))
    records = [json.loads(line) for line in (Path(config.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "actor/grad_norm" in r}
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert record["actor/grad_norm"] > 0 and record["critic/score/mean"] > 0
        assert record["num_turns/mean"] >= 3, "wrong answers get the interaction's feedback turn"
        # The even rows' trajectories (scripted_tool_agent) open with one calculator call, which runs without error.
        assert record["tool_calls/max"] >= 1 and record["tool_calls/mean"] > 0, record
        assert record["tool/error_rate"] == 0 and record["timing_s/gen"] > 0


def test_async_mode_config_errors(tmp_path):
    from hybridflow.trainer.config import load_config, validate_config

    train = tmp_path / "train.parquet"
    pd.DataFrame([{"data_source": "gsm8k", "prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}]).to_parquet(train)
    base = [f"data.train_files=[{train}]", "data.val_files=[]", "actor_rollout_ref.rollout.mode=async"]
    with pytest.raises(ValueError, match="return_raw_chat"):
        validate_config(load_config(base))
    with pytest.raises(ValueError, match="multi_turn.tool_config_path"):
        validate_config(load_config([*base, "data.return_raw_chat=True",
                                     f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'none.yaml'}"]))
    with pytest.raises(ValueError, match="mode=async"):
        validate_config(load_config([f"data.train_files=[{train}]", "actor_rollout_ref.rollout.multi_turn.enable=True"]))
