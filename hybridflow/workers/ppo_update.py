"""PPO update loops of the actor and the critic on one rank: mini-batches, micro-batches, losses, metrics.

Losses are normalised by counts over the whole mini-batch on all ranks (`agg_loss` with global counts),
so the gradient does not depend on the micro-batch size or the number of data-parallel ranks.

The loss functions run once per micro-batch and never read a value back to the host: their metrics are detached
device tensors that the engine reduces once per mini-batch (issue 25: a host synchronisation per micro-batch
keeps an accelerator idle while the host waits).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridflow.algorithms import agg_loss, compute_rollout_probs_diff, compute_value_loss, kl_penalty, masked_mean
from hybridflow.algorithms.config import RolloutCorrectionConfig
from hybridflow.algorithms.policy_loss_registry import compute_policy_loss_from_config
from hybridflow.algorithms.rollout_correction import compute_bypass_correction
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorConfig, CriticConfig

BYPASS_CORRECTION_KEY = "bypass_rollout_correction"
"""meta_info key of `update_actor`'s batch: the rollout correction (a dict of `RolloutCorrectionConfig`) that the
actor's loss applies in bypass mode."""


Metrics = dict[str, "float | torch.Tensor"]  # floats, or detached 0-dim device tensors the engine reduces


@dataclass(frozen=True)
class GlobalCounts:
    """Valid tokens and non-empty sequences of one mini-batch summed over all data-parallel ranks."""

    num_tokens: float
    num_seqs: float
    dp_size: int


def compute_global_counts(response_mask: torch.Tensor, device: torch.device | None = None) -> GlobalCounts:
    """Sum this rank's counts over the process group (collective when one exists), on `device` (the engine's:
    an nccl group reduces GPU tensors)."""
    counts = torch.tensor(
        [float(response_mask.sum()), float((response_mask.sum(-1) > 0).sum())], dtype=torch.float64, device=device
    )
    dp_size = 1
    if dist.is_available() and dist.is_initialized():
        dp_size = dist.get_world_size()
        dist.all_reduce(counts)
    return GlobalCounts(num_tokens=max(counts[0].item(), 1.0), num_seqs=max(counts[1].item(), 1.0), dp_size=dp_size)


@dataclass
class OnPolicyRecord:
    """The update's own log-probs, kept when they serve as the old log-probs (an exactly on-policy step), so the
    gap to the rollout engine's log-probs can still be reported."""

    actor_log_probs: list[torch.Tensor] = field(default_factory=list)
    rollout_log_probs: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)

    def add(self, log_prob: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> None:
        """Keep one micro-batch's detached log-probs with its rollout log-probs (when the rollout sent them), where
        they are (copied to the host in `metrics`, after the update)."""
        if "rollout_log_probs" in batch.keys():
            self.actor_log_probs.append(log_prob.detach())
            self.rollout_log_probs.append(batch["rollout_log_probs"])
            self.masks.append(batch["response_mask"])

    def metrics(self) -> dict[str, float]:
        """`training/rollout_probs_diff_*` over every recorded token (empty when nothing was recorded)."""
        if not self.masks:
            return {}
        return compute_rollout_probs_diff(
            *(torch.cat(tensors).cpu() for tensors in (self.rollout_log_probs, self.actor_log_probs, self.masks))
        )


def make_actor_loss_fn(
    actor: ActorConfig, counts: GlobalCounts, on_policy: OnPolicyRecord | None = None,
    bypass: RolloutCorrectionConfig | None = None,
) -> Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, Metrics]]:
    """`loss_fn(outputs, micro_batch)` for the training engine: policy loss - entropy bonus + KL loss.

    Without `old_log_probs` in the batch the step must be exactly on-policy (the caller checks): the current
    log-probs, detached, are the old ones (ratio 1 in value, the PPO gradient in grad), recorded in `on_policy`.
    With `bypass` (bypass mode, whose old log-probs are the rollout's), the correction compares the current policy
    with the rollout per micro-batch (`bypass_policy_loss`).
    """
    agg = dict(dp_size=counts.dp_size, batch_num_tokens=counts.num_tokens, global_batch_size=counts.num_seqs)

    def loss_fn(outputs: dict[str, torch.Tensor], micro_batch: DataProto) -> tuple[torch.Tensor, Metrics]:
        batch = micro_batch.batch
        mask = batch["response_mask"].to(outputs["log_probs"].device).float()
        log_prob = outputs["log_probs"]
        if "old_log_probs" in batch.keys():
            old_log_prob = batch["old_log_probs"].to(log_prob.device)
        else:
            old_log_prob = log_prob.detach()
            if on_policy is not None:
                on_policy.add(log_prob, batch)
        advantages = batch["advantages"].to(log_prob.device)
        if bypass is not None:
            pg_loss, metrics = bypass_policy_loss(actor, bypass, old_log_prob, log_prob, advantages, mask, agg)
        else:
            pg_loss, metrics = compute_policy_loss_from_config(
                actor,
                old_log_prob=old_log_prob,
                log_prob=log_prob,
                advantages=advantages,
                response_mask=mask,
                rollout_is_weights=batch["rollout_is_weights"] if "rollout_is_weights" in batch.keys() else None,
                **agg,
            )
        loss = pg_loss
        metrics = {**metrics, "actor/pg_loss": pg_loss.detach()}
        if "entropy" in outputs:
            entropy = agg_loss(outputs["entropy"], mask, actor.loss_agg_mode, **agg)
            loss = loss - actor.entropy_coeff * entropy
            metrics["actor/entropy"] = masked_mean(outputs["entropy"].detach(), mask)
        if actor.use_kl_loss:
            kl = kl_penalty(log_prob, batch["ref_log_prob"].to(log_prob.device), actor.kl_loss_type)
            kl_loss = agg_loss(kl, mask, actor.loss_agg_mode, **agg)
            loss = loss + actor.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
            metrics["actor/kl_coef"] = actor.kl_loss_coef
        return loss, metrics

    return loss_fn


def bypass_policy_loss(
    actor: ActorConfig, correction: RolloutCorrectionConfig, rollout_log_prob: torch.Tensor, log_prob: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, agg: dict,
) -> tuple[torch.Tensor, Metrics]:
    """verl's bypass-mode policy loss: (loss, metrics). The rollout's log-probs are the old ones; rollout_rs drops
    tokens from the policy loss only (entropy and KL see every token, as in verl); reinforce is -A * w * log pi with
    w the truncated, detached pi_current / pi_rollout (1 without rollout_is), ppo_clip the configured clipped loss
    against the rollout (the weights are only measured: its ratio is the correction)."""
    weights, mask, metrics = compute_bypass_correction(
        log_prob.detach(), rollout_log_prob, mask, **correction.math_kwargs
    )
    if correction.loss_type == "reinforce":
        per_token = -advantages * log_prob * (weights if weights is not None else 1.0)
        loss = agg_loss(per_token, mask, actor.loss_agg_mode, **agg)
        return loss, {**metrics, "actor/ppo_kl": masked_mean(rollout_log_prob - log_prob.detach(), mask)}
    loss, pg_metrics = compute_policy_loss_from_config(
        actor, old_log_prob=rollout_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask, **agg
    )
    return loss, {**pg_metrics, **metrics}


def make_critic_loss_fn(
    critic: CriticConfig, counts: GlobalCounts
) -> Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, Metrics]]:
    """`loss_fn(outputs, micro_batch)` for the critic: clipped value loss against the returns."""

    def loss_fn(outputs: dict[str, torch.Tensor], micro_batch: DataProto) -> tuple[torch.Tensor, Metrics]:
        batch = micro_batch.batch
        vpreds = outputs["values"]
        mask = batch["response_mask"].to(vpreds.device).float()
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            batch["returns"].to(vpreds.device),
            batch["values"].to(vpreds.device),
            mask,
            critic.cliprange_value,
            critic.loss_agg_mode,
            dp_size=counts.dp_size,
            batch_num_tokens=counts.num_tokens,
            global_batch_size=counts.num_seqs,
        )
        metrics = {
            "critic/vf_loss": vf_loss.detach(),
            "critic/vf_clipfrac": vf_clipfrac.detach(),
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask),
        }
        return vf_loss, metrics

    return loss_fn


SUMMED_METRICS = frozenset({"actor/pg_loss", "critic/vf_loss"})
"""Loss metrics that are each micro-batch's share of the mini-batch's loss (the losses are normalised by the
mini-batch's global counts): the engine sums them over micro-batches, so they do not change with the micro-batch
size (verl sums its pg_loss the same way)."""


def iterate_mini_batches(data: DataProto, mini_batch_size: int, epochs: int, shuffle: bool, seed: int):
    """This rank's mini-batches for `epochs` passes (seeded shuffle between passes when asked)."""
    size = min(mini_batch_size, len(data))
    return data.make_iterator(size, epochs=epochs, seed=seed, dataloader_kwargs={"shuffle": shuffle})


def run_update(
    engine,
    data: DataProto,
    *,
    mini_batch_size_per_rank: int,
    micro_batch_size: int | None,
    max_token_len: int | None = None,
    epochs: int,
    shuffle: bool,
    seed: int,
    make_loss_fn: Callable[[GlobalCounts], Callable],
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    metric_prefix: str,
) -> dict[str, list[float]]:
    """Optimizer steps over `data` (this rank's shard); returns per-step metric lists (verl's reporting)."""
    metrics: dict[str, list[float]] = defaultdict(list)
    for mini_batch in iterate_mini_batches(data, mini_batch_size_per_rank, epochs, shuffle, seed):
        counts = compute_global_counts(mini_batch.batch["response_mask"], engine.device)
        step = engine.train_batch(
            engine.split_micro_batches(mini_batch, micro_batch_size, max_token_len)[0],
            make_loss_fn(counts),
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            scale_by_rows=False,
            summed_metrics=SUMMED_METRICS,
        )
        for key, value in step.items():
            # The engine's own keys (`grad_norm`) and an MoE's router metrics (`moe/...`) belong to the updated
            # model: `actor/moe/...` and `critic/moe/...` stay apart.
            name = key if "/" in key and not key.startswith("moe/") else f"{metric_prefix}/{key}"
            metrics[name].append(float(value))
    return dict(metrics)


def update_computes_entropy(actor: ActorConfig, takes_old_log_probs_from_update: bool) -> bool:
    """Whether the actor's update forwards compute the policy's entropy: for the entropy bonus (entropy_coeff),
    when asked (verl's actor.calculate_entropy), and when the update's forward also stands in for the
    old-log-prob pass (the only place entropy is measured then)."""
    return actor.entropy_coeff != 0 or actor.calculate_entropy or takes_old_log_probs_from_update


def mean_metrics(metrics: Mapping[str, list[float]]) -> dict[str, float]:
    """Average each metric list (for logging one number per key)."""
    return {key: sum(values) / len(values) for key, values in metrics.items() if values}
