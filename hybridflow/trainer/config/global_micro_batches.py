"""verl's old global micro-batch keys (`actor.ppo_micro_batch_size`, `rollout.log_prob_micro_batch_size`, ...),
turned into their per-GPU forms as verl's workers turn them: the global size over the data-parallel ranks of the
role's pool (ranks / (tensor x sequence parallel size)), floored. Done on the composed config before it is typed,
so that keys derived from a per-GPU one (the rollout's log-prob size from the actor's, the critic's from the
actor's) follow it as they follow a per-GPU value given directly."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf


@dataclass(frozen=True)
class GlobalMicroBatch:
    """A global micro-batch key, its per-GPU key, and the keys sizing the role's data-parallel ranks."""

    global_key: str
    per_gpu_key: str
    tp_key: str | None
    sp_key: str | None
    pool: str = "trainer"
    """`trainer` (nnodes x n_gpus_per_node) or `reward_model` (its own pool when enable_resource_pool)."""


_ACTOR, _ROLLOUT, _REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
GLOBAL_MICRO_BATCHES = (
    GlobalMicroBatch(f"{_ACTOR}.ppo_micro_batch_size", f"{_ACTOR}.ppo_micro_batch_size_per_gpu",
                     f"{_ACTOR}.fsdp_config.tensor_parallel_size", f"{_ACTOR}.ulysses_sequence_parallel_size"),
    GlobalMicroBatch(f"{_ROLLOUT}.log_prob_micro_batch_size", f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu",
                     f"{_ACTOR}.fsdp_config.tensor_parallel_size", f"{_ACTOR}.ulysses_sequence_parallel_size"),
    GlobalMicroBatch(f"{_REF}.log_prob_micro_batch_size", f"{_REF}.log_prob_micro_batch_size_per_gpu",
                     f"{_REF}.fsdp_config.tensor_parallel_size", f"{_REF}.ulysses_sequence_parallel_size"),
    GlobalMicroBatch("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu",
                     "critic.model.fsdp_config.tensor_parallel_size", "critic.ulysses_sequence_parallel_size"),
    GlobalMicroBatch("critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu",
                     "critic.model.fsdp_config.tensor_parallel_size", "critic.ulysses_sequence_parallel_size"),
    GlobalMicroBatch("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu",
                     "reward_model.model.fsdp_config.tensor_parallel_size", None, pool="reward_model"),
)


SFT_GLOBAL_MICRO_BATCHES = (
    GlobalMicroBatch("data.micro_batch_size", "data.micro_batch_size_per_gpu", "model.fsdp_config.tensor_parallel_size",
                     "ulysses_sequence_parallel_size"),
)
"""verl's SFT config still lists the global form (`data.micro_batch_size`, "will be deprecated") and its sp2 examples
set it."""


def apply_global_micro_batches(cfg: DictConfig, defaults: dict,
                               entries: tuple[GlobalMicroBatch, ...] = GLOBAL_MICRO_BATCHES,
                               written: frozenset[str] = frozenset()) -> None:
    """Set each given global key's per-GPU key (in place) and clear the global one; ValueError when both are
    given (the per-GPU key written on the command line, or off its default in a YAML file, as verl refuses both)
    or when the global size is smaller than the data-parallel ranks. `defaults`: the schema's nested defaults;
    `entries`: the tree's global keys; `written`: the keys the command line sets."""
    for entry in entries:
        size = OmegaConf.select(cfg, entry.global_key)
        if size is None:
            continue
        per_gpu_node = OmegaConf.select(cfg, entry.per_gpu_key)
        given = per_gpu_node is not None and (  # null: verl's unset
            entry.per_gpu_key in written or per_gpu_node != _lookup(defaults, entry.per_gpu_key))
        if not _is_interpolation(cfg, entry.per_gpu_key) and given:
            raise ValueError(
                f"{entry.global_key}={size} and {entry.per_gpu_key}={per_gpu_node} are both given; verl takes one: "
                f"drop {entry.global_key} (the old global form)"
            )
        ranks = _data_parallel_ranks(cfg, entry)
        per_gpu = int(size) // ranks
        if per_gpu < 1:
            raise ValueError(
                f"{entry.global_key}={size} over {ranks} data-parallel ranks leaves less than one sample per rank; "
                f"give at least {ranks}, or {entry.per_gpu_key} instead"
            )
        OmegaConf.update(cfg, entry.per_gpu_key, per_gpu, force_add=True)
        OmegaConf.update(cfg, entry.global_key, None, force_add=True)


def _data_parallel_ranks(cfg: DictConfig, entry: GlobalMicroBatch) -> int:
    """The role's ranks over its tensor x sequence parallel size."""
    select = lambda key, default=1: OmegaConf.select(cfg, key, default=default) if key else default  # noqa: E731
    if entry.pool == "reward_model" and select("reward_model.enable_resource_pool", False):
        ranks = select("reward_model.nnodes") * select("reward_model.n_gpus_per_node")
    else:
        ranks = select("trainer.nnodes") * select("trainer.n_gpus_per_node")
    return max(ranks // (select(entry.tp_key) * select(entry.sp_key)), 1)


def _is_interpolation(cfg: DictConfig, key: str) -> bool:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key)
    return parent is not None and OmegaConf.is_interpolation(parent, leaf)


def _lookup(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
