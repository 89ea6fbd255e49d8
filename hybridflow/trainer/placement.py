"""Placement of an RL run's roles on resource pools (HybridFlow's flexible device mapping), read from the config.

Roles: actor, rollout, ref, critic, reward_model. Pools carry verl's names:

    colocated (default, actor_rollout_ref.hybrid_engine=True)
      global_pool   trainer.nnodes x trainer.n_gpus_per_node   actor rollout ref critic reward_model
    split (actor_rollout_ref.hybrid_engine=False; verl's one-step-off-policy keys)
      trainer_pool  trainer.nnodes x trainer.n_gpus_per_node   actor ref critic reward_model
      rollout_pool  rollout.nnodes x rollout.n_gpus_per_node   rollout

    reward_model.enable_resource_pool=True (either placement)
      reward_pool   reward_model.nnodes x reward_model.n_gpus_per_node   reward_model

The roles of one pool share its processes: one process per rank hosts all of them (`create_colocated_worker_cls`).
Under split placement the rollout pool receives the actor's weights after each update (`worker_setup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.trainer.config.async_schema import RolloutPoolConfig
from hybridflow.trainer.config.schema import PPOConfig

if TYPE_CHECKING:  # the Ray controller imports torch: the config checks here must not wait for it
    from hybridflow.single_controller.ray.resource_pool_manager import ResourcePoolManager

TRAINER_ROLES = ("actor", "ref", "critic", "reward_model")
"""Roles placed with the actor, in this order."""

ROLLOUT_POOL = "rollout_pool"
"""The split rollout pool's name (its processes are named `hybridflow_rollout_pool`)."""

REWARD_POOL = "reward_pool"
"""The reward model's own pool (`reward_model.enable_resource_pool`)."""


def is_split(cfg: PPOConfig) -> bool:
    """Whether the rollout has its own pool (verl: `actor_rollout_ref.hybrid_engine=False`)."""
    return not cfg.actor_rollout_ref.hybrid_engine


def run_roles(cfg: PPOConfig) -> list[str]:
    """The roles this run has: actor and rollout always, the others when the config uses them."""

    used = {"ref": cfg.uses_reference, "critic": cfg.critic_enabled, "reward_model": cfg.reward_model.enable}
    return ["actor", "rollout", *(role for role in TRAINER_ROLES[1:] if used[role])]


def build_pool_manager(cfg: PPOConfig, use_gpu: bool = False) -> ResourcePoolManager:
    """The run's pools (name -> processes per node) and which pool hosts each role."""
    from hybridflow.single_controller.ray.resource_pool_manager import ResourcePoolManager

    trainer = [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes
    roles = run_roles(cfg)
    if not is_split(cfg):
        spec, mapping = {"global_pool": trainer}, dict.fromkeys(roles, "global_pool")
    else:
        mapping = {role: "trainer_pool" for role in roles if role != "rollout"}
        mapping["rollout"] = ROLLOUT_POOL
        spec = {"trainer_pool": trainer, ROLLOUT_POOL: [cfg.rollout.n_gpus_per_node] * cfg.rollout.nnodes}
    rm = cfg.reward_model
    if rm.enable_resource_pool:
        spec[REWARD_POOL] = [rm.n_gpus_per_node] * rm.nnodes
        mapping["reward_model"] = REWARD_POOL
    return ResourcePoolManager(spec, mapping, use_gpu=use_gpu)


def num_worker_processes(cfg: PPOConfig) -> int:
    """Worker processes of the run, all pools together."""
    return sum(sum(counts) for counts in build_pool_manager(cfg).resource_pool_spec.values())


def check_placement(cfg: PPOConfig) -> None:
    """Split placement runs on Ray; the rollout pool's keys are used only by split placement."""
    if cfg.reward_model.enable_resource_pool and cfg.trainer.local_mode:
        raise ValueError(
            "reward_model.enable_resource_pool=True puts the reward model on its own pool of Ray workers, but "
            "trainer.local_mode=True runs one worker in the driver; set trainer.local_mode=False or "
            "reward_model.enable_resource_pool=False"
        )
    if not is_split(cfg):
        if cfg.rollout != RolloutPoolConfig():
            raise ValueError(
                f"rollout.nnodes={cfg.rollout.nnodes} rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node} size the "
                "rollout's own pool, but actor_rollout_ref.hybrid_engine=True colocates the rollout with the actor; "
                "set actor_rollout_ref.hybrid_engine=False for split placement or drop the rollout.* keys"
            )
        return
    if cfg.trainer.local_mode:
        raise ValueError(
            "actor_rollout_ref.hybrid_engine=False puts the rollout on its own pool of Ray workers, but "
            "trainer.local_mode=True runs one worker in the driver; set trainer.local_mode=False or hybrid_engine=True"
        )


def describe_placement(cfg: PPOConfig) -> str:
    """The placement as aligned text lines: each pool, its processes and its roles, and for a pool on several
    nodes the ranks of each node (`--dry-run`, run log)."""
    manager = build_pool_manager(cfg)
    if is_split(cfg):
        title = "[placement] split: the rollout has its own pool and gets the actor's weights after each update"
    else:
        title = "[placement] colocated: every role shares each process of one pool"
    rows = []
    for name, roles in manager.roles_by_pool().items():
        counts = manager.resource_pool_spec[name]
        size = f"{sum(counts)} processes ({len(counts)} node{'s' if len(counts) > 1 else ''} x {counts[0]})"
        rows.append((name, size, ", ".join(roles)))
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    lines = [title]
    for name, size, roles in rows:
        lines.append(f"  {name:<{widths[0]}}  {size:<{widths[1]}}  {roles}")
        lines += _node_lines(manager.resource_pool_spec[name])
    num_nodes = max(len(counts) for counts in manager.resource_pool_spec.values())
    if num_nodes > 1:
        lines.append(
            f"  each node of a pool is a distinct Ray node (one placement group, STRICT_SPREAD; pools may share "
            f"nodes): the cluster needs {num_nodes} nodes, joined with RAY_ADDRESS or ray_kwargs.ray_init.address"
        )
    return "\n".join(lines)


def _node_lines(process_on_nodes: list[int]) -> list[str]:
    """`node i: ranks a-b` for each node of a multi-node pool; nothing for one node."""
    from hybridflow.single_controller.ray.base import node_ranks

    if len(process_on_nodes) == 1:
        return []
    spans = [f"ranks {r[0]}-{r[-1]}" if len(r) > 1 else f"rank {r[0]}" for r in node_ranks(process_on_nodes)]
    return [f"    node {node}: {span}" for node, span in enumerate(spans)]
