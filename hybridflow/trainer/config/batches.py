"""verl's batch-size arithmetic, checked and derived: prompts vs samples, global vs per-rank, in one table that
`--dry-run` prints (`BatchSizes.table`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.trainer.config.schema import PPOConfig

__all__ = ["BatchSizes", "derive_batch_sizes"]


@dataclass(frozen=True)
class BatchSizes:
    """verl's batch-size arithmetic for one update (actor or critic), in samples unless named prompts."""

    world_size: int
    prompts_per_step: int
    samples_per_step: int
    mini_batch_prompts: int
    mini_batch_samples: int
    mini_batch_samples_per_rank: int
    micro_batch_per_rank: int
    grad_accum_steps: int
    optimizer_steps_per_step: int
    token_budget: int | None = None
    """Tokens per micro-batch with use_dynamic_bsz (then micro-batches are cut by tokens, not rows)."""
    group_size: int = 1
    """Tensor x sequence parallel ranks sharing each data shard; `world_size` counts the data-parallel groups."""

    def table(self, name: str) -> str:
        """The numbers as aligned text lines."""
        rows = [
            ("ranks (nnodes x n_gpus_per_node)", self.world_size * self.group_size),
            *([("data-parallel groups (ranks / tp x sp)", self.world_size)] if self.group_size > 1 else []),
            ("prompts per step (data.train_batch_size)", self.prompts_per_step),
            ("samples per step (x rollout.n)", self.samples_per_step),
            ("mini-batch prompts (ppo_mini_batch_size)", self.mini_batch_prompts),
            ("mini-batch samples (x rollout.n)", self.mini_batch_samples),
            ("mini-batch samples per rank", self.mini_batch_samples_per_rank),
            *(
                [("micro-batches (use_dynamic_bsz): tokens each, at most about", self.token_budget),
                 ("gradient accumulation steps", "as many as the fullest rank's tokens need")]
                if self.token_budget is not None
                else [("micro-batch per rank (ppo_micro_batch_size_per_gpu)", self.micro_batch_per_rank),
                      ("gradient accumulation steps", self.grad_accum_steps)]
            ),
            ("optimizer steps per training step (x ppo_epochs)", self.optimizer_steps_per_step),
        ]
        width = max(len(label) for label, _ in rows)
        return "\n".join([f"[{name}]"] + [f"  {label:<{width}}  {value}" for label, value in rows])


def derive_batch_sizes(
    cfg: PPOConfig, prefix: str, mini_batch: int, micro_batch: int | None, epochs: int, token_budget: int | None = None,
    group_size: int = 1,
) -> BatchSizes:
    """Check and derive the batch numbers of one updated model (`prefix` names its config keys); with a token
    budget (use_dynamic_bsz) micro-batches are cut by tokens and the row micro-batch size is not used.
    `group_size` ranks (tensor x sequence parallel) share each data shard, so the data splits over
    ranks / group_size data-parallel groups."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // group_size
    prompts = cfg.data.train_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    if mini_batch > prompts:
        raise ValueError(
            f"{prefix}.ppo_mini_batch_size={mini_batch} is larger than data.train_batch_size={prompts}; "
            f"set it to a divisor of {prompts}"
        )
    if prompts % mini_batch:
        raise ValueError(
            f"data.train_batch_size={prompts} is not divisible by {prefix}.ppo_mini_batch_size={mini_batch}; "
            f"use a divisor of {prompts} such as {_largest_divisor_at_most(prompts, mini_batch)}"
        )
    mini_samples = mini_batch * n
    if mini_samples % world:
        raise ValueError(
            f"{prefix}.ppo_mini_batch_size={mini_batch} x rollout.n={n} = {mini_samples} samples cannot be split "
            f"over {world} ranks ({_ranks_phrase(group_size)}); make it a multiple of {world}"
        )
    per_rank = mini_samples // world
    if token_budget is None and per_rank % micro_batch:
        raise ValueError(
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro_batch} does not divide the {per_rank} mini-batch samples "
            f"per rank ({mini_batch} prompts x n={n} / {world} ranks); use a divisor of {per_rank} such as "
            f"{_largest_divisor_at_most(per_rank, micro_batch)}"
        )
    return BatchSizes(
        world_size=world,
        prompts_per_step=prompts,
        samples_per_step=prompts * n,
        mini_batch_prompts=mini_batch,
        mini_batch_samples=mini_samples,
        mini_batch_samples_per_rank=per_rank,
        micro_batch_per_rank=micro_batch or 0,  # 0: not set (token budgets cut the micro-batches)
        grad_accum_steps=per_rank // micro_batch if token_budget is None else 0,
        optimizer_steps_per_step=(prompts // mini_batch) * epochs,
        token_budget=token_budget,
        group_size=group_size,
    )


def _ranks_phrase(group_size: int) -> str:
    if group_size == 1:
        return "trainer.nnodes x trainer.n_gpus_per_node"
    return f"data-parallel: trainer.nnodes x trainer.n_gpus_per_node / {group_size} tensor/sequence-parallel peers"


def _largest_divisor_at_most(number: int, limit: int) -> int:
    return max(d for d in range(1, min(number, limit) + 1) if number % d == 0)
