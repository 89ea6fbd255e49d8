"""Config checks for vision-language models, run before Ray starts (part of `validate_config`).

A vision-language actor (a checkpoint with a `vision_config`, e.g. Qwen2-VL) runs where its images are handled:
the `hf` rollout (sync mode), the FSDP engine's padded or packed (use_remove_padding) forward, without critic,
reward model, LoRA, tensor or sequence parallelism or a distillation teacher. A text model refuses training data
with images.
"""

from __future__ import annotations

import json
from typing import Any

from hybridflow.data.config import expand_path
from hybridflow.engines.rollout.registry import backends_with
from hybridflow.trainer.config.parallel_checks import model_section_config
from hybridflow.trainer.config.schema import PPOConfig

__all__ = ["check_vision_language"]

_MODEL_KEY = "actor_rollout_ref.model.path"


def check_vision_language(cfg: PPOConfig) -> None:
    """ValueError naming the key and the fix when a vision-language actor meets a setting that cannot carry its
    images, or when a text actor is given rows with images."""
    config = _vision_language_config(cfg)
    if config is None:
        if cfg.actor_rollout_ref.actor.freeze_vision_tower:
            raise ValueError(
                f"actor_rollout_ref.actor.freeze_vision_tower=True, but {_MODEL_KEY}="
                f"{cfg.actor_rollout_ref.model.path!r} is a text model (its config has no vision_config): there is "
                "no vision tower to freeze; set freeze_vision_tower=False"
            )
        _check_no_images(cfg)
        return
    from hybridflow.models.vision import check_vision_language_support

    check_vision_language_support(config, _MODEL_KEY)
    arr = cfg.actor_rollout_ref
    path = arr.model.path
    refusals = (
        (not arr.rollout.backend_spec.runs_vision,
         f"actor_rollout_ref.rollout.name={arr.rollout.name!r} does not run vision-language models (no image "
         f"inputs); set actor_rollout_ref.rollout.name to one of {backends_with('runs_vision')}"),
        (arr.rollout.mode != "sync",
         f"actor_rollout_ref.rollout.mode={arr.rollout.mode!r}: agent loops send token ids only, not images; "
         "set actor_rollout_ref.rollout.mode=sync"),
        (arr.actor.use_prefix_grouper,
         "actor_rollout_ref.actor.use_prefix_grouper=True: shared-prompt rows carry no images; set it to False"),
        (arr.actor.fsdp_config.tensor_parallel_size > 1 or arr.actor.ulysses_sequence_parallel_size > 1,
         "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size / ulysses_sequence_parallel_size > 1: tensor and "
         "sequence parallelism do not cover vision towers; use 1"),
        (arr.model.use_lora,
         "actor_rollout_ref.model.lora_rank > 0 (or lora_adapter_path): LoRA on vision-language models is not "
         "supported; use lora_rank=0"),
        (arr.ref.model.path not in (None, path),
         "actor_rollout_ref.ref.model.path: a distillation teacher for a vision-language actor is not supported; "
         "leave it unset"),
        (cfg.critic_enabled,
         f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} (critic.enable): a critic (value model) of a "
         "vision-language checkpoint is not supported; use a critic-free estimator such as grpo"),
        (cfg.reward_model.enable,
         "reward_model.enable=True: reward models score text only, and the rows hold images; use rule rewards"),
    )
    for refused, message in refusals:
        if refused:
            raise ValueError(f"{_MODEL_KEY}={path!r} is a vision-language model ({config.model_type}); {message}")


def _vision_language_config(cfg: PPOConfig) -> Any:
    """The actor's HF config when its config.json has a vision tower, else None (catalogue names, .gguf files and
    locations without a config.json, which other checks report, are text models here)."""
    model = cfg.actor_rollout_ref.model
    config_file = expand_path(model.path) / "config.json"
    try:
        has_vision = "vision_config" in json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not has_vision:
        return None
    return model_section_config(model)  # imports transformers: only for a vision-language model


def _check_no_images(cfg: PPOConfig) -> None:
    """A text actor's training and validation files hold no images in `data.image_key` (reads only that column)."""
    import pyarrow.parquet as pq  # here, not at the top: a config error prints before pyarrow (and numpy) load

    from hybridflow.trainer.config.data_checks import holds_values

    key = cfg.data.image_key
    for name, path in cfg.data.named_files():
        if holds_values(pq.ParquetFile(expand_path(path)), key):  # not read_table, which imports pandas
            raise ValueError(
                f"{name} entry {path!r}: column {key!r} (data.image_key) holds images but {_MODEL_KEY}="
                f"{cfg.actor_rollout_ref.model.path!r} is a text-only model; use a vision-language model "
                "(e.g. Qwen2-VL) or drop the column"
            )
