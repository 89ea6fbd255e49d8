"""Build the role worker groups of an RL run: colocated in one process per rank (Ray or in the driver)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls
from hybridflow.trainer.config import PPOConfig, critic_enabled, uses_reference
from hybridflow.trainer.scaffold import WorkerProcesses, worker_runtime
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker


@dataclass
class WorkerGroups:
    """The groups the driver calls; `critic` / `reward_model` are None when the run has no such role."""

    actor_rollout: Any
    critic: Any | None
    processes: WorkerProcesses
    reward_model: Any | None = None

    def shutdown(self) -> None:
        """Kill the worker processes and release their placement group."""
        self.processes.shutdown()


def build_worker_groups(config: PPOConfig, total_training_steps: int) -> WorkerGroups:
    """Start one process per rank hosting actor+rollout(+ref)(+critic)(+reward model), split into role groups."""
    runtime = worker_runtime(config.trainer, total_training_steps)
    role = "actor_rollout_ref" if uses_reference(config) else "actor_rollout"
    classes = {"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, config.actor_rollout_ref, role, runtime)}
    if critic_enabled(config):
        classes["critic"] = RayClassWithInitArgs(CriticWorker, config.critic, config.actor_rollout_ref.rollout.n, runtime)
    if config.reward_model.enable:
        classes["rm"] = RayClassWithInitArgs(RewardModelWorker, config.reward_model, runtime)
    rollout = config.actor_rollout_ref.rollout
    if rollout.mode == "async":
        # Each rank serves many concurrent generate_tokens calls (agent loops), batched by its server.
        # A threaded actor runs calls on many threads, and glibc gives each its own malloc arena: in a SmolLM2
        # agent run the workers grew past 11 GiB and were OOM-killed at step 4; with 2 arenas the same run
        # peaked at 7.6 GiB and went on.
        classes["actor_rollout"].update_options({
            "max_concurrency": rollout.agent.max_concurrent_requests_per_replica,
            "runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "2"}},
        })
    processes = WorkerProcesses(config.trainer, create_colocated_worker_cls(classes), name_prefix="hybridflow")
    groups = processes.group.spawn(list(classes))
    for role in ("critic", "rm", "actor_rollout"):
        if role in groups:
            groups[role].init_model()
    return WorkerGroups(
        actor_rollout=groups["actor_rollout"], critic=groups.get("critic"), processes=processes,
        reward_model=groups.get("rm"),
    )


def build_generator(config: PPOConfig, actor_rollout: Any, tokenizer: Any) -> Any:
    """What the trainer calls `generate_sequences` on: the worker group (sync) or the agent-loop manager (async)."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.mode != "async":
        return actor_rollout
    from hybridflow.agents.interactions import load_interactions
    from hybridflow.agents.manager import AgentLoopManager
    from hybridflow.tools.loader import load_tools

    multi_turn = rollout.multi_turn
    tools = load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else {}
    interactions = load_interactions(multi_turn.interaction_config_path) if multi_turn.interaction_config_path else {}
    return AgentLoopManager(
        actor_rollout, rollout, tokenizer, rollout.response_length, tools=tools, interactions=interactions
    )
