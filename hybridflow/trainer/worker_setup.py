"""Build the role worker groups of a run: colocated in one Ray resource pool (or in-process in local mode)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePoolManager,
    create_colocated_worker_cls,
)
from hybridflow.trainer.config import PPOConfig, critic_enabled, uses_reference
from hybridflow.utils.device import device_count
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker
from hybridflow.workers.config import WorkerRuntimeConfig

logger = logging.getLogger(__name__)


@dataclass
class WorkerGroups:
    """The groups the driver calls; `critic` is None when no critic is trained."""

    actor_rollout: Any
    critic: Any | None
    owner: Any  # the fused group (Ray) whose actors host every role
    pool_manager: ResourcePoolManager | None

    def shutdown(self) -> None:
        """Kill the worker processes and release their placement groups."""
        if isinstance(self.owner, RayWorkerGroup):
            self.owner.shutdown()
        if self.pool_manager is not None:
            for pool in self.pool_manager.pools.values():
                pool.release()


def runtime_config(config: PPOConfig, total_training_steps: int) -> WorkerRuntimeConfig:
    """What each worker needs beyond its role config."""
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    threads = config.trainer.num_threads_per_worker
    if threads == 0 and device_count() == 0:
        threads = max(1, (os.cpu_count() or 1) // world)  # share the cores among the CPU workers
    return WorkerRuntimeConfig(
        prompt_length=config.data.max_prompt_length,
        response_length=config.data.max_response_length,
        total_training_steps=total_training_steps,
        seed=config.trainer.seed,
        num_threads=threads,
    )


def build_worker_groups(config: PPOConfig, total_training_steps: int) -> WorkerGroups:
    """Start one process per rank hosting actor+rollout(+ref)(+critic), and split it into role groups."""
    runtime = runtime_config(config, total_training_steps)
    role = "actor_rollout_ref" if uses_reference(config) else "actor_rollout"
    classes = {"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, config.actor_rollout_ref, role, runtime)}
    if critic_enabled(config):
        classes["critic"] = RayClassWithInitArgs(CriticWorker, config.critic, config.actor_rollout_ref.rollout.n, runtime)
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
    fused = create_colocated_worker_cls(classes)
    if config.trainer.local_mode:
        owner = LocalWorkerGroup(fused, world_size=1)
        manager = None
    else:
        use_gpu = device_count() > 0 and config.trainer.device != "cpu"
        manager = ResourcePoolManager(
            {"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes},
            {"actor_rollout": "global_pool", "critic": "global_pool"},
            use_gpu=use_gpu,
        )
        owner = RayWorkerGroup(manager.get_resource_pool("actor_rollout"), fused, name_prefix="hybridflow")
    groups = owner.spawn(list(classes))
    critic = groups.get("critic")
    if critic is not None:
        critic.init_model()
    groups["actor_rollout"].init_model()
    return WorkerGroups(actor_rollout=groups["actor_rollout"], critic=critic, owner=owner, pool_manager=manager)


PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
"""The tensors a rollout reads; the trainer pops them from the batch and takes the rollout's versions."""


def rollout_inputs(batch: DataProto, config: PPOConfig) -> DataProto:
    """The part of `batch` the generator reads: prompt tensors; agent loops also get every row field."""
    keep_rows = config.actor_rollout_ref.rollout.mode == "async"
    return batch.select(batch_keys=list(PROMPT_KEYS), non_tensor_batch_keys=None if keep_rows else [], meta_info_keys=[])


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
        actor_rollout, rollout, tokenizer, config.data.max_response_length, tools=tools, interactions=interactions
    )
