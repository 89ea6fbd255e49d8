"""Checks that span config components, run before Ray starts or weights load, in order; the batch numbers they
derive come from `batches.py`. Every error names the key, the value and the fix.
"""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

from hybridflow.data.config import DataFilesConfig, expand_path
from hybridflow.engines.training.config import FSDPEngineConfig, ParallelLayout
from hybridflow.models.parallel_plan import check_sp_layout, check_tp_layout
from hybridflow.trainer.config.batches import BatchSizes, derive_batch_sizes
from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.trainer.config.vision import check_vision_language

# Architectures a reward model checkpoint may have: one score per sequence (or per token, read at the last one).
REWARD_MODEL_HEADS = ("ForSequenceClassification", "ForTokenClassification")


BYPASS_ENGINES = ("native",)
"""Rollout engines whose sampled log-probs match the training engine's (to about 1e-4): bypass mode may use them."""
LOG_PROB_ENGINES = ("hf", "native", "vllm")
"""Rollout engines that return `rollout_log_probs` (the agent-loop servers run these too): rollout correction
(`rollout_is`, `rollout_rs`) compares them with the trainer's."""


def validate_config(cfg: PPOConfig) -> dict[str, BatchSizes]:
    """Run every cross-component check; return the derived batch sizes per updated model."""
    # Imported here: placement reads Ray's node helpers, which a config error must not wait for.
    from hybridflow.trainer.placement import check_placement

    _check_names(cfg)
    _check_algorithm(cfg)
    check_placement(cfg)  # reads the config only: before the checks that open files
    _check_files(cfg)
    _check_rewards(cfg)
    _check_agent_loops(cfg)
    _check_rows(cfg)
    check_vision_language(cfg)
    _check_lengths(cfg)
    _check_token_budgets(cfg)
    cfg.trainer.check_environment(cfg.ray_kwargs.ray_init.address)
    layouts = check_parallelism(cfg)
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
    return sizes


# A stand-in for the run's length, which is counted once the data loads: the engine's rules do not depend on it.
_ANY_STEPS = 1


def engine_configs(cfg: PPOConfig) -> dict[str, tuple[str, FSDPEngineConfig]]:
    """The training engines the run builds, by role, with the config key of each one's section. They come from the
    section methods the workers call, so building them here runs the engine's own rules before Ray starts (e.g.
    sequence parallelism needs packed rows); a broken rule raises ValueError naming the section."""
    arr = cfg.actor_rollout_ref
    builders = {"actor": ("actor_rollout_ref.actor", lambda: arr.actor.engine_config(arr.model, _ANY_STEPS))}
    if cfg.uses_reference:
        builders["ref"] = ("actor_rollout_ref.ref", lambda: arr.ref.engine_config(arr.model, arr.actor.use_prefix_grouper))
    if cfg.critic_enabled:
        builders["critic"] = ("critic", lambda: cfg.critic.engine_config(_ANY_STEPS))
    if cfg.uses_prime:
        builders["reward_model"] = ("reward_model", lambda: cfg.reward_model.prime_engine_configs(_ANY_STEPS)[0])
    elif cfg.reward_model.enable:
        builders["reward_model"] = ("reward_model", cfg.reward_model.engine_config)
    engines = {}
    for role, (key, build) in builders.items():
        try:
            engines[role] = (key, build())
        except ValueError as err:
            raise ValueError(f"{key} (its training engine): {err}") from err
    return engines


def check_parallelism(cfg: PPOConfig) -> dict[str, ParallelLayout]:
    """Tensor / sequence parallel layouts of the trained models: sizes that divide the ranks and the model's
    heads, and the engine's own rules (packed rows for sequence parallelism, no LoRA with tensor parallelism);
    returns the layouts."""
    arr, world = cfg.actor_rollout_ref, cfg.trainer.world_size
    sizes = {"actor": ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.actor", arr.actor.fsdp_config,
                       arr.actor.ulysses_sequence_parallel_size)}
    if cfg.critic_enabled:
        sizes["critic"] = ("critic.model.fsdp_config", "critic", cfg.critic.model.fsdp_config,
                           cfg.critic.ulysses_sequence_parallel_size)
    if cfg.reward_model.enable:
        sizes["reward_model"] = ("reward_model.model.fsdp_config", "reward_model", cfg.reward_model.model.fsdp_config, 1)
    layouts = {}
    for role, (fsdp_key, prefix, fsdp, sp) in sizes.items():
        ranks = (cfg.reward_model.num_pool_processes or world) if role == "reward_model" else world
        tp, tp_key = fsdp.tensor_parallel_size, f"{fsdp_key}.tensor_parallel_size"
        sp_key = f"{prefix}.ulysses_sequence_parallel_size"
        try:
            layouts[role] = ParallelLayout(ranks, tp, sp)
        except ValueError as err:
            raise ValueError(f"{tp_key}={tp}, {sp_key}={sp} over {ranks} ranks: {err}") from err
    engines = engine_configs(cfg)  # the engine's own rules, once the sizes fit the ranks
    for role, layout in layouts.items():
        if layout.group_size > 1:
            fsdp_key, prefix = sizes[role][:2]
            model = engines[role][1].model
            model_config = _model_config(model.path, trust_remote_code=model.trust_remote_code)
            check_tp_layout(model_config, layout.tp, f"{fsdp_key}.tensor_parallel_size")
            check_sp_layout(model_config, layout.sp, f"{prefix}.ulysses_sequence_parallel_size")
    ref = arr.ref
    if cfg.uses_reference:
        actor_layout = layouts["actor"]
        ref_sizes = (ref.fsdp_config.tensor_parallel_size, ref.ulysses_sequence_parallel_size)
        if ref_sizes != (actor_layout.tp, actor_layout.sp):
            raise ValueError(
                f"actor_rollout_ref.ref.fsdp_config.tensor_parallel_size={ref_sizes[0]} and "
                f"ref.ulysses_sequence_parallel_size={ref_sizes[1]} differ from the actor's ({actor_layout.tp}, "
                f"{actor_layout.sp}): the reference shares the actor's workers and data shards; leave them unset "
                "(they follow the actor's)"
            )
    return layouts


def check_rollout_parallelism(cfg: PPOConfig) -> None:
    """`actor_rollout_ref.rollout.tensor_model_parallel_size`: it divides the colocated pool's ranks and the model's
    heads, key/value heads, MLP width and vocabulary, and runs colocated only (the engine and mode are checked by
    the rollout's own config)."""
    arr = cfg.actor_rollout_ref
    tp, key = arr.rollout.tensor_model_parallel_size, "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp == 1:
        return
    if not arr.hybrid_engine:
        raise ValueError(
            f"{key}={tp} with actor_rollout_ref.hybrid_engine=False: the split rollout pool receives the weights by a "
            f"broadcast to whole-model replicas and cannot hold tensor-parallel shards yet; use {key}=1 or "
            "hybrid_engine=True"
        )
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if world % tp:
        raise ValueError(
            f"{key}={tp} does not divide the {world} ranks of the colocated pool (trainer.nnodes x "
            f"trainer.n_gpus_per_node): each rollout replica takes {tp} consecutive ranks; pick a divisor of {world}"
        )
    check_tp_layout(_model_config(arr.model.path, trust_remote_code=arr.model.trust_remote_code), tp, key)


def _model_config(path: str, trust_remote_code: bool = False) -> Any:
    """A model's HF config. Imported here, not at the top: transformers and torch take seconds to import, and only
    the checks that read a model's shape need them (a config error prints before they load)."""
    from hybridflow.models.loader import load_model_config

    return load_model_config(path, trust_remote_code=trust_remote_code)


def _check_token_budgets(cfg: PPOConfig) -> None:
    """Each token budget in use holds the longest sequence (max_prompt_length + max_response_length)."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    arr = cfg.actor_rollout_ref
    budgets = [
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.update_token_budget),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", arr.rollout.log_prob_token_budget),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_token_budget if cfg.uses_reference else None),
    ]
    if cfg.critic_enabled:
        budgets += [
            ("critic.ppo_max_token_len_per_gpu", cfg.critic.update_token_budget),
            ("critic.forward_max_token_len_per_gpu", cfg.critic.forward_token_budget),
        ]
    for key, budget in budgets:
        if budget is not None and budget < longest:
            raise ValueError(
                f"{key}={budget} is below the longest sequence, data.max_prompt_length + data.max_response_length = "
                f"{longest} tokens; raise it to at least {longest} (a few times more packs several sequences)"
            )


def _check_names(cfg: PPOConfig) -> None:
    from hybridflow.algorithms import ADV_ESTIMATORS, KL_PENALTY_TYPES, LOSS_AGG_MODES, POLICY_LOSSES
    from hybridflow.engines.rollout import ROLLOUTS, vllm_versions
    from hybridflow.rewards.manager.base import REWARD_MANAGERS

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
    # A backend that is registered but cannot import (e.g. vllm not installed) fails here, not after Ray starts;
    # the import error carries the install command.
    name = cfg.actor_rollout_ref.rollout.name
    try:
        ROLLOUTS.get(name)
        if name == "vllm":  # the supported vllm/torch/transformers set, read without importing vllm
            vllm_versions.check_vllm_versions(vllm_versions.installed_vllm_versions())
    except (ImportError, ValueError) as err:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} cannot be used: {err}") from err


def _check_algorithm(cfg: PPOConfig) -> None:
    estimator, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if cfg.estimator.group_based and n < 2:
        raise ValueError(
            f"algorithm.adv_estimator={estimator!r} needs actor_rollout_ref.rollout.n >= 2 (it compares samples "
            f"of the same prompt), got {n}; set actor_rollout_ref.rollout.n=4 or more"
        )
    if cfg.trainer.critic_warmup > 0 and not cfg.critic_enabled:
        raise ValueError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic (algorithm.adv_estimator=gae)")
    if cfg.estimator.needs_critic and cfg.critic.enable is False:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} needs a critic, but critic.enable=False; enable it or use grpo")
    rollout = cfg.actor_rollout_ref.rollout
    if cfg.algorithm.rollout_correction.bypass_mode and rollout.name not in BYPASS_ENGINES:
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=True takes the rollout's log-probs as the old log-probs, but "
            f"actor_rollout_ref.rollout.name={rollout.name!r} does not report log-probs that match the training "
            f"engine's; use rollout.name in {list(BYPASS_ENGINES)} or bypass_mode=False"
        )
    _check_filter_groups(cfg)
    _check_rollout_correction(cfg)
    if cfg.actor_rollout_ref.rollout.is_greedy and n > 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.n={n} with greedy decoding (do_sample=False or temperature=0) gives {n} "
            "identical responses per prompt; sample (do_sample=True, temperature > 0) or set n=1"
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
    correction, name = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout.name
    if correction.enabled and name not in LOG_PROB_ENGINES:
        key = "rollout_is" if correction.rollout_is is not None else "rollout_rs"
        raise ValueError(
            f"algorithm.rollout_correction.{key}={getattr(correction, key)!r} compares the trainer's log-probs with "
            f"the rollout's, but actor_rollout_ref.rollout.name={name!r} does not return rollout_log_probs; use "
            f"rollout.name in {list(LOG_PROB_ENGINES)} or {key}=null"
        )


def check_data_files(data: DataFilesConfig) -> None:
    """Training files are given, and every training and validation file exists (`~` expanded)."""
    if not data.train_files:
        raise ValueError("data.train_files is empty; give parquet files, e.g. data.train_files=[data/train.parquet]")
    for key, paths in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for path in paths:
            if not expand_path(path).is_file():
                raise ValueError(f"{key} entry {path!r} does not exist; hybridflow/data/preprocess/ writes parquet files")


def _check_files(cfg: PPOConfig) -> None:
    check_data_files(cfg.data)
    if cfg.trainer.val_only and not cfg.data.val_files:
        raise ValueError("trainer.val_only=True needs data.val_files; give the parquet files to validate on")
    custom = cfg.custom_reward_function
    if custom.path is not None and not expand_path(custom.path).is_file():
        raise ValueError(f"custom_reward_function.path={custom.path!r} does not exist")
    check_model_location("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    check_model_location("actor_rollout_ref.model.tokenizer_path", cfg.actor_rollout_ref.model.tokenizer_path, weights=False)
    _check_teacher(cfg)
    if cfg.critic_enabled:
        check_model_location("critic.model.path", cfg.critic.model.path)
        check_model_location("critic.model.tokenizer_path", cfg.critic.model.tokenizer_path, weights=False)
    if cfg.uses_prime:
        _check_prime(cfg)
    elif cfg.reward_model.enable:
        _check_reward_model(cfg)
    _check_prime_keys_unused(cfg)
    cfg.trainer.check_paths()


def _check_teacher(cfg: PPOConfig) -> None:
    """A reference model other than the actor's (a distillation teacher) must exist and be used by a KL term."""
    ref_model, actor_model = cfg.actor_rollout_ref.ref.model, cfg.actor_rollout_ref.model
    if ref_model.path == actor_model.path:
        return
    check_model_location("actor_rollout_ref.ref.model.path", ref_model.path)
    check_model_location("actor_rollout_ref.ref.model.tokenizer_path", ref_model.tokenizer_path, weights=False)
    if not cfg.uses_reference:
        raise ValueError(
            f"actor_rollout_ref.ref.model.path={ref_model.path!r} sets a teacher, but no KL term uses the reference: "
            "set actor_rollout_ref.actor.use_kl_loss=True (KL loss) or algorithm.use_kl_in_reward=True (KL reward)"
        )


def _check_prime(cfg: PPOConfig) -> None:
    """PRIME: the implicit PRM is a causal LM (trained, with a frozen reference); outcomes are the rule rewards."""
    section, model = cfg.reward_model, cfg.reward_model.model
    if not section.enable:
        raise ValueError(
            "algorithm.adv_estimator=prime trains an implicit process reward model: set reward_model.enable=True and "
            "reward_model.model.path to a causal LM (usually the actor's initial model)"
        )
    if section.rule_reward_coef != 0:
        raise ValueError(
            f"reward_model.rule_reward_coef={section.rule_reward_coef} with PRIME: the outcome reward is the rule "
            "reward, weighted in the advantage by algorithm.reward_gt_coef; leave rule_reward_coef at 0"
        )
    for key, location in (("path", model.path), ("ref_path", model.ref_path)):
        check_model_location(f"reward_model.model.{key}", location)
        if location is None:
            continue
        architectures = getattr(_model_config(location), "architectures", None) or []
        if not any(name.endswith("ForCausalLM") for name in architectures):
            raise ValueError(
                f"reward_model.model.{key}={location!r} lists architectures {architectures or 'none'}: PRIME's implicit "
                "reward model is a causal LM (...ForCausalLM), e.g. the actor's initial model"
            )
    check_model_location("reward_model.model.tokenizer_path", model.tokenizer_path, weights=False)
    if model.update == "none" and model.ref_path in (None, model.path):
        raise ValueError(
            "reward_model.model.update=none with the implicit PRM's reference equal to its weights: its rewards "
            "beta * (log pi_prm - log pi_ref) would be 0 forever; set reward_model.model.update=before (or after)"
        )
    if model.lora_rank:
        raise ValueError("reward_model.model.lora_rank with PRIME: LoRA on the implicit PRM is not implemented")
    if model.input_tokenizer not in (None, cfg.actor_rollout_ref.model.path):
        raise ValueError(
            "reward_model.model.input_tokenizer with PRIME: the implicit PRM scores the policy's token ids, so it must "
            "share the policy's tokenizer; leave input_tokenizer unset"
        )


_PRIME_FIELDS = {
    "reward_model.model": ("update", "ref_path", "beta_train"),
    "reward_model": ("prime_granularity", "prime_norm"),
    "algorithm": ("reward_dpo_coef", "reward_gt_coef"),
}
"""PRIME's settings, by section."""


def _check_prime_keys_unused(cfg: PPOConfig) -> None:
    """PRIME's settings configure nothing in other runs: one changed from its section's default is refused, not
    ignored."""
    if cfg.uses_prime:
        return
    sections = {"reward_model.model": cfg.reward_model.model, "reward_model": cfg.reward_model, "algorithm": cfg.algorithm}
    for prefix, section in sections.items():
        defaults = type(section)()
        for name in _PRIME_FIELDS[prefix]:
            value = getattr(section, name)
            if value != getattr(defaults, name):
                raise ValueError(
                    f"{prefix}.{name}={value!r} configures PRIME's implicit process reward model, but "
                    f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}; set algorithm.adv_estimator=prime or "
                    "drop it"
                )


def _check_reward_model(cfg: PPOConfig) -> None:
    """The reward model is a local classification checkpoint with one label, used for inference only."""
    model = cfg.reward_model.model
    check_model_location("reward_model.model.path", model.path)
    check_model_location("reward_model.model.tokenizer_path", model.tokenizer_path, weights=False)
    check_model_location("reward_model.model.input_tokenizer", model.input_tokenizer, weights=False)
    for key, value in (("lora_rank", model.lora_rank), ("enable_gradient_checkpointing", model.enable_gradient_checkpointing)):
        if value:
            raise ValueError(f"reward_model.model.{key}={value!r}: the reward model is not trained; leave it unset")
    config_file = expand_path(model.path) / "config.json"
    architectures = []
    if config_file.is_file():
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not any(name.endswith(REWARD_MODEL_HEADS) for name in architectures):
        raise ValueError(
            f"reward_model.model.path={model.path!r} is not a reward model: its config.json lists architectures "
            f"{architectures or 'none'}, but a reward model is a ...ForSequenceClassification (or "
            "...ForTokenClassification) checkpoint with one label and a trained score head"
        )


def check_model_location(key: str, location: str | None, weights: bool = True) -> None:
    """A catalogue name, an existing directory or a .gguf file (`~` expanded as the loader does); None passes.
    With `weights`, a directory must hold weight files (tokenizer locations pass `weights=False`)."""
    from hybridflow.models.catalogue import MODEL_CATALOGUE

    if location is None or location in MODEL_CATALOGUE:
        return
    path = expand_path(location)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(
            f"{key}={location!r} is not a catalogue name ({', '.join(MODEL_CATALOGUE.names())}), an existing model "
            "directory, nor a .gguf file"
        )
    weight_files = ("*.safetensors", "*.bin", "*.gguf", "*.safetensors.index.json")
    if weights and path.is_dir() and not any(any(path.glob(pattern)) for pattern in weight_files):
        raise ValueError(
            f"{key}={location!r} holds no weights (no .safetensors, .bin or .gguf file). A checkpoint's huggingface/ "
            "folder has only the config and tokenizer: write a model with `hybridflow merge --local_dir "
            "<global_step_N> --target_dir <dir>` and point the key there"
        )


def _check_rows(cfg: PPOConfig) -> None:
    """Every data_source of the training and validation files has a scorer (unless a custom function scores
    them), and every agent_name is a registered agent loop; reads only those columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    key = cfg.data.reward_fn_key
    num_train_rows = 0
    for name, paths in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for path in paths:
            try:
                columns = pq.read_schema(expand_path(path)).names
            except (OSError, pa.ArrowException) as err:
                raise ValueError(f"{name} entry {path!r} is not a readable parquet file: {err}") from None
            if key not in columns:
                raise ValueError(f"{name} entry {path!r} has no {key!r} column (data.reward_fn_key); columns: {columns}")
            table = pq.read_table(expand_path(path), columns=[c for c in (key, "agent_name") if c in columns])
            num_train_rows += table.num_rows if name == "data.train_files" else 0
            if cfg.custom_reward_function.path is None and not (cfg.reward_model_only and name == "data.train_files"):
                _check_scorers(sorted(set(table.column(key).to_pylist())), f"{name} entry {path!r}")
            if "agent_name" in columns:
                _check_agent_names(sorted({n for n in table.column("agent_name").to_pylist() if n}), path)
    _check_steps(cfg, num_train_rows)


def _check_steps(cfg: PPOConfig, num_train_rows: int) -> None:
    """The batch fits the rows, and critic warm-up leaves actor steps (rows before overlong-prompt filtering)."""
    data, trainer = cfg.data, cfg.trainer
    if data.train_max_samples > 0:
        num_train_rows = min(num_train_rows, data.train_max_samples)
    if num_train_rows < data.train_batch_size:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} is larger than the {num_train_rows} training rows; lower "
            "it or add data"
        )
    if data.gen_batch_size is not None and num_train_rows < data.gen_batch_size:
        raise ValueError(
            f"data.gen_batch_size={data.gen_batch_size} is larger than the {num_train_rows} training rows; lower it"
        )
    most_steps = trainer.total_epochs * (num_train_rows // (data.gen_batch_size or data.train_batch_size))
    steps = min(most_steps, trainer.total_training_steps or most_steps)
    if trainer.critic_warmup and trainer.critic_warmup >= steps:
        raise ValueError(
            f"trainer.critic_warmup={trainer.critic_warmup} leaves no actor update in the run's {steps} steps "
            "(trainer.total_training_steps, or total_epochs x rows // data.train_batch_size); lower it"
        )


def _check_scorers(data_sources: list[str], where: str) -> None:
    from hybridflow.rewards.score import has_scorer

    missing = [source for source in data_sources if not has_scorer(source)]
    if missing:
        raise ValueError(
            f"{where}: no reward scorer for data_source {missing}; register one in hybridflow.rewards.score.SCORERS "
            "or set custom_reward_function.path"
        )


def _check_agent_names(names: list[str], path: str) -> None:
    from hybridflow.agents.base import AGENT_LOOPS
    from hybridflow.agents.manager import AgentLoopManager  # noqa: F401  (registers the built-in loops)

    unknown = [name for name in names if name not in AGENT_LOOPS]
    if unknown:
        raise ValueError(f"{path}: agent_name {unknown} is not a registered agent loop; known: {AGENT_LOOPS.names()}")


def _check_rewards(cfg: PPOConfig) -> None:
    buffer, manager = cfg.reward_model.overlong_buffer, cfg.reward_model.reward_manager
    if not buffer.enable:
        return
    if manager != "dapo":
        raise ValueError(
            f"reward_model.overlong_buffer.enable=True needs reward_model.reward_manager=dapo, got {manager!r}"
        )
    buffer.check_len(cfg.data.max_response_length)


def _check_agent_loops(cfg: PPOConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    multi_turn = rollout.multi_turn
    if rollout.mode != "async":
        if multi_turn.enable:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn.enable=True needs actor_rollout_ref.rollout.mode=async "
                "(agent loops talk to the generation servers)"
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

        load_tools(multi_turn.tool_config_path)  # a malformed entry fails now, naming it


def model_context_length(model_path: str) -> int | None:
    """max_position_embeddings from a model directory's config.json (catalogue models once converted), else None."""
    from hybridflow.models.catalogue import MODEL_CATALOGUE, catalogue_gguf_path

    from hybridflow import env

    directory = expand_path(model_path)
    if model_path in MODEL_CATALOGUE:
        catalogue_gguf_path(model_path)  # raises with the install command if the package is missing
        directory = env.cache_dir() / "models" / model_path
    config_file = directory / "config.json"
    if not config_file.is_file():
        if not directory.exists() and not model_path.endswith(".gguf") and model_path not in MODEL_CATALOGUE:
            raise ValueError(f"actor_rollout_ref.model.path={model_path!r} is not a catalogue name, directory or .gguf file")
        return None
    return json.loads(config_file.read_text()).get("max_position_embeddings")


def _check_lengths(cfg: PPOConfig) -> None:
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    context = model_context_length(cfg.actor_rollout_ref.model.path)
    if context is not None and total > context:
        raise ValueError(
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's context of {context} "
            f"tokens ({cfg.actor_rollout_ref.model.path}); lower one of them"
        )
