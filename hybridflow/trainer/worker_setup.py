"""Build the role worker groups of an RL run from its placement: one process per rank of each resource pool hosts
that pool's roles (colocated: all of them, in Ray or in the driver), and, under split placement, the weight sync
from the trainer pool to the rollout pool."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from hybridflow.single_controller import CONTROL_GROUP
from hybridflow.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls
from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.placement import ROLLOUT_POOL, build_pool_manager, describe_placement
from hybridflow.trainer.scaffold import WorkerProcesses, use_accelerator, worker_runtime
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, PrimeRewardModelWorker, RewardModelWorker
from hybridflow.workers.generative_reward import SERVER_CONCURRENCY, GenerativeRewardWorker
from hybridflow.workers.config import WorkerRuntimeConfig

logger = logging.getLogger(__name__)


def run_together(*calls: Callable[[], Any]) -> list[Any]:
    """Run blocking group calls at once (a collective spanning several groups needs all of them running); their
    results in order. The first failure raises at once; the calls still waiting end when the workers are shut down."""
    executor = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="hybridflow-group-call")
    futures = [executor.submit(call) for call in calls]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    executor.shutdown(wait=False)
    for future in futures:
        if future in done and future.exception() is not None:
            raise future.exception()
    return [future.result() for future in futures]


class RolloutWeightSync:
    """Split placement's weight sync, driver side: the trainer pool's rank 0 broadcasts the actor's weights, one
    tensor at a time, to every rank of the rollout pool over a process group spanning both (`workers.weight_sync`)."""

    def __init__(self, actor: Any, rollout: Any) -> None:
        self.actor, self.rollout = actor, rollout
        info = actor.weight_sync_info()[0]
        address, port = actor.weight_sync_address()
        world_size = 1 + rollout.world_size
        run_together(
            lambda: actor.init_weight_sync_group(address, port, world_size, info),
            lambda: rollout.init_weight_sync_group(address, port, world_size, info),
        )
        self.num_tensors = len(info)

    def sync(self) -> dict[str, float]:
        """Send the actor's current weights to the rollout pool; the sync's size and policy version."""
        sent, received = run_together(self.actor.send_rollout_weights, self.rollout.receive_rollout_weights)
        return {
            "sync_rollout_weights/size_mb": sent[0]["bytes"] / 1e6,
            "sync_rollout_weights/num_buckets": sent[0]["buckets"],
            "sync_rollout_weights/policy_version": received[0]["policy_version"],
        }


@dataclass
class WorkerGroups:
    """The groups the driver calls; `critic` / `reward_model` are None when the run has no such role, `rollout`
    and `weight_sync` when the rollout shares the actor's processes (colocated)."""

    actor_rollout: Any
    """The actor's group (log-probs, reference, update, checkpoints); colocated, it also generates."""
    critic: Any | None
    processes: list[WorkerProcesses] = field(default_factory=list)
    reward_model: Any | None = None
    rollout: Any | None = None
    """Split placement: the rollout pool's group."""
    weight_sync: RolloutWeightSync | None = None

    @property
    def generation(self) -> Any:
        """The group that generates: the rollout pool's (split) or the actor's (colocated)."""
        return self.rollout if self.rollout is not None else self.actor_rollout

    def sync_rollout_weights(self) -> dict[str, float]:
        """Split placement: hand the actor's current weights to the rollout pool (colocated: nothing to do, the
        rollout reads them in its own process before generating)."""
        return self.weight_sync.sync() if self.weight_sync is not None else {}

    def processes_besides_rollout(self) -> list[WorkerProcesses]:
        """Every pool's processes but the split rollout pool's (all of them when colocated)."""
        return [processes for processes in self.processes if not processes.name.endswith(ROLLOUT_POOL)]

    def shutdown(self) -> None:
        """Kill the worker processes and release their placement groups."""
        for processes in self.processes:
            processes.shutdown()


def role_classes(config: PPOConfig, roles: list[str], runtime: WorkerRuntimeConfig) -> dict[str, RayClassWithInitArgs]:
    """The workers one process of a pool hosts for `roles`: `actor_rollout` (actor with rollout and/or ref) or
    `rollout` (alone), `critic`, `rm`."""
    classes = {}
    worker_roles = [role for role in ("actor", "rollout", "ref") if role in roles]
    if worker_roles:
        assert "actor" in worker_roles or worker_roles == ["rollout"], worker_roles
        key = "actor_rollout" if "actor" in worker_roles else "rollout"
        classes[key] = RayClassWithInitArgs(ActorRolloutRefWorker, config.actor_rollout_ref, "_".join(worker_roles), runtime)
        rollout = config.actor_rollout_ref.rollout
        if "rollout" in worker_roles and rollout.mode == "async":
            # Each rank serves many concurrent generate_tokens calls (agent loops), batched by its server.
            # A threaded actor runs calls on many threads, and glibc gives each its own malloc arena: in a SmolLM2
            # agent run the workers grew past 11 GiB and were OOM-killed at step 4; with 2 arenas the same run
            # peaked at 7.6 GiB and went on.
            classes[key].update_options({
                "max_concurrency": rollout.agent.max_concurrent_requests_per_replica,
                "concurrency_groups": {CONTROL_GROUP: 1},  # aborts (over_sample_rate) never wait behind requests
                "runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "2"}},
            })
    if "critic" in roles:
        classes["critic"] = RayClassWithInitArgs(CriticWorker, config.critic, config.actor_rollout_ref.rollout.n, runtime)
    if "reward_model" in roles and config.generative_reward_model:  # a judge the reward function asks over HTTP
        classes["rm"] = RayClassWithInitArgs(GenerativeRewardWorker, config.reward_model, runtime)
        classes["rm"].update_options({"max_concurrency": SERVER_CONCURRENCY})
    elif "reward_model" in roles:  # PRIME's reward model is an implicit PRM, trained online
        rm_cls = PrimeRewardModelWorker if config.estimator.implicit_prm else RewardModelWorker
        classes["rm"] = RayClassWithInitArgs(rm_cls, config.reward_model, runtime)
    return classes


def build_worker_groups(config: PPOConfig, total_training_steps: int) -> WorkerGroups:
    """Start each pool's processes (one per rank, hosting the pool's roles), load the models, and connect the
    rollout pool to the trainer pool when split."""
    manager = build_pool_manager(config, use_gpu=use_accelerator(config.trainer))
    logger.info("%s", describe_placement(config))
    num_processes = sum(sum(counts) for counts in manager.resource_pool_spec.values())
    runtime = worker_runtime(config.trainer, total_training_steps, num_processes, config.actor_rollout_ref.nccl_timeout)
    groups, processes = {}, []
    try:
        for pool_name, roles in manager.roles_by_pool().items():
            classes = role_classes(config, roles, runtime)
            pool = None if config.trainer.local_mode else manager.get_resource_pool(roles[0])
            try:
                processes.append(WorkerProcesses(
                    config.trainer, create_colocated_worker_cls(classes), name_prefix=f"hybridflow_{pool_name}",
                    pool=pool, roles=roles,
                ))
            except BaseException:
                if pool is not None:
                    pool.release()
                raise
            groups.update(processes[-1].group.spawn(list(classes)))
        for role in ("critic", "rm", "actor_rollout", "rollout"):
            if role in groups:
                groups[role].init_model()
        workers = WorkerGroups(
            actor_rollout=groups["actor_rollout"], critic=groups.get("critic"), processes=processes,
            reward_model=groups.get("rm"), rollout=groups.get("rollout"),
        )
        if workers.rollout is not None:
            workers.weight_sync = RolloutWeightSync(workers.actor_rollout, workers.rollout)
            workers.sync_rollout_weights()  # the actor's initial weights (e.g. a LoRA adapter it loaded) to the rollout
        return workers
    except BaseException:  # a pool that could not start, or a model that could not load: free what was started
        for started in processes:
            started.shutdown()
        raise


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
