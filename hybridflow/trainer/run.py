"""Assemble and run a PPO/GRPO job from a checked `PPOConfig`: Ray, data, rewards, tracking, trainer."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch.utils.data import DataLoader

from hybridflow.algorithms.validation_metrics import interval_keys
from hybridflow.data import RLHFDataset, collate_fn
from hybridflow.data.config import RLHFDataConfig
from hybridflow.data.dataset_class import build_custom_dataset, rl_dataset_class
from hybridflow.rewards import get_reward_manager_cls, load_custom_reward_fn
from hybridflow.rewards.config import CustomRewardFunctionConfig, RewardModelConfig
from hybridflow.trainer.config import BatchSizes, PPOConfig
from hybridflow.trainer.config.resume_checks import check_resumed_data_order
from hybridflow.trainer.generative_judge import GenerativeJudge, JudgedRewardManager
from hybridflow.trainer.placement import num_worker_processes
from hybridflow.trainer.plot import plot_run
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.scaffold import (
    build_processor,
    build_tokenizer,
    build_tracking,
    build_train_loader,
    build_val_loader,
    init_ray,
    run_dir,
    write_ray_timeline,
)

logger = logging.getLogger(__name__)


def build_dataloaders(
    data: RLHFDataConfig, tokenizer: Any, processor: Any = None
) -> tuple[DataLoader, DataLoader | None]:
    """Training loader of generation batches (seeded, resumable sampler, full batches only: `data.gen_batch_size`
    prompts with dynamic sampling, else `train_batch_size`) and validation loader of `data.*`; `processor`: a
    vision-language model's (`build_processor`), which reads the rows' images."""
    dataset_cls = rl_dataset_class(data)  # RLHFDataset, or data.custom_cls
    if dataset_cls is not RLHFDataset:
        logger.info("prompts are read by %s (data.custom_cls)", dataset_cls.__name__)
    if dataset_cls is RLHFDataset:
        train_set = dataset_cls(data_files=data.train_files, tokenizer=tokenizer, config=data,
                                max_samples=data.train_max_samples, processor=processor)
    else:
        train_set = build_custom_dataset(dataset_cls, data.train_files, tokenizer, data, data.train_max_samples,
                                         processor, "data.train_files")
    batch_size = data.gen_batch_size or data.train_batch_size
    sampler = None
    if data.sampler.class_path is not None:
        from hybridflow.data.custom_sampler import build_user_sampler

        sampler = build_user_sampler(train_set, data)
        logger.info("prompts are drawn by %s (data.sampler)", type(sampler.sampler).__name__)
    train_loader = build_train_loader(train_set, batch_size, data.shuffle, data.seed, collate_fn, sampler)
    if not data.val_files:
        return train_loader, None
    if dataset_cls is RLHFDataset:
        val_set = dataset_cls(data_files=data.val_files, tokenizer=tokenizer, config=data,
                              max_samples=data.val_max_samples, processor=processor)
    else:
        val_set = build_custom_dataset(dataset_cls, data.val_files, tokenizer, data, data.val_max_samples, processor,
                                       "data.val_files")
    shuffle_seed = train_loader.sampler.seed if data.validation_shuffle else None  # data.seed, or the drawn one
    return train_loader, build_val_loader(val_set, data.val_batch_size, collate_fn, shuffle_seed)


def build_reward_manager(
    reward: RewardModelConfig, custom: CustomRewardFunctionConfig, data: RLHFDataConfig, tokenizer: Any,
    judge: GenerativeJudge | None = None,
) -> Any:
    """The reward manager named by `reward_model.reward_manager`, with the custom function if one is set (asking
    the generative reward model `judge`, when the run serves one)."""
    if judge is not None:
        compute_score = judge.reward_function(custom.path, custom.name, dict(custom.reward_kwargs))
        manager = get_reward_manager_cls(reward.reward_manager).from_config(tokenizer, compute_score, reward, data)
        return JudgedRewardManager(manager, judge)
    compute_score = load_custom_reward_fn(custom.path, custom.name, dict(custom.reward_kwargs)) if custom.path else None
    return get_reward_manager_cls(reward.reward_manager).from_config(tokenizer, compute_score, reward, data)


def run_ppo(
    config: PPOConfig, batch_sizes: dict[str, BatchSizes], trainer_cls: type[RayPPOTrainer] = RayPPOTrainer
) -> dict[str, float]:
    """Run the job with `trainer_cls`; returns the final validation metrics. Workers are shut down however it ends."""
    for name, sizes in batch_sizes.items():
        logger.info("batch arithmetic\n%s", sizes.table(name))
    data = config.data
    tokenizer = build_tokenizer(config.actor_rollout_ref.model, data.trust_remote_code)
    if config.reward_model.enable:  # the reward model re-templates conversations from each row's chat messages
        data = dataclasses.replace(data, return_raw_chat=True)
    processor = build_processor(config.actor_rollout_ref.model, tokenizer, data.trust_remote_code)
    train_loader, val_loader = build_dataloaders(data, tokenizer, processor)
    check_resumed_data_order(config.trainer, train_loader.sampler)
    judge = GenerativeJudge(config) if config.generative_reward_model else None
    reward_fn = build_reward_manager(config.reward_model, config.custom_reward_function, config.data, tokenizer, judge)
    val_reward_fn = build_reward_manager(
        config.reward_model, config.custom_reward_function, config.data, tokenizer, judge
    )
    tracking = build_tracking(config.trainer, config)
    if not config.trainer.local_mode:
        init_ray(config.ray_kwargs.ray_init, num_worker_processes(config))
    trainer = trainer_cls(config, train_loader, val_loader, reward_fn, val_reward_fn, tracking)
    try:
        trainer.init_workers()
        final_val_metrics = trainer.fit()
        logger.info("%s", summarize_validation(trainer.initial_val_metrics, final_val_metrics))
        return final_val_metrics
    finally:
        write_ray_timeline(config.ray_kwargs.timeline_json_file)
        if trainer.workers is not None:
            trainer.workers.shutdown()
        reward_fn.close()
        val_reward_fn.close()
        if judge is not None:
            judge.close()
        tracking.finish()
        if "file" in config.trainer.logger:
            try:  # after a crash too: it must never hide the run's own exception
                for path in plot_run(run_dir(config.trainer)):
                    logger.info("wrote %s", path)
            except Exception as err:  # noqa: BLE001 - the plots are derived from metrics.jsonl, which stays
                logger.warning("could not plot the run from %s: %s: %s", run_dir(config.trainer),
                               type(err).__name__, err)


def summarize_validation(before: dict[str, float], after: dict[str, float]) -> str:
    """A small table of the core validation metrics before and after training, with 95% intervals where known.

    A mean's interval is read from its `val-aux/.../ci95_low|high` keys (`validation_intervals`), so the reader
    sees whether the change is larger than the grain of the validation set.
    """
    keys = sorted(key for key in {*before, *after} if key.startswith("val-core/"))
    if not keys:
        return "no validation metrics (data.val_files is empty, or no validation was due: see trainer.test_freq)"
    cells = [(key, _with_interval(before, key), _with_interval(after, key)) for key in keys]
    widths = [max(len(row[column]) for row in [("validation metric", "before", "after"), *cells]) for column in range(3)]
    lines = [f"{'validation metric':<{widths[0]}}  {'before':<{widths[1]}}  after"]
    lines += [f"{key:<{widths[0]}}  {old:<{widths[1]}}  {new}" for key, old, new in cells]
    return "\n".join(line.rstrip() for line in lines)


def _with_interval(metrics: dict[str, float], core_key: str) -> str:
    if core_key not in metrics:
        return "-"
    text = f"{metrics[core_key]:.4f}"
    low_key, high_key = interval_keys(core_key)
    low, high = metrics.get(low_key), metrics.get(high_key)
    if low is not None and high is not None:
        text += f" [{low:.3f}, {high:.3f}]"
    return text
