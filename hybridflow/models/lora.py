"""LoRA adapters (peft) on HF causal LMs, and merging adapters back into plain HF weights.

`apply_lora` wraps a model in a peft `PeftModel` (new adapter, or an existing adapter directory to keep
training). Parameter names then change from `model.layers.0.self_attn.q_proj.weight` to
`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` plus `...q_proj.lora_A.default.weight`
and `...q_proj.lora_B.default.weight`. The merge helpers turn such names and tensors back into the plain HF
ones, with `W + scaling * B @ A` for every adapted weight:

- `merge_lora_named_tensors` works on a stream of `(name, tensor)` pairs (the rollout weight hand-over),
  holding at most one adapted module's tensors at a time;
- `merge_lora_state_dict` works on a whole state dict (exporting a checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridflow.models.lora_experts import ExpertAdapter, expert_adapter_layout, merge_expert_weight, transposed_in

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_LORA_A = f".lora_A.{ADAPTER_NAME}.weight"
_LORA_B = f".lora_B.{ADAPTER_NAME}.weight"
_BASE = ".base_layer."


@dataclass(frozen=True)
class LoraScaling:
    """How an adapter's update is scaled: `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).

    `r` is read from each module's `lora_A` (so per-module ranks work); `fan_in_fan_out` transposes the update
    (GPT-2 style Conv1D weights).
    """

    lora_alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    target_parameters: tuple[str, ...] = ()
    """3-D expert weights with adapters (peft's `target_parameters`; merged by `lora_experts`)."""

    def scale(self, rank: int) -> float:
        """The factor of `B @ A` for an adapter of rank `rank`."""
        return self.lora_alpha / (math.sqrt(rank) if self.use_rslora else rank)

    @classmethod
    def from_adapter_config(cls, config: Mapping[str, Any]) -> LoraScaling:
        """From a peft `adapter_config.json` dict; refuses features whose merge is not `W + s * B @ A`."""
        unsupported = {
            key: config.get(key)
            for key in ("use_dora", "alpha_pattern", "lora_bias", "modules_to_save", "trainable_token_indices")
            if config.get(key)
        }
        if config.get("peft_type", "LORA") not in ("LORA", "PeftType.LORA"):
            unsupported["peft_type"] = config.get("peft_type")
        if unsupported:
            raise ValueError(f"cannot merge this adapter: unsupported adapter_config settings {unsupported}")
        return cls(
            lora_alpha=float(config["lora_alpha"]),
            use_rslora=bool(config.get("use_rslora", False)),
            fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
            target_parameters=tuple(sorted(config.get("target_parameters") or ())),
        )


def apply_lora(
    model: nn.Module,
    *,
    lora_rank: int,
    lora_alpha: float,
    target_modules: str | list[str] = "all-linear",
    adapter_path: str | os.PathLike | None = None,
    target_parameters: Sequence[str] = (),
    exclude_modules: str | Sequence[str] | None = None,
) -> nn.Module:
    """Wrap `model` in a peft LoRA model whose only trainable parameters are the adapters.

    Args:
        model: an HF causal LM (base weights are frozen in place).
        lora_rank: adapter rank r (> 0); ignored when `adapter_path` is given (its config rules).
        lora_alpha: scaling numerator (update = alpha / r * B @ A).
        target_modules: 'all-linear' (every linear layer except the output head), or module names
            such as ['q_proj', 'v_proj'].
        adapter_path: a directory written by peft's `save_pretrained` (adapter_config.json + weights)
            to continue training that adapter.
        target_parameters: a mixture-of-experts model's 3-D expert weights to adapt as well, e.g.
            ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'] (one rank-r adapter per expert).
        exclude_modules: modules `target_modules` matches that get no adapter (names, or a regex string).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path is None and lora_rank <= 0:
        raise ValueError(f"lora_rank must be > 0 to add adapters, got {lora_rank}")
    if adapter_path is not None:
        adapter_path = Path(adapter_path).expanduser()  # as ModelConfig checked it
    if adapter_path is not None and not (Path(adapter_path) / ADAPTER_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"LoRA adapter path {adapter_path} holds no {ADAPTER_CONFIG_FILE}")
    with warnings.catch_warnings():
        # peft 0.21 calls transformers' deprecated `is_gradient_checkpointing`; the warning is not ours to fix.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if adapter_path is not None:
            logger.info("loading LoRA adapter from %s", adapter_path)
            return PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)
        targets = target_modules if isinstance(target_modules, str) else list(target_modules)
        config = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0, bias="none",
            task_type="CAUSAL_LM", target_parameters=list(target_parameters) or None,
            exclude_modules=exclude_modules if exclude_modules is None or isinstance(exclude_modules, str)
            else list(exclude_modules),
        )
        if target_parameters:
            check_expert_targets(model, target_parameters)
        peft_model = get_peft_model(model, config)
    check_no_expert_adapters(peft_model, target_modules, target_parameters)
    if not isinstance(targets, str):
        check_targets_matched(targets, list(peft_model.targeted_module_names), model)
    return peft_model


MOE_LORA_FIX = (
    "target the attention projections with target_modules=[q_proj,k_proj,v_proj,o_proj], and the experts with "
    "target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
)


def check_expert_targets(model: nn.Module, target_parameters: Sequence[str]) -> None:
    """Each `target_parameters` name must end the name of a 3-D (experts, ., .) weight of `model`."""
    expert_weights = [name for name, param in model.named_parameters() if param.dim() == 3]
    for target in target_parameters:
        if not any(name == target or name.endswith(f".{target}") for name in expert_weights):
            known = sorted({".".join(name.split(".")[-3:]) for name in expert_weights}) or "none: a dense model"
            raise ValueError(
                f"LoRA target_parameters entry {target!r} names no 3-D expert weight of this model (its expert "
                f"weights: {known})"
            )


def check_no_expert_adapters(
    peft_model: nn.Module, target_modules: str | list[str], target_parameters: Sequence[str] = ()
) -> None:
    """Refuse adapters that peft put on a mixture-of-experts model's 3-D weights or routers without being asked
    through `target_parameters` (peft 0.21 wraps them, as `ParamWrapper`s, under 'all-linear')."""
    asked = {t.rsplit(".", 1)[-1] for t in target_parameters}
    wrapped = sorted({prefix for prefix in (name.split(".lora_")[0] for name, _ in peft_model.named_parameters()
                                            if ".lora_" in name)
                      if _is_param_wrapper(peft_model, prefix)
                      and peft_model.get_submodule(prefix).parameter_name not in asked})
    if wrapped:
        raise ValueError(
            f"LoRA target_modules={target_modules!r} puts adapters on this mixture-of-experts model's expert weights "
            f"or routers ({wrapped[0]}, ... {len(wrapped)} in all), which target_parameters did not ask for: "
            f"{MOE_LORA_FIX}"
        )


def _is_param_wrapper(model: nn.Module, module_name: str) -> bool:
    return type(model.get_submodule(module_name)).__name__ == "ParamWrapper"


def check_targets_matched(targets: list[str], wrapped: list[str], model: nn.Module) -> None:
    """Refuse `target_modules` names that wrapped no layer (peft only warns, and trains the others): in an MoE
    model `gate_up_proj` / `down_proj` name the experts' 3-D weights, which LoRA does not wrap."""
    unmatched = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in wrapped)]
    if not unmatched:
        return
    expert_weights = {name.rsplit(".", 1)[-1] for name, param in model.named_parameters() if param.dim() == 3}
    reason = (
        f"{sorted(set(unmatched) & expert_weights)} are this mixture-of-experts model's expert weights (3-D "
        "parameters, not Linear layers), which LoRA adapters do not wrap; "
        if set(unmatched) & expert_weights else ""
    )
    fix = MOE_LORA_FIX if expert_weights else (
        f"target the Linear layers that exist (it wrapped {sorted({n.rsplit('.', 1)[-1] for n in wrapped})}) or use "
        "'all-linear'"
    )
    raise ValueError(f"lora target_modules {unmatched} matched no layer of the model: {reason}{fix}")


def is_lora_model(module: nn.Module) -> bool:
    """True for peft models (also after FSDP2 wrapping, which subclasses the module's class)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def lora_scaling_of(module: nn.Module) -> LoraScaling:
    """The scaling rule of the active adapter of a peft model."""
    config = module.peft_config[ADAPTER_NAME].to_dict()
    return LoraScaling.from_adapter_config({**config, "peft_type": "LORA"})


def expert_adapters_of(module: nn.Module, scaling: LoraScaling) -> dict[str, ExpertAdapter]:
    """A peft model's adapters on 3-D expert weights (`lora_experts.expert_adapter_layout`), by prefix; `scaling`:
    its `lora_scaling_of`."""
    names = [name for name, _ in module.named_parameters()]
    return expert_adapter_layout(names, scaling.target_parameters, transposed_in(module.get_base_model()))


def save_adapter_config(module: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the adapter's `adapter_config.json` (no weights) into `directory`; returns the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module.peft_config[ADAPTER_NAME].save_pretrained(str(directory))
    return directory / ADAPTER_CONFIG_FILE


def load_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The `adapter_config.json` dict in `directory`."""
    return json.loads((Path(directory) / ADAPTER_CONFIG_FILE).read_text())


def to_hf_name(name: str) -> str:
    """A peft parameter name without the peft wrapping: `base_model.model.X.base_layer.weight` -> `X.weight`."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    while _BASE in name:  # nested wrappers (one per adapted expert weight) stack several
        name = name.replace(_BASE, ".")
    return name


def _lora_module(name: str) -> tuple[str, str] | None:
    """('module prefix', 'A'|'B'|'W') when `name` belongs to an adapted linear layer's weight, else None."""
    if name.endswith(_LORA_A):
        return name[: -len(_LORA_A)], "A"
    if name.endswith(_LORA_B):
        return name[: -len(_LORA_B)], "B"
    if name.endswith(_BASE + "weight"):
        return name[: -len(_BASE + "weight")], "W"
    return None


def merge_lora_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: LoraScaling
) -> torch.Tensor:
    """weight: (out, in); lora_a: (r, in); lora_b: (out, r) -> weight + scale(r) * lora_b @ lora_a, in weight's dtype.

    With `fan_in_fan_out` the weight is (in, out) and the update is transposed.
    """
    delta = lora_b.float() @ lora_a.float() * scaling.scale(lora_a.size(0))
    if scaling.fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def merge_lora_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    scaling: LoraScaling,
    experts: Mapping[str, ExpertAdapter] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain HF `(name, tensor)` pairs from a peft model's pairs, adapters merged into their base weights.

    Non-adapted tensors pass through renamed. An adapted module's base weight, `lora_A` and `lora_B` are held
    until all three arrived (peft lists them one after another), so at most one module is buffered; an experts
    module's weights wait for their adapters (`experts`: `lora_experts.expert_adapter_layout`).
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    expert_parts = _ExpertParts(experts or {}, scaling)
    for name, tensor in named_tensors:
        taken = expert_parts.take(name, tensor)
        if taken is not None:
            yield from taken
            continue
        part = _lora_module(name)
        if part is None:
            yield to_hf_name(name), tensor
            continue
        prefix, kind = part
        parts = pending.setdefault(prefix, {})
        parts[kind] = tensor
        if len(parts) == 3:
            del pending[prefix]
            yield to_hf_name(prefix) + ".weight", merge_lora_weight(parts["W"], parts["A"], parts["B"], scaling)
    if pending:
        raise ValueError(f"incomplete LoRA modules (need base weight, lora_A and lora_B): {sorted(pending)[:3]}")
    expert_parts.check_done()


class _ExpertParts:
    """Buffers an expert adapter's weight, `lora_A` and `lora_B` until all three arrived, then merges them."""

    def __init__(self, experts: Mapping[str, ExpertAdapter], scaling: LoraScaling) -> None:
        self.scaling = scaling
        self.role: dict[str, tuple[ExpertAdapter, str]] = {}
        for adapter in experts.values():
            self.role[adapter.weight] = (adapter, "W")
            self.role[adapter.prefix + _LORA_A] = (adapter, "A")
            self.role[adapter.prefix + _LORA_B] = (adapter, "B")
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """None when `name` is not an expert adapter's; else the merged weight it completes (or nothing yet)."""
        if name not in self.role:
            return None
        adapter, kind = self.role[name]
        parts = self.pending.setdefault(adapter.prefix, {})
        parts[kind] = tensor
        if len(parts) < 3:
            return []
        del self.pending[adapter.prefix]
        merged = merge_expert_weight(parts["W"], parts["A"], parts["B"], self.scaling.scale, adapter.transposed)
        return [(to_hf_name(adapter.weight), merged)]

    def check_done(self) -> None:
        if self.pending:
            raise ValueError(
                f"incomplete expert LoRA adapters (need the weight, lora_A and lora_B): {sorted(self.pending)[:3]}"
            )


def merge_lora_state_dict(
    state_dict: Mapping[str, torch.Tensor], scaling: LoraScaling, experts: Mapping[str, ExpertAdapter] | None = None
) -> dict[str, torch.Tensor]:
    """A plain HF state dict from a peft model's state dict (adapters merged); other dicts pass through renamed."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    expert_parts = _ExpertParts(experts or {}, scaling)
    for name, tensor in state_dict.items():
        taken = expert_parts.take(name, tensor)
        if taken is not None:
            merged.update(taken)
            continue
        part = _lora_module(name)
        if part is None:
            merged[to_hf_name(name)] = tensor
        else:
            grouped.setdefault(part[0], {})[part[1]] = tensor
    for prefix, parts in grouped.items():
        if len(parts) != 3:
            raise ValueError(f"LoRA module {prefix} has only {sorted(parts)} (needs W, A and B)")
        merged[to_hf_name(prefix) + ".weight"] = merge_lora_weight(parts["W"], parts["A"], parts["B"], scaling)
    expert_parts.check_done()
    return merged


def has_lora_weights(names: Iterable[str]) -> bool:
    """True when any name is a LoRA adapter weight."""
    return any(name.endswith((_LORA_A, _LORA_B)) for name in names)


def save_hf_model_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    path: str | os.PathLike,
    *,
    scaling: LoraScaling | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a plain HF model directory (config + safetensors) from a full state dict.

    Args:
        state_dict: full tensors, plain HF names or peft names (adapters are merged when `scaling` is given).
        hf_config: the model's `PretrainedConfig`.
        path: output directory (created).
        scaling: the adapter's scaling rule; required when the state dict holds LoRA weights.
        dtype: cast floating-point weights to this dtype (default: keep them).

    Raises:
        ValueError: LoRA weights without `scaling`, or keys that do not match the architecture.
    """
    from hybridflow.models.loader import causal_lm_class

    if scaling is None and has_lora_weights(state_dict):
        raise ValueError("the state dict holds LoRA weights: pass the adapter's scaling to merge them")
    model = causal_lm_class(hf_config).from_config(hf_config, dtype=dtype or next(iter(state_dict.values())).dtype)
    if scaling is not None:
        experts = expert_adapter_layout(list(state_dict), scaling.target_parameters, transposed_in(model))
        merged = merge_lora_state_dict(state_dict, scaling, experts)
    else:
        merged = {to_hf_name(key): value for key, value in state_dict.items()}
    if dtype is not None:
        merged = {key: value.to(dtype) if value.is_floating_point() else value for key, value in merged.items()}
    missing, unexpected = model.load_state_dict(merged, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if hf_config.tie_word_embeddings else set()
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def save_lora_adapter(
    module: nn.Module, adapter_tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike
) -> Path:
    """Write a peft adapter directory (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained` (and `model.lora_adapter_path`) loads.

    Args:
        module: the peft model (for its adapter config).
        adapter_tensors: full `lora_A` / `lora_B` tensors under the model's parameter names.
        directory: output directory (created).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    save_adapter_config(module, directory)
    # peft stores adapter weights without the adapter name: `...q_proj.lora_A.weight`.
    tensors = {
        name.replace(f".{ADAPTER_NAME}.weight", ".weight"): tensor.detach().cpu().contiguous()
        for name, tensor in adapter_tensors.items()
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory
