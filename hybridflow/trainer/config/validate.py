"""Checks that span config components, run before Ray starts or weights load, in order; the batch numbers they
derive come from `batches.py`, the checks of models, data and parallel layouts from their own modules. Every error
names the key, the value and the fix.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hybridflow.data.config import expand_path
from hybridflow.engines.training.config import OptimConfig
from hybridflow.engines.rollout.registry import backends_with
from hybridflow.rewards.config import built_in_scorer_settings, built_in_scorer_settings_error
from hybridflow.utils.config import changed_leaves
from hybridflow.trainer.config.batches import BatchSizes, derive_batch_sizes
from hybridflow.trainer.config.data_checks import check_data_files, check_rows
from hybridflow.trainer.config.model_checks import (
    check_config_overrides_reach_the_rollout,
    check_lengths,
    check_model_location,
    check_attention_kernels_on_cpu,
    check_forward_support,
    check_lora_on_experts,
    check_lora_with_lone_param_offload,
    check_moe_routing,
    check_rollout_model,
    check_prime,
    check_prime_keys_unused,
    check_reward_model,
    check_reward_model_keys_unused,
    check_teacher,
)
from hybridflow.trainer.config.parallel_checks import check_parallelism, check_rollout_parallelism, check_token_budgets
from hybridflow.trainer.config.profiler_checks import check_profiling
from hybridflow.trainer.config.resume_checks import check_resume_contents, check_resumed_layouts
from hybridflow.trainer.config.reward_checks import check_custom_reward_function, check_generative_reward_model
from hybridflow.trainer.config.verl_copies import check_verl_copies
from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.trainer.config.vision import check_vision_language

logger = logging.getLogger(__name__)


def validate_config(cfg: PPOConfig) -> dict[str, BatchSizes]:
    """Run every cross-component check; return the derived batch sizes per updated model."""
    from hybridflow.trainer.placement import check_placement, run_roles  # here: the trainer package imports the runtime

    # The config alone first, then the files it names; torch and transformers load only where a check needs them
    # (a vision-language model, a model's shape for tp/sp, and last the device count and the rollout backend), so
    # most errors print before they load.
    _check_names(cfg)
    _check_algorithm(cfg)
    _check_alarms_can_fire(cfg)
    check_placement(cfg)
    check_profiling(cfg, set(run_roles(cfg)))
    _check_files(cfg)
    _check_output_files(cfg)
    check_resume_contents(cfg)
    _check_rewards(cfg)
    _check_agent_loops(cfg)
    check_rows(cfg)
    check_vision_language(cfg)  # imports the vision code only for a vision-language model
    check_lengths(cfg)
    check_config_overrides_reach_the_rollout(cfg)
    check_rollout_model(cfg)
    check_lora_on_experts(cfg)
    check_moe_routing(cfg)
    check_lora_with_lone_param_offload(cfg)
    _check_optimizers(cfg)
    check_token_budgets(cfg)
    layouts = check_parallelism(cfg)
    check_resumed_layouts(cfg, layouts)
    check_rollout_parallelism(cfg)
    actor = cfg.actor_rollout_ref.actor
    sizes = {
        "actor": derive_batch_sizes(
            cfg, "actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
            actor.ppo_epochs, actor.update_token_budget, layouts["actor"].group_size,
        )
    }
    if cfg.critic_enabled:
        critic = cfg.critic
        sizes["critic"] = derive_batch_sizes(
            cfg, "critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu, critic.ppo_epochs,
            critic.update_token_budget, layouts["critic"].group_size,
        )
    check_forward_support(cfg)  # may import transformers (a family's attention kernels)
    check_attention_kernels_on_cpu(cfg)  # may import torch (the device count)
    cfg.trainer.check_environment(cfg.ray_kwargs.ray_init.address)
    check_rollout_backend(cfg)
    return sizes


def _check_names(cfg: PPOConfig) -> None:
    # Torch-free registries (built-ins register lazily): a misspelt name prints before torch would load.
    from hybridflow.algorithms.config import KL_PENALTY_TYPES, LOSS_AGG_MODES
    from hybridflow.algorithms.estimator_registry import ADV_ESTIMATORS
    from hybridflow.algorithms.policy_loss_registry import POLICY_LOSSES
    from hybridflow.engines.rollout import ROLLOUTS
    from hybridflow.rewards.manager_registry import REWARD_MANAGERS

    actor = cfg.actor_rollout_ref.actor
    named = [
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATORS.names()),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, POLICY_LOSSES.names()),
        ("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, list(LOSS_AGG_MODES)),
        ("critic.loss_agg_mode", cfg.critic.loss_agg_mode, list(LOSS_AGG_MODES)),
        ("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, list(KL_PENALTY_TYPES)),
        ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, list(KL_PENALTY_TYPES)),
        ("actor_rollout_ref.rollout.name", cfg.actor_rollout_ref.rollout.name, ROLLOUTS.names()),
        ("reward_model.reward_manager", cfg.reward_model.reward_manager, REWARD_MANAGERS.names()),
    ]
    for key, value, known in named:
        if value not in known:
            raise ValueError(f"{key}={value!r} is unknown; known: {sorted(known)}")
    manager = REWARD_MANAGERS.loaded().get(cfg.reward_model.reward_manager)  # a user's (built-ins load lazily)
    if manager is not None and not callable(getattr(manager, "from_config", None)):
        raise ValueError(
            f"reward_model.reward_manager={cfg.reward_model.reward_manager!r} names {manager!r}, which has no "
            "from_config(tokenizer, compute_score, reward_config, data_config) classmethod the trainer builds it "
            "with; subclass hybridflow.rewards.RewardManager (or add one)"
        )


def _check_optimizers(cfg: PPOConfig) -> None:
    check_optimizer_section(cfg.actor_rollout_ref.actor.optim, "actor_rollout_ref.actor")
    if cfg.critic_enabled:
        check_optimizer_section(cfg.critic.optim, "critic")


def check_optimizer_section(optim: OptimConfig, section: str) -> None:
    """The optimizer class imports and takes the section's arguments (`optim.check_optimizer`; ValueError naming
    `section`.optim). The default is known to take them and is not checked: torch is not imported for it, so later
    config errors still print before torch loads."""
    if optim.is_default_optimizer:
        return
    from hybridflow.engines.training.optim import check_optimizer

    check_optimizer(optim, section)


def check_rollout_backend(cfg: PPOConfig) -> None:
    """The rollout backend imports (e.g. vllm installed, in a supported version set); the import error carries the
    install command. Run last: importing a backend loads torch and transformers, seconds that a config error
    found by the other checks does not wait for."""
    from hybridflow.engines.rollout import ROLLOUTS

    rollout = cfg.actor_rollout_ref.rollout
    name = rollout.name
    try:
        ROLLOUTS.get(name)
        rollout.backend_spec.check_installed()  # e.g. vllm's supported vllm/torch/transformers set
    except (ImportError, ValueError) as err:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} cannot be used: {err}") from err


def _check_alarms_can_fire(cfg: PPOConfig) -> None:
    """An alarm in trainer.guards.alarms.stop_on whose metric this run never produces would never stop it."""
    from hybridflow.trainer.guards.config import unwatchable_alarms

    arr = cfg.actor_rollout_ref
    unwatchable = unwatchable_alarms(
        bypass_mode=cfg.algorithm.rollout_correction.bypass_mode,
        rollout_log_probs=arr.rollout.backend_spec.returns_log_probs,
        entropy_in_update=arr.actor.entropy_coeff != 0 or arr.actor.calculate_entropy,
    )
    for name in cfg.trainer.guards.alarms.stop_on:
        if name in unwatchable:
            raise ValueError(
                f"trainer.guards.alarms.stop_on lists {name!r}, whose metric this run never produces, so it would "
                f"never stop the run: {unwatchable[name]}; or drop it from stop_on"
            )


def _check_algorithm(cfg: PPOConfig) -> None:
    estimator, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if cfg.actor_rollout_ref.rollout.skip_rollout and (cfg.algorithm.filter_groups.enable or cfg.estimator.greedy_baseline):
        which = "algorithm.filter_groups.enable=True" if cfg.algorithm.filter_groups.enable else f"adv_estimator={estimator!r}"
        raise ValueError(
            f"actor_rollout_ref.rollout.skip_rollout=True with {which}: a replayed batch cannot stand for dynamic "
            "sampling's further batches or ReMax's greedy baseline of new prompts; drop one of the two"
        )
    if cfg.estimator.group_based and n < 2:
        if not cfg.estimator.runs_with_one_sample:
            raise ValueError(
                f"algorithm.adv_estimator={estimator!r} needs actor_rollout_ref.rollout.n >= 2 (it compares samples "
                f"of the same prompt), got {n}; set actor_rollout_ref.rollout.n=4 or more"
            )
        logger.warning(
            "algorithm.adv_estimator=%r with actor_rollout_ref.rollout.n=%d: every prompt group holds one sample, so "
            "there is no group baseline and each advantage is the sample's own score (as verl runs it); set "
            "rollout.n >= 2 for a group baseline", estimator, n,
        )
    _check_sum_pi_squared(cfg)
    check_verl_copies(cfg)
    if cfg.trainer.critic_warmup > 0 and not cfg.critic_enabled:
        raise ValueError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic (algorithm.adv_estimator=gae)")
    if cfg.estimator.needs_critic and cfg.critic.enable is False:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} needs a critic, but critic.enable=False; enable it or use grpo")
    rollout = cfg.actor_rollout_ref.rollout
    if cfg.algorithm.rollout_correction.bypass_mode:
        _check_bypass_backend(cfg)
    _check_filter_groups(cfg)
    _check_rollout_correction(cfg)
    if cfg.actor_rollout_ref.rollout.is_greedy and n > 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.n={n} with greedy decoding (do_sample=False or temperature=0) gives {n} "
            "identical responses per prompt; sample (do_sample=True, temperature > 0) or set n=1"
        )


def _check_output_files(cfg: PPOConfig) -> None:
    """Files the run writes at its end are never written over an existing one."""
    cfg.ray_kwargs.check_output_files()


def _check_bypass_backend(cfg: PPOConfig) -> None:
    """Bypass mode takes the rollout's log-probs as the old ones (verl's `bypass_mode`): the backend must report
    them. Where they differ from the training engine's numerics (a bf16 or vLLM rollout), the update's ratio
    starts off 1 by that gap, which PPO's clip and rollout_is / rollout_rs in the loss correct, as in verl."""
    rollout = cfg.actor_rollout_ref.rollout
    spec = rollout.backend_spec
    if not spec.returns_log_probs:
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=True takes the rollout's log-probs as the old log-probs, but "
            f"actor_rollout_ref.rollout.name={rollout.name!r} does not report them; use rollout.name in "
            f"{backends_with('returns_log_probs')} or bypass_mode=False"
        )
    if not spec.log_probs_match_trainer:
        logger.warning(
            "algorithm.rollout_correction.bypass_mode=True with actor_rollout_ref.rollout.name=%r, whose log-probs "
            "are not the training engine's to float rounding: the ratio to the rollout measures that gap too (the "
            "clip and rollout_is / rollout_rs act on it, as in verl); rollout.name in %s matches the trainer",
            rollout.name, backends_with("log_probs_match_trainer"),
        )


def _check_sum_pi_squared(cfg: PPOConfig) -> None:
    """The optimal token baseline reads sum(pi^2) from the old-log-prob pass, which bypass mode skips."""
    estimator, actor = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.actor
    if cfg.estimator.needs_sum_pi_squared and not actor.calculate_sum_pi_squared:
        raise ValueError(
            f"algorithm.adv_estimator={estimator!r} reads each token's sum of squared probabilities from the "
            "old-log-prob pass: set actor_rollout_ref.actor.calculate_sum_pi_squared=True"
        )
    if actor.calculate_sum_pi_squared and cfg.algorithm.rollout_correction.bypass_mode:
        raise ValueError(
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True comes from the old-log-prob pass, which "
            "algorithm.rollout_correction.bypass_mode=True replaces by the rollout's log-probs: set bypass_mode=False"
        )


def _check_filter_groups(cfg: PPOConfig) -> None:
    """DAPO's dynamic sampling: generation batches, its metric, and what it needs from the rewards."""
    data, filter_groups = cfg.data, cfg.algorithm.filter_groups
    if not filter_groups.enable:
        if data.gen_batch_size is not None and data.gen_batch_size != data.train_batch_size:
            raise ValueError(
                f"data.gen_batch_size={data.gen_batch_size} differs from data.train_batch_size={data.train_batch_size}, "
                "but only dynamic sampling draws generation batches of another size: set "
                "algorithm.filter_groups.enable=True or drop data.gen_batch_size"
            )
        return
    metric = filter_groups.metric
    if metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ValueError(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=True: the KL penalty needs "
            "reference log-probs, computed after groups are filtered; use metric=seq_reward"
        )
    if cfg.reward_model_only and metric not in ("seq_reward", "seq_final_reward", "rm_score"):
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r}: with a reward model alone (reward_model.enable=True, "
            "rule_reward_coef=0) no rule scorer runs in training; use seq_reward or rm_score"
        )


def _check_rollout_correction(cfg: PPOConfig) -> None:
    """Rollout correction needs the rollout's log-probs next to the trainer's (bypass mode, which takes one for
    the other, is refused with it by `RolloutCorrectionConfig`)."""
    correction, rollout = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout
    name = rollout.name
    if correction.enabled and not rollout.backend_spec.returns_log_probs:
        key = "rollout_is" if correction.rollout_is is not None else "rollout_rs"
        raise ValueError(
            f"algorithm.rollout_correction.{key}={getattr(correction, key)!r} compares the trainer's log-probs with "
            f"the rollout's, but actor_rollout_ref.rollout.name={name!r} does not return rollout_log_probs; use "
            f"rollout.name in {backends_with('returns_log_probs')} or {key}=null"
        )


def _check_files(cfg: PPOConfig) -> None:
    check_data_files(cfg.data)
    if cfg.trainer.val_only and not cfg.data.val_files:
        raise ValueError("trainer.val_only=True needs data.val_files; give the parquet files to validate on")
    custom = cfg.custom_reward_function
    if custom.path is not None and not expand_path(custom.path).is_file():
        raise ValueError(f"custom_reward_function.path={custom.path!r} does not exist")
    if custom.path is not None:
        check_custom_reward_function(cfg)
    if cfg.data.custom_cls.path is not None:  # imports the user's file (and torch) only when one is named
        from hybridflow.data.dataset_class import rl_dataset_class

        try:
            rl_dataset_class(cfg.data)
        except (FileNotFoundError, AttributeError, TypeError) as err:
            raise ValueError(str(err)) from err
    if cfg.data.sampler.class_path is not None:  # imports the user's sampler file only when one is named
        from hybridflow.data.custom_sampler import load_sampler_class

        load_sampler_class(cfg.data.sampler)
    check_model_location("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    check_model_location("actor_rollout_ref.model.tokenizer_path", cfg.actor_rollout_ref.model.tokenizer_path, weights=False)
    check_teacher(cfg)
    if cfg.critic_enabled:
        check_model_location("critic.model.path", cfg.critic.model.path)
        check_model_location("critic.model.tokenizer_path", cfg.critic.model.tokenizer_path, weights=False)
    if cfg.uses_prime:
        check_prime(cfg)
    elif cfg.reward_model.enable:
        check_reward_model(cfg)
    check_prime_keys_unused(cfg)
    check_reward_model_keys_unused(cfg)
    cfg.trainer.check_paths()


def _check_rewards(cfg: PPOConfig) -> None:
    _check_reward_loop(cfg)
    error = built_in_scorer_settings_error(cfg.custom_reward_function, built_in_scorer_settings(cfg.reward_model))
    if error is not None:
        raise ValueError(error)
    buffer, manager = cfg.reward_model.overlong_buffer, cfg.reward_model.reward_manager
    if not buffer.enable:
        return
    if manager != "dapo":
        raise ValueError(
            f"reward_model.overlong_buffer.enable=True needs reward_model.reward_manager=dapo, got {manager!r}"
        )
    buffer.check_len(cfg.data.max_response_length)


def _check_reward_loop(cfg: PPOConfig) -> None:
    """verl's reward loop: a reward model with a custom reward function is a generative judge the function queries
    over HTTP (served by the rollout engines, one rank per replica); PRIME's implicit PRM is not served."""
    if not cfg.reward_model.serves_in_reward_loop:
        return
    if cfg.uses_prime:
        raise ValueError(
            "reward_model.use_reward_loop=True with PRIME's implicit reward model: the PRM is trained on its own "
            "workers; set reward_model.use_reward_loop=False"
        )
    if cfg.generative_reward_model:
        check_generative_reward_model(cfg)
    elif not cfg.reward_model.rollout.scores_discriminative:
        raise ValueError(
            f"reward_model.rollout.name={cfg.reward_model.rollout.name!r} generates; a discriminative reward model "
            "(no custom_reward_function) is scored by transformers' forward: set reward_model.rollout.name=hf"
        )


def _agent_loop_settings(rollout) -> dict[str, object]:
    """The `rollout.multi_turn.*` and `rollout.agent.*` limits set off their defaults (verl's null, which its
    lines write for the turn limits, counts as unset), by key under rollout."""
    from hybridflow.engines.rollout.config import AgentLoopConfig, MultiTurnConfig

    checked_apart = ("multi_turn.enable", "multi_turn.tool_config_path", "multi_turn.interaction_config_path")
    leaves = [*changed_leaves("multi_turn", rollout.multi_turn, MultiTurnConfig()),
              *changed_leaves("agent", rollout.agent, AgentLoopConfig())]
    return {key: value for key, value, _ in leaves if value is not None and key not in checked_apart}


def _check_agent_loops(cfg: PPOConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    multi_turn = rollout.multi_turn
    if rollout.mode != "async":
        if multi_turn.enable:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn.enable=True needs actor_rollout_ref.rollout.mode=async "
                "(agent loops talk to the generation servers)"
            )
        for key in ("tool_config_path", "interaction_config_path"):
            if getattr(multi_turn, key) is not None:
                raise ValueError(
                    f"actor_rollout_ref.rollout.multi_turn.{key}={getattr(multi_turn, key)!r} with "
                    "actor_rollout_ref.rollout.mode=sync: tools and interactions run only in agent loops; set "
                    f"mode=async (its default when a {key} is given) or drop the {key}"
                )
        for key, value in _agent_loop_settings(rollout).items():
            raise ValueError(
                f"actor_rollout_ref.rollout.{key}={value!r} with actor_rollout_ref.rollout.mode=sync: it is read only "
                "by agent loops (rollout.mode=async, or multi_turn.enable=True); set one of them or drop it"
            )
        return
    if not cfg.data.return_raw_chat:
        raise ValueError(
            "actor_rollout_ref.rollout.mode=async runs agent loops on each row's chat messages: set data.return_raw_chat=True"
        )
    from hybridflow.agents.base import AGENT_LOOPS
    from hybridflow.agents.manager import AgentLoopManager  # noqa: F401  (registers the built-in loops)

    if rollout.agent.default_agent_loop not in AGENT_LOOPS:
        raise ValueError(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={rollout.agent.default_agent_loop!r} is unknown; "
            f"known: {sorted(AGENT_LOOPS.names())}"
        )
    for key in ("tool_config_path", "interaction_config_path"):
        path = getattr(multi_turn, key)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.{key}={path!r} does not exist")
    if multi_turn.tool_config_path is not None:
        from hybridflow.tools.loader import load_tools

        try:
            load_tools(multi_turn.tool_config_path)  # a malformed entry fails now, naming it
        except (ValueError, TypeError) as err:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path: {err}") from err
    if multi_turn.interaction_config_path is not None:
        from hybridflow.agents.interactions import load_interactions

        try:
            load_interactions(multi_turn.interaction_config_path)  # a malformed entry fails now, naming it
        except (ValueError, TypeError) as err:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path: {err}") from err
