"""`ModelConfig`: which weights a role loads and how they are adapted (verl's `*.model.*` keys)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Optional

from hybridflow.utils.config import ConfigFieldError, check_at_least, unsupported

__all__ = ["ATTN_IMPLEMENTATIONS", "CUDA_ONLY_ATTN", "cuda_only_attn_error", "FusedKernelOptions", "ModelConfig", "check_lora_adapter_path", "check_override_config"]


def check_lora_adapter_path(field_name: str, path: str | None, lora_rank: int,
                            adapter_settings: dict[str, Any] | None = None) -> None:
    """Raise unless `path` is None or a peft adapter directory (`~` expanded as the loader does). The adapter's own
    config sets the rank, alpha and targets (as in verl, the path alone turns LoRA on): a lora_rank, and any of
    `adapter_settings` (lora_alpha, target_modules, target_parameters, exclude_modules set off their defaults),
    given beside it must be the adapter's."""
    if path is None:
        return
    config_file = Path(path).expanduser() / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigFieldError(
            field_name,
            f"{field_name}={path!r} is not a peft adapter directory (no adapter_config.json); point it at an SFT "
            "checkpoint's lora_adapter/ folder",
        )
    adapter = json.loads(config_file.read_text())
    given = {"lora_rank": lora_rank, **(adapter_settings or {})} if lora_rank > 0 else dict(adapter_settings or {})
    for key, value in given.items():
        if _ADAPTER_KEYS[key] not in adapter:  # an older peft's config without it
            continue
        saved = adapter[_ADAPTER_KEYS[key]]
        if _adapter_value(key, value) != _adapter_value(key, saved):
            raise ConfigFieldError(
                key,
                f"{key}={value!r} differs from the adapter's {saved!r} at {field_name}={path!r}, whose config rules "
                f"the adapters; leave {key} unset or set it to the adapter's",
            )


_ADAPTER_KEYS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "target_modules": "target_modules",
                 "target_parameters": "target_parameters", "exclude_modules": "exclude_modules"}
"""Model keys and the peft adapter_config.json entries they set."""


def _adapter_value(key: str, value: Any) -> Any:
    """A setting as peft compares it: names as a set (target modules by their last part, as peft matches them
    and as a saved adapter lists them in full), a number as a float."""
    if isinstance(value, (list, tuple, set)):
        return frozenset(name.rsplit(".", 1)[-1] if key == "target_modules" else name for name in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2")
"""Attention kernels a training or log-prob forward may use (transformers' names)."""

CUDA_ONLY_ATTN = {
    "flash_attention_2": "flash-attn's kernels are CUDA ones",
    "flex_attention": (
        "torch has no CPU backward for it, and inductor's CPU kernel for the block masks of shared prompts and packed "
        "rows fails to compile (CppCompileError, torch 2.13)"
    ),
}
"""Attention kernels that run on CUDA ranks only, each with the reason."""


def cuda_only_attn_error(attn: str, device_type: str) -> str | None:
    """Why attention kernel `attn` cannot run on a `device_type` rank (None where it can)."""
    if device_type == "cuda" or attn not in CUDA_ONLY_ATTN:
        return None
    return (
        f"override_config.attn_implementation={attn!r} runs on CUDA ranks only ({CUDA_ONLY_ATTN[attn]}); "
        f"these ranks run on {device_type}: use sdpa there"
    )


MEGATRON_ONLY_OVERRIDES = ("model_config", "transformer_config")
"""verl's override_config sub-sections that configure Megatron-LM (its mcore model), not the HF config."""


def check_override_config(override_config: dict[str, Any]) -> None:
    """Refuse verl's Megatron-only override sections and unknown attention kernels; flash_attention_2 needs the
    flash-attn package, checked here so that a missing install fails before Ray. Other keys are HF config values
    (`ModelConfig.hf_config_overrides`), set on the model's config when it is built."""
    megatron = sorted(set(override_config) & set(MEGATRON_ONLY_OVERRIDES))
    if megatron:
        raise ConfigFieldError(
            "override_config",
            f"override_config[{megatron[0]!r}] configures verl's Megatron-LM models; hybridflow builds transformers "
            "models, whose HF config takes the values directly (e.g. +...override_config.max_position_embeddings=N)",
        )
    attn = override_config.get("attn_implementation", "sdpa")
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ConfigFieldError(
            "override_config.attn_implementation",
            f"override_config.attn_implementation={attn!r} is not known; use one of {list(ATTN_IMPLEMENTATIONS)}",
        )
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigFieldError(
            "override_config.attn_implementation",
            "override_config.attn_implementation='flash_attention_2' needs the flash-attn package (CUDA only: "
            "pip install flash-attn --no-build-isolation); use sdpa otherwise",
        )


@dataclass(frozen=True, kw_only=True)
class FusedKernelOptions:
    """How the fused vocabulary projection runs (verl's `fused_kernel_options.*`)."""

    impl_backend: str = "torch"
    """Implementation: torch (chunked matmuls and reductions, on every device); verl's triton backend is refused."""
    chunk_size: int = 1024
    """Rows projected to the vocabulary at once; the projection's memory is about 3 x chunk_size x vocab x 4 bytes.
    A hybridflow key: verl's torch backend uses 512."""

    def __post_init__(self) -> None:
        if self.impl_backend != "torch":
            raise ConfigFieldError(
                "impl_backend",
                f"impl_backend={self.impl_backend!r}: hybridflow's fused head is its torch one on every device "
                "(projection, log-softmax and entropy chunk by chunk, engines/training/chunked_projection.py); verl's "
                "triton kernels are not built. Set impl_backend=torch: the same log-probs and entropy, the memory "
                "bounded by chunk_size",
            )
        check_at_least("chunk_size", self.chunk_size, 1)


@dataclass(frozen=True, kw_only=True)
class TiledMLPConfig:
    """verl's `model.tiled_mlp.*` (TiledMLP: the MLP over sequence tiles)."""

    enabled: bool = unsupported(
        False, "the MLP runs over the whole sequence; enable_gradient_checkpointing saves activation memory"
    )
    """verl: tile the MLP."""
    num_shards: int = unsupported(4, "read only with tiled_mlp.enabled=True, which is not built")
    """verl: the tiles."""


_MTP = "multi-token prediction (MTP) training and speculative decoding are not built"
_MTP_ONLY = {flag: f"read only with mtp.{flag}=True, which is not built ({_MTP})"
             for flag in ("enable", "enable_train", "enable_rollout")}


@dataclass(frozen=True, kw_only=True)
class MTPConfig:
    """verl's `model.mtp.*` (multi-token prediction heads, trained and used for speculative decoding)."""

    enable: bool = unsupported(False, _MTP)
    """verl: use the model's MTP layers."""
    enable_train: bool = unsupported(False, _MTP)
    """verl: train them."""
    enable_rollout: bool = unsupported(False, _MTP)
    """verl: decode speculatively with them."""
    detach_encoder: bool = unsupported(False, _MTP_ONLY["enable"])
    """verl: read only with mtp.enable=True."""
    method: str = unsupported("mtp", _MTP_ONLY["enable"])
    """verl: read only with mtp.enable=True."""
    mtp_loss_scaling_factor: float = unsupported(0.1, _MTP_ONLY["enable_train"])
    """verl: read only with mtp.enable_train=True."""
    num_speculative_tokens: int = unsupported(1, _MTP_ONLY["enable_rollout"])
    """verl: read only with mtp.enable_rollout=True."""
    speculative_algorithm: str = unsupported("EAGLE", _MTP_ONLY["enable_rollout"])
    """verl: read only with mtp.enable_rollout=True."""
    speculative_eagle_topk: int = unsupported(2, _MTP_ONLY["enable_rollout"])
    """verl: read only with mtp.enable_rollout=True."""
    speculative_num_draft_tokens: int = unsupported(4, _MTP_ONLY["enable_rollout"])
    """verl: read only with mtp.enable_rollout=True."""
    speculative_num_steps: int = unsupported(2, _MTP_ONLY["enable_rollout"])
    """verl: read only with mtp.enable_rollout=True."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The weights of one model and the changes made to them before training."""

    path: str = "smollm2-135m-instruct"
    """A catalogue name (smollm2-135m-instruct), a local HF directory, or a .gguf file (`~` is expanded)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer location when it differs from path; None uses path."""
    trust_remote_code: bool = False
    """Allow model and tokenizer code shipped inside the checkpoint directory (transformers' trust_remote_code)."""
    enable_gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (saves memory, costs about 30% more compute)."""
    use_remove_padding: bool = False
    """Pack the non-pad tokens of a micro-batch into one row in training and log-prob forwards."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: float = 16
    """LoRA scaling numerator (update = lora_alpha / lora_rank * B @ A)."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get LoRA adapters: all-linear (every linear layer but the head) or a list of names [q_proj,v_proj] (a comma-separated string also works). Mixture-of-experts models take a list of Linear layers (e.g. [q_proj,k_proj,v_proj,o_proj]) and their experts through target_parameters."""
    target_parameters: Optional[list[str]] = None
    """A mixture-of-experts model's 3-D expert weights that get LoRA adapters as well (peft's target_parameters), e.g. [mlp.experts.gate_up_proj,mlp.experts.down_proj]: one rank-lora_rank adapter per expert, merged into the experts for the rollout and on export. Not with expert_parallel_size > 1."""
    exclude_modules: str | list[str] | None = None
    """Modules kept without LoRA adapters although target_modules matches them (verl's key, peft's
    exclude_modules): a list of names [o_proj,down_proj] (a comma-separated string also works), or a regex string
    matched against the full module name. Like target_modules it shapes the adapters, so without LoRA
    (lora_rank=0) there is nothing for it to change (verl's own test scripts pass DONT_EXCLUDE then)."""
    lora_adapter_path: Optional[str] = None
    """A peft adapter directory (e.g. an SFT checkpoint's lora_adapter/) to continue LoRA training from; it turns
    LoRA on by itself, with the adapter's rank, alpha and targets (its adapter_config.json), as in verl."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Values to override in the model's HF config (verl's key, set as +...override_config.KEY=VALUE), e.g.
    max_position_embeddings or rope_scaling; a dict value updates a sub-config (text_config). attn_implementation
    picks the attention kernel: sdpa (default), eager, flex_attention (CUDA ranks only), or flash_attention_2 (CUDA with the
    flash-attn package; packed rows run as variable-length batches). Applied to the training engines, the hf/native
    rollout's copy and the vllm engine (hf_overrides); refused with rollout tensor parallelism."""
    external_lib: Optional[str] = unsupported(None, "models are loaded from transformers' own classes only")
    """Python module imported to register custom model classes."""
    use_shm: bool = False
    """Copy the checkpoint to shared memory (/dev/shm) once per node and load it from there (verl's key): RAM-speed
    reads for every worker of the node, at the checkpoint's size in RAM. A catalogue name is its converted
    directory."""
    use_liger: bool = unsupported(False, "Liger kernels are not used; use_fused_kernels is the fused log-prob head")
    """verl: patch the model with Liger kernels."""
    use_fused_kernels: bool = True
    """Causal LMs: compute log-probs and entropy straight from the final hidden states, projecting
    fused_kernel_options.chunk_size positions to the vocabulary at a time and recomputing each chunk's logits in the
    backward, so the (positions x vocab) logits never exist at once (verl's fused linear-for-PPO). verl's
    actor.entropy_from_logits_with_chunking and actor.entropy_checkpointing save part of the same memory: both are
    taken with it, and refused without it."""
    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    """Backend and chunk size of the fused projection."""
    custom_chat_template: Optional[str] = None
    """A Jinja chat template that replaces the tokenizer's own (verl's key), wherever this model's tokenizer renders
    conversations: the driver's prompts and every worker's tokenizer."""
    enable_activation_offload: bool = False
    """Keep the tensors a training forward saves for its backward in host memory (pinned on accelerators) until the
    backward needs them (`torch.autograd.graph.save_on_cpu`; verl's key): activation memory on the accelerator for
    host-device copies. With enable_gradient_checkpointing only each layer's input is saved. On CPU ranks a no-op
    (they are in host memory already)."""
    hf_config_path: Optional[str] = unsupported(None, "the HF config is read from path, with override_config on top")
    """verl: an HF config read from another place than the weights."""
    tiled_mlp: TiledMLPConfig = field(default_factory=lambda: TiledMLPConfig())
    """verl: compute the MLP in sequence tiles to save activation memory."""
    mtp: MTPConfig = field(default_factory=lambda: MTPConfig())
    """verl: multi-token prediction (MTP) heads."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigFieldError("path", "path is empty; set a catalogue name, HF directory or .gguf file")
        if self.lora_rank < 0:
            raise ConfigFieldError("lora_rank", f"lora_rank={self.lora_rank} must be >= 0 (0 trains all weights)")
        check_lora_adapter_path("lora_adapter_path", self.lora_adapter_path, self.lora_rank, self.adapter_settings())
        if self.target_parameters and self.lora_rank <= 0:
            raise ConfigFieldError(
                "target_parameters", f"target_parameters={list(self.target_parameters)} adds LoRA adapters to expert "
                "weights: set lora_rank > 0 (or leave target_parameters unset)",
            )
        check_override_config(self.override_config)

    @property
    def hf_config_overrides(self) -> dict[str, Any]:
        """override_config without attn_implementation (which transformers takes as a loading argument)."""
        return {key: value for key, value in self.override_config.items() if key != "attn_implementation"}

    @property
    def attn_implementation(self) -> str:
        """The attention kernel the model runs with: override_config.attn_implementation, or sdpa."""
        return self.override_config.get("attn_implementation", "sdpa")

    @property
    def use_lora(self) -> bool:
        """True when the engine trains LoRA adapters instead of all weights."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None

    @property
    def lora_target_modules(self) -> str | tuple[str, ...]:
        """`target_modules` as peft takes it: 'all-linear' or a tuple of module names."""
        modules = self.target_modules
        return modules if modules == "all-linear" else _name_tuple(modules)

    @property
    def lora_exclude_modules(self) -> str | tuple[str, ...] | None:
        """`exclude_modules` as peft takes it: None, a regex string, or a tuple of module names."""
        modules = self.exclude_modules
        if modules is None or (isinstance(modules, str) and not _is_name_list(modules)):
            return modules
        return _name_tuple(modules)

    @property
    def lora_target_parameters(self) -> tuple[str, ...]:
        """`target_parameters` as a tuple of weight names (a comma-separated string also works)."""
        return _name_tuple(self.target_parameters or ())

    def adapter_settings(self) -> dict[str, Any]:
        """The adapter-shaping keys set off their defaults, as peft takes them (what a `lora_adapter_path`'s own
        config must agree with)."""
        values = {"lora_alpha": self.lora_alpha, "target_modules": self.lora_target_modules,
                  "target_parameters": self.lora_target_parameters or None,
                  "exclude_modules": self.lora_exclude_modules}
        defaults = {item.name: item.default for item in dataclasses.fields(self) if item.name in values}
        return {key: value for key, value in values.items() if getattr(self, key) != defaults[key]}

    @property
    def tokenizer_location(self) -> str:
        """Where the tokenizer is loaded from."""
        return self.tokenizer_path or self.path


def _name_tuple(names: str | Sequence[str]) -> tuple[str, ...]:
    """Names given as a list or as one comma-separated string, stripped, empty ones dropped."""
    names = names.split(",") if isinstance(names, str) else names
    return tuple(name.strip() for name in names if name.strip())


def _is_name_list(text: str) -> bool:
    """Whether `text` is module names separated by commas (o_proj,down_proj) rather than a regex (.*o_proj)."""
    return all(part.strip().isidentifier() for part in text.split(",") if part.strip())
