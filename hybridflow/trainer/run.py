"""Assemble and run a PPO/GRPO job from a checked `PPOConfig`: Ray, data, rewards, tracking, trainer."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from hybridflow import env
from hybridflow.data import RLHFDataset, RLHFDatasetConfig, build_sampler, collate_fn
from hybridflow.models import MODEL_CATALOGUE, catalogue_tokenizer_path, load_tokenizer, resolve_model_path
from hybridflow.rewards import OverlongBufferConfig, ScoringConfig, get_reward_manager_cls, load_custom_reward_fn
from hybridflow.trainer.config import BatchSizes, PPOConfig
from hybridflow.trainer.plot import plot_run
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.tracking import Tracking

logger = logging.getLogger(__name__)


def build_tokenizer(config: PPOConfig) -> Any:
    """The driver's tokenizer (catalogue models: tokenizer only, without converting the weights here)."""
    model = config.actor_rollout_ref.model
    location = model.tokenizer_path or model.path
    if location in MODEL_CATALOGUE:
        return load_tokenizer(catalogue_tokenizer_path(location))
    return load_tokenizer(resolve_model_path(location))


def build_dataloaders(config: PPOConfig, tokenizer: Any) -> tuple[DataLoader, DataLoader | None]:
    """Training loader (seeded, resumable sampler, full batches only) and validation loader."""
    data = config.data
    dataset_config = RLHFDatasetConfig(
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        return_raw_chat=data.return_raw_chat,
        apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs),
    )
    train_set = RLHFDataset(list(data.train_files), tokenizer, dataset_config)
    if len(train_set) < data.train_batch_size:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} is larger than the {len(train_set)} usable training "
            "prompts; lower it or add data"
        )
    train_loader = DataLoader(
        train_set,
        batch_size=data.train_batch_size,
        sampler=build_sampler(train_set, shuffle=data.shuffle, seed=data.seed),
        collate_fn=collate_fn,
        drop_last=True,
        num_workers=0,  # keeps the sampler position exact for resume
    )
    if not data.val_files:
        return train_loader, None
    val_set = RLHFDataset(list(data.val_files), tokenizer, dataset_config)
    val_loader = DataLoader(
        val_set, batch_size=data.val_batch_size or len(val_set), shuffle=False, collate_fn=collate_fn, num_workers=0
    )
    return train_loader, val_loader


def build_reward_manager(config: PPOConfig, tokenizer: Any, num_examine: int) -> Any:
    """The reward manager named by `reward_model.reward_manager`, with the custom function if one is set."""
    reward_cfg = config.reward_model
    custom = config.custom_reward_function
    compute_score = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    kwargs: dict[str, Any] = {"scoring": ScoringConfig(timeout_s=reward_cfg.timeout_s)}
    if reward_cfg.reward_manager == "dapo":
        buffer = reward_cfg.overlong_buffer
        kwargs["max_resp_len"] = config.data.max_response_length
        kwargs["overlong_buffer_cfg"] = OverlongBufferConfig(
            enable=buffer.enable, len=buffer.len, penalty_factor=buffer.penalty_factor
        )
    manager_cls = get_reward_manager_cls(reward_cfg.reward_manager)
    return manager_cls(tokenizer, num_examine=num_examine, compute_score=compute_score, **kwargs)


def init_ray(config: PPOConfig) -> None:
    """Join `ray_init.address` / RAY_ADDRESS, or start the embedded cluster sized for the workers."""
    import ray

    if ray.is_initialized():
        return
    address = config.ray_init.address or env.ray_address()
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    num_cpus = config.ray_init.num_cpus or max(os.cpu_count() or 1, world)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def run_ppo(config: PPOConfig, batch_sizes: dict[str, BatchSizes]) -> dict[str, float]:
    """Run the job; returns the final validation metrics. Workers are shut down however it ends."""
    for name, sizes in batch_sizes.items():
        logger.info("batch arithmetic\n%s", sizes.table(name))
    tokenizer = build_tokenizer(config)
    train_loader, val_loader = build_dataloaders(config, tokenizer)
    reward_fn = build_reward_manager(config, tokenizer, num_examine=0)
    val_reward_fn = build_reward_manager(config, tokenizer, num_examine=0)
    run_dir = Path(config.trainer.default_local_dir)
    tracking = Tracking(
        list(config.trainer.logger), run_dir, config.trainer.project_name, config.trainer.experiment_name, asdict(config)
    )
    if not config.trainer.local_mode:
        init_ray(config)
    trainer = RayPPOTrainer(config, train_loader, val_loader, reward_fn, val_reward_fn, tracking)
    try:
        trainer.init_workers()
        final_val_metrics = trainer.fit()
        logger.info("%s", summarize_validation(trainer.initial_val_metrics, final_val_metrics))
        return final_val_metrics
    finally:
        if trainer.workers is not None:
            trainer.workers.shutdown()
        reward_fn.close()
        val_reward_fn.close()
        tracking.finish()
        if "file" in config.trainer.logger:
            for path in plot_run(run_dir):
                logger.info("wrote %s", path)


def summarize_validation(before: dict[str, float], after: dict[str, float]) -> str:
    """A small table of the core validation metrics before and after training."""
    keys = sorted(key for key in {*before, *after} if key.startswith("val-core/"))
    if not keys:
        return "no validation metrics (set data.val_files)"
    width = max(len(key) for key in keys)
    lines = [f"{'validation metric':<{width}}  before   after"]
    for key in keys:
        old = f"{before[key]:.4f}" if key in before else "   -  "
        new = f"{after[key]:.4f}" if key in after else "   -  "
        lines.append(f"{key:<{width}}  {old}  {new}")
    return "\n".join(lines)
