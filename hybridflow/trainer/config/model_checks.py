"""The models a PPO run names, checked before Ray starts or weights load: each location holds weights, a teacher
is used, PRIME's implicit reward model and a reward model have the right heads, and the sequence fits the
context."""

from __future__ import annotations

import json

from hybridflow.data.config import expand_path
from hybridflow.models.config import cuda_only_attn_error
from hybridflow.models.forward_support import packing_unsupported_reason
from hybridflow.models.moe_shape import is_moe_config, moe_routing_unsupported_reason
from hybridflow.trainer.config.parallel_checks import engine_configs, hf_model_config
from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.utils.config import changed_leaves

# Architectures a reward model checkpoint may have: one score per sequence (or per token, read at the last one).
REWARD_MODEL_HEADS = ("ForSequenceClassification", "ForTokenClassification")


def check_teacher(cfg: PPOConfig) -> None:
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


def check_prime(cfg: PPOConfig) -> None:
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
        architectures = getattr(hf_model_config(location), "architectures", None) or []
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
    "reward_model.model": ("update", "ref_path", "beta_train", "optim"),  # only PRIME's reward model trains
    "reward_model.model.fsdp_config": ("optimizer_offload",),
    "reward_model": ("prime_granularity", "prime_norm"),
    "algorithm": ("reward_dpo_coef", "reward_gt_coef"),
}
"""PRIME's settings, by section."""


def check_prime_keys_unused(cfg: PPOConfig) -> None:
    """PRIME's settings configure nothing in other runs: one changed from its section's default is refused, not
    ignored."""
    if cfg.uses_prime:
        return
    sections = {"reward_model.model": cfg.reward_model.model, "reward_model.model.fsdp_config":
                cfg.reward_model.model.fsdp_config, "reward_model": cfg.reward_model, "algorithm": cfg.algorithm}
    for prefix, section in sections.items():
        defaults = type(section)()
        for name in _PRIME_FIELDS[prefix]:
            for key, value, _ in changed_leaves(f"{prefix}.{name}", getattr(section, name), getattr(defaults, name)):
                raise ValueError(
                    f"{key}={value!r} configures PRIME's implicit process reward model, but "
                    f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}; set algorithm.adv_estimator=prime or "
                    "drop it"
                )


_REWARD_MODEL_WORKER_KEYS = ("micro_batch_size_per_gpu", "micro_batch_size", "max_length")
"""`reward_model.*` keys that configure the reward model's worker (its model section aside)."""


def check_reward_model_keys_unused(cfg: PPOConfig) -> None:
    """Without a reward model (reward_model.enable=False, not PRIME) its settings configure nothing: a
    reward_model.model.path given without enable=True would train on the rule scorers' rewards, with no word.
    Keys that follow other sections by default (verl's interpolations) are left out."""
    from hybridflow.trainer.config.schema import PPO_DERIVED
    from hybridflow.workers.reward_config import RewardModelModelConfig, RewardModelWorkerConfig

    if cfg.reward_model.enable or cfg.uses_prime:
        return
    section, defaults = cfg.reward_model, RewardModelWorkerConfig()
    leaves = changed_leaves("reward_model.model", section.model, RewardModelModelConfig())
    for name in _REWARD_MODEL_WORKER_KEYS:
        leaves += changed_leaves(f"reward_model.{name}", getattr(section, name), getattr(defaults, name))
    for key, value, _ in leaves:
        if key not in PPO_DERIVED:
            raise ValueError(
                f"{key}={value!r} configures the reward model, but reward_model.enable=False: the rewards come from "
                "the rule scorers (or custom_reward_function); set reward_model.enable=True to score with the model, "
                "or drop it"
            )


def check_reward_model(cfg: PPOConfig) -> None:
    """The reward model is a local classification checkpoint with one label (a generative judge: a causal LM),
    used for inference only."""
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
    if cfg.generative_reward_model:
        if not any(name.endswith("ForCausalLM") for name in architectures):
            raise ValueError(
                f"reward_model.model.path={model.path!r} lists architectures {architectures or 'none'}, but a "
                "generative reward model (a custom reward function with use_reward_loop=True) is a ...ForCausalLM "
                "checkpoint that the function asks for judgements"
            )
        return
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


def model_config_json(model_path: str) -> dict | None:
    """A model directory's config.json (catalogue models once converted), or None where there is none yet (a .gguf
    file, a catalogue model before its first conversion)."""
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
    return json.loads(config_file.read_text())


def model_context_length(model_path: str, overrides: dict | None = None) -> int | None:
    """max_position_embeddings from the model's config overrides (`model.override_config`) or its config.json,
    else None."""
    if overrides and "max_position_embeddings" in overrides:
        return overrides["max_position_embeddings"]
    config = model_config_json(model_path)
    return None if config is None else config.get("max_position_embeddings")


def check_rollout_model(cfg: PPOConfig) -> None:
    """The rollout backend can run the actor's model (its spec's `model_check` on config.json, e.g. the native
    engine runs Llama-family attention only): another model is refused now, not when a worker builds it."""
    arr = cfg.actor_rollout_ref
    spec = arr.rollout.backend_spec
    config = None if spec.model_check is None else model_config_json(arr.model.path)
    reason = None if config is None else spec.unsupported_model_reason(config)
    if reason is not None:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={arr.rollout.name!r} cannot run actor_rollout_ref.model.path="
            f"{arr.model.path!r}: {reason}; set actor_rollout_ref.rollout.name=hf"
        )


def check_lora_on_experts(cfg: PPOConfig) -> None:
    """LoRA on a mixture-of-experts actor: 'all-linear' would put adapters on the experts and routers without being
    asked (peft 0.21 does), so it is refused naming the keys that do it; `target_parameters` (adapters on the
    experts' 3-D weights) must name expert weights of the model, with LoRA on, and without expert parallelism (each
    rank would hold part of the experts but all of an adapter)."""
    model = cfg.actor_rollout_ref.model
    targets = model.lora_target_parameters
    if model.lora_rank <= 0 or model.lora_adapter_path:
        return
    config = model_config_json(model.path) or {}
    if is_moe_config(config) and isinstance(model.target_modules, str) and model.target_modules.lower() == "all-linear":
        raise ValueError(
            "actor_rollout_ref.model.target_modules='all-linear' with LoRA on a mixture-of-experts model "
            f"({config.get('model_type')!r}) would put adapters on its experts and routers; set "
            "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj], and for the experts "
            "actor_rollout_ref.model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
        )
    if not targets:
        return
    ep = cfg.actor_rollout_ref.actor.fsdp_config.expert_parallel_size
    if ep > 1:
        raise ValueError(
            f"actor_rollout_ref.model.target_parameters={list(targets)} with "
            f"actor_rollout_ref.actor.fsdp_config.expert_parallel_size={ep}: LoRA on experts is not with expert "
            "parallelism (each rank holds part of the experts); set expert_parallel_size=1 or drop target_parameters"
        )
    if config:
        from hybridflow.models.lora import check_expert_targets

        from hybridflow.models.loader import build_causal_lm

        # the architecture on the meta device: parameter names and shapes, no weights read
        architecture = build_causal_lm(
            model.path, empty=True, attn_implementation=None, trust_remote_code=model.trust_remote_code
        )
        try:
            check_expert_targets(architecture, targets)
        except ValueError as err:
            raise ValueError(f"actor_rollout_ref.model.target_parameters: {err}") from err


MODEL_SECTIONS = {"actor": "actor_rollout_ref.model", "ref": "actor_rollout_ref.model", "critic": "critic.model",
                  "reward_model": "reward_model.model"}
"""Where each training engine's model settings live (the reference follows the actor's)."""


def check_forward_support(cfg: PPOConfig) -> None:
    """Packed rows, for each trained model: refused where its config says they would compute other log-probs or
    values than its own padded forward (`models.forward_support`; the engine probes the loaded model again at
    start, its fused head too)."""
    for role, (section, engine) in engine_configs(cfg).items():
        config = model_config_json(engine.model.path) or {}
        model_key = MODEL_SECTIONS[role]
        packed = engine.model.use_remove_padding or engine.share_prompts
        reason = packing_unsupported_reason(config) if packed else None
        if reason is not None:
            keys = f"{model_key}.use_remove_padding=False"
            if engine.share_prompts:
                keys += " and actor_rollout_ref.actor.use_prefix_grouper=False"
            raise ValueError(f"{section}: packed rows are wrong for {engine.model.path!r}: {reason}; set {keys}")
        if config.get("model_type") and engine.attn_implementation == "sdpa" and not _has_sdpa(engine.model):
            raise ValueError(
                f"{section}: {engine.model.path!r} ({config.get('model_type')!r}) has no sdpa attention in "
                f"transformers (the default kernel); set +{model_key}.override_config.attn_implementation=eager"
            )


def check_attention_kernels_on_cpu(cfg: PPOConfig) -> None:
    """CUDA-only attention kernels (`models.config.CUDA_ONLY_ATTN`) refused for trained and scoring models whose
    workers certainly run on CPU (`WorkerPlacement.workers_on_cpu`); on a cluster joined by address the engine
    refuses them once its device is known."""
    if not cfg.trainer.workers_on_cpu(cfg.ray_kwargs.ray_init.address):
        return
    for role, (section, engine) in engine_configs(cfg).items():
        error = cuda_only_attn_error(engine.attn_implementation, "cpu")
        if error is not None:
            raise ValueError(f"{MODEL_SECTIONS[role]}.{error}")


def _has_sdpa(model) -> bool:
    """Whether transformers' causal-LM class of the model's family runs sdpa attention (True where unknown)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = hf_model_config(model.path, trust_remote_code=model.trust_remote_code)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return bool(getattr(model_class, "_supports_sdpa", True)) if model_class is not None else True


def check_moe_routing(cfg: PPOConfig) -> None:
    """Router replay and the router losses of a mixture-of-experts actor: refused for a family whose routers the
    engine does not hook or cannot replay (they would be skipped, or weigh the replayed experts wrongly)."""
    arr = cfg.actor_rollout_ref
    config = model_config_json(arr.model.path) or {}
    config = config.get("text_config") or config
    if arr.actor.router_replay.mode == "R3":
        reason = moe_routing_unsupported_reason(config, replay=True)
        if reason is not None:
            raise ValueError(
                f"actor_rollout_ref.actor.router_replay.mode='R3' cannot replay {arr.model.path!r}'s routing: "
                f"{reason}; "
                "set actor_rollout_ref.actor.router_replay.mode=disabled and "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=False"
            )
    aux, z = config.get("router_aux_loss_coef") or 0, config.get("router_z_loss_coef") or 0
    if config.get("output_router_logits") and (aux or z):
        reason = moe_routing_unsupported_reason(config, replay=False)
        if reason is not None:
            raise ValueError(
                f"{arr.model.path!r}'s config.json sets output_router_logits with router_aux_loss_coef={aux} / "
                f"router_z_loss_coef={z}, but the engine cannot add its router losses: {reason}; set "
                "output_router_logits=false in that config.json"
            )


def check_lora_with_lone_param_offload(cfg: PPOConfig) -> None:
    """LoRA with `param_offload` on one GPU: the lone rank joins a one-rank process group for FSDP2's CPU offload,
    and LoRA under FSDP2's bf16 mixed precision over a one-rank CUDA group fails (`sharding.check_one_rank_lora`);
    refused before Ray starts where this machine's workers get a GPU. A cluster joined by address with
    trainer.device=auto is checked by the engine once its device is known."""
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    fsdp = arr.actor.fsdp_config
    if not arr.model.use_lora or not fsdp.param_offload or trainer.world_size != 1 or trainer.device == "cpu":
        return
    import torch  # here: most configs never reach this line

    from hybridflow.models.loader import resolve_dtype
    from hybridflow.utils.device import device_count

    if resolve_dtype(fsdp.compute_dtype, torch.device("cuda")) == torch.float32:
        return
    if trainer.device == "cuda" or device_count() > 0:
        raise ValueError(
            "actor_rollout_ref.actor.fsdp_config.param_offload=True with LoRA (actor_rollout_ref.model.lora_rank="
            f"{arr.model.lora_rank}) on one GPU: offload runs FSDP2 over a one-rank process group, where LoRA's bf16 "
            "update fails on CUDA; set param_offload=False (a LoRA run's frozen base weights stay on the GPU), or "
            "actor_rollout_ref.actor.fsdp_config.dtype=float32"
        )


def check_lengths(cfg: PPOConfig) -> None:
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    model = cfg.actor_rollout_ref.model
    context = model_context_length(model.path, model.hf_config_overrides)
    if context is not None and total > context:
        raise ValueError(
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's context of {context} "
            f"tokens ({model.path}); lower one of them, or raise it with "
            "+actor_rollout_ref.model.override_config.max_position_embeddings=N where the model's positions extend"
        )


def check_config_overrides_reach_the_rollout(cfg: PPOConfig) -> None:
    """The HF config overrides reach every model the run builds: not the shards of the hf/native tensor-parallel
    rollout (vllm, which reads its engine keys from the section, takes them as its `hf_overrides`, split or not)."""
    rollout = cfg.actor_rollout_ref.rollout
    model, tp = cfg.actor_rollout_ref.model, rollout.tensor_model_parallel_size
    if model.hf_config_overrides and tp > 1 and not rollout.backend_spec.reads_engine_keys:
        raise ValueError(
            f"actor_rollout_ref.model.override_config sets {sorted(model.hf_config_overrides)} and "
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: the tensor-parallel rollout builds its "
            "shards from the checkpoint's own config; set tensor_model_parallel_size=1 or drop the overrides"
        )
