"""Parallel layouts and token budgets of a PPO run, checked before Ray starts: tensor / sequence parallel sizes
against the ranks and the model's shape, the training engines' own rules, and budgets that hold a sequence."""

from __future__ import annotations

from typing import Any

from hybridflow.engines.rollout.registry import backends_with, rollout_spec
from hybridflow.engines.training.config import FSDPEngineConfig, ParallelLayout
from hybridflow.models.parallel_plan import check_ep_layout, check_rollout_tp_layout, check_sp_layout, check_tp_layout
from hybridflow.trainer.config.schema import PPOConfig

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
        sizes["reward_model"] = ("reward_model.model.fsdp_config", "reward_model", cfg.reward_model.serving_fsdp, 1)
    layouts, keys = {}, {}
    for role, (fsdp_key, prefix, fsdp, sp) in sizes.items():
        ranks = (cfg.reward_model.num_pool_processes or world) if role == "reward_model" else world
        tp_key, ep_key = (cfg.reward_model.layout_keys if role == "reward_model" else
                          (f"{fsdp_key}.tensor_parallel_size", f"{fsdp_key}.expert_parallel_size"))
        keys[role] = tp_key, ep_key
        tp, ep = fsdp.tensor_parallel_size, fsdp.expert_parallel_size
        sp_key = f"{prefix}.ulysses_sequence_parallel_size"
        try:
            layouts[role] = ParallelLayout(ranks, tp, sp, ep, fsdp.fsdp_size)
        except ValueError as err:
            where = f"{tp_key}={tp}, {sp_key}={sp}, {ep_key}={ep}"
            if fsdp.fsdp_size != -1:
                where = f"{fsdp_key}.fsdp_size={fsdp.fsdp_size}, {where}"
            raise ValueError(f"{where} over {ranks} ranks: {err}") from err
    engines = engine_configs(cfg)  # the engine's own rules, once the sizes fit the ranks
    for role, layout in layouts.items():
        if layout.group_size > 1 or layout.ep > 1:
            prefix, (tp_key, ep_key) = sizes[role][1], keys[role]
            model = engines[role][1].model
            model_config = model_section_config(model)
            check_tp_layout(model_config, layout.tp, tp_key)
            check_sp_layout(model_config, layout.sp, f"{prefix}.ulysses_sequence_parallel_size")
            check_ep_layout(model_config, layout.ep, ep_key)
    ref = arr.ref
    if cfg.uses_reference and ref.fsdp_config.fsdp_size != -1:
        try:
            ParallelLayout(world, fsdp_size=ref.fsdp_config.fsdp_size)
        except ValueError as err:
            raise ValueError(f"actor_rollout_ref.ref.fsdp_config.fsdp_size over {world} ranks: {err}") from err
    if cfg.uses_reference and ref.fsdp_config.expert_parallel_size > 1:
        key = "actor_rollout_ref.ref.fsdp_config.expert_parallel_size"
        ref_ep = ref.fsdp_config.expert_parallel_size
        try:
            ParallelLayout(world, ep=ref_ep)
        except ValueError as err:
            raise ValueError(f"{key}={ref_ep} over {world} ranks: {err}") from err
        ref_model = engines["ref"][1].model
        check_ep_layout(model_section_config(ref_model), ref_ep, key)
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
    """`actor_rollout_ref.rollout.tensor_model_parallel_size` of the PPO trainer: see `check_rollout_tensor_parallel`;
    it also runs colocated only (the split pool receives whole-model replicas)."""
    arr = cfg.actor_rollout_ref
    tp, key = arr.rollout.tensor_model_parallel_size, "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp > 1 and not arr.hybrid_engine:
        raise ValueError(
            f"{key}={tp} with actor_rollout_ref.hybrid_engine=False: the split rollout pool receives the weights by a "
            f"broadcast to whole-model replicas and cannot hold tensor-parallel shards yet; use {key}=1 or "
            "hybrid_engine=True"
        )
    check_rollout_tensor_parallel(arr.rollout, arr.model, cfg.trainer, cfg.ray_kwargs.ray_init.address,
                                  "actor_rollout_ref.", "the colocated pool")


def check_rollout_tensor_parallel(rollout: Any, model: Any, placement: Any, ray_address: str | None, prefix: str,
                                  pool: str) -> None:
    """`{prefix}rollout.tensor_model_parallel_size` divides the `pool`'s ranks (`placement`: nnodes x
    n_gpus_per_node) and the model's heads, key/value heads, MLP width (a mixture-of-experts model's routed experts
    instead, with `rollout.expert_parallel_size` equal to it) and vocabulary, on an engine that splits a replica
    where the workers run (the engine and mode are checked by the rollout's own config)."""
    tp, key = rollout.tensor_model_parallel_size, f"{prefix}rollout.tensor_model_parallel_size"
    if tp == 1:
        return
    if not rollout.backend_spec.tensor_parallel_on_cpu and placement.workers_on_cpu(ray_address):
        on_cpu = [name for name in backends_with("tensor_parallel") if rollout_spec(name).tensor_parallel_on_cpu]
        raise ValueError(
            f"{key}={tp} with {prefix}rollout.name={rollout.name!r} on CPU workers: that engine splits a "
            f"replica over accelerators only (on CPU it runs in a child process outside the trainer's ranks); use "
            f"{key}=1, name={' or '.join(on_cpu)}, or GPU workers"
        )
    world = placement.nnodes * placement.n_gpus_per_node
    if world % tp:
        raise ValueError(
            f"{key}={tp} does not divide the {world} ranks of {pool} (trainer.nnodes x "
            f"trainer.n_gpus_per_node): each rollout replica takes {tp} consecutive ranks; pick a divisor of {world}"
        )
    model_config = model_section_config(model)
    check_rollout_tp_layout(model_config, tp, key)
    ep, ep_key = rollout.expert_parallel_size, f"{prefix}rollout.expert_parallel_size"
    check_ep_layout(model_config, ep, ep_key)  # a dense model has no experts to split
    # A mixture-of-experts model's experts are split whole over the group with ep=1 (verl's default) or ep=tp.


def hf_model_config(path: str, trust_remote_code: bool = False, overrides: Any = None) -> Any:
    """A model's HF config, with `overrides` (a model section's override_config) set on it as the engines set them.
    Imported here, not at the top: transformers and torch take seconds to import, and only the checks that read a
    model's shape need them (a config error prints before they load)."""
    from hybridflow.models.loader import load_model_config

    return load_model_config(path, trust_remote_code=trust_remote_code, overrides=overrides)


def model_section_config(model: Any) -> Any:
    """The HF config a model section (`*.model`) trains with: its checkpoint's, with its override_config."""
    return hf_model_config(model.path, model.trust_remote_code, getattr(model, "hf_config_overrides", None))


def check_token_budgets(cfg: PPOConfig) -> None:
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
