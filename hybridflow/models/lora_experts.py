"""LoRA on a mixture-of-experts model's 3-D expert weights (peft's `ParamWrapper`, from `target_parameters`): where
each adapter's tensors and its weight sit among a peft model's parameter names, and its merge.

peft wraps an experts module once per targeted weight, the wrappers nested in the order the module registers the
weights: with `gate_up_proj` and `down_proj` targeted, `mlp.experts.base_layer` holds `gate_up_proj`'s adapter
(the inner wrapper) and `mlp.experts` holds `down_proj`'s, and both weights are listed as
`mlp.experts.base_layer.base_layer.<name>`. An adapter of rank r on E experts keeps `lora_A` as (E * r, in), the
experts' blocks one after another, and `lora_B` as (out, r * E), the experts interleaved; expert e's update is
`B_e @ A_e * scale`, stored (E, out, in), or (E, in, out) where the experts module is `is_transposed` (gpt-oss).
The layout is read from the names, the adapter's `target_parameters` and that flag; tests check the merge against
peft's own `merge_and_unload`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ExpertAdapter", "expert_adapter_layout", "merge_expert_weight", "transposed_in"]

_LORA_A = ".lora_A.default.weight"
_LORA_B = ".lora_B.default.weight"
_BASE = ".base_layer"


@dataclass(frozen=True)
class ExpertAdapter:
    """One adapted 3-D expert weight: its adapter's peft prefix (`<prefix>.lora_A.default.weight`, `lora_B`), the
    weight's peft name, and whether it is stored (experts, in, out)."""

    prefix: str
    weight: str
    transposed: bool


def _targeted(module_name: str, param: str, targets: Sequence[str]) -> bool:
    full = f"{module_name}.{param}"
    return any(full == t or full.endswith(f".{t}") for t in targets)


def expert_adapter_layout(
    names: Sequence[str], target_parameters: Sequence[str], transposed: Callable[[str], bool]
) -> dict[str, ExpertAdapter]:
    """The expert adapters among a peft model's parameter `names` (in the model's order), by prefix.

    target_parameters: the adapter config's names (`mlp.experts.gate_up_proj` or `gate_up_proj`);
    transposed: whether the experts module of an HF module path stores its weights (experts, in, out).
    An adapter prefix followed by `.base_layer.weight` is a Linear's (merged elsewhere) and is left out."""
    present = set(names)
    wrappers: dict[str, list[tuple[int, str]]] = {}  # experts module's peft path -> (depth, adapter prefix)
    for name in names:
        if not name.endswith(_LORA_A):
            continue
        prefix = name[: -len(_LORA_A)]
        if f"{prefix}{_BASE}.weight" in present:
            continue
        module, depth = prefix, 0
        while module.endswith(_BASE):
            module, depth = module[: -len(_BASE)], depth + 1
        wrappers.setdefault(module, []).append((depth, prefix))
    layout = {}
    for module, found in wrappers.items():
        depth = len(found)
        base = module + _BASE * depth + "."
        hf_module = _hf_path(module)
        weights = [n for n in names if n.startswith(base) and "." not in n[len(base):]
                   and _targeted(hf_module, n[len(base):], target_parameters)]
        if len(weights) != depth:
            raise ValueError(
                f"LoRA on experts: {module} has {depth} adapters but {len(weights)} targeted weights {weights}"
            )
        for wrapper_depth, prefix in found:  # the innermost wrapper (deepest) holds the first weight
            weight = weights[depth - 1 - wrapper_depth]
            layout[prefix] = ExpertAdapter(prefix, weight, transposed(hf_module))
    return layout


def _hf_path(peft_path: str) -> str:
    return peft_path.removeprefix("base_model.model.")


def transposed_in(model: torch.nn.Module) -> Callable[[str], bool]:
    """`transposed` for `expert_adapter_layout` from a model holding the experts modules under their HF paths
    (a plain HF model, or a peft model's base model with its wrappers)."""

    def transposed(hf_module_path: str) -> bool:
        module = model.get_submodule(hf_module_path)
        while hasattr(module, "get_base_layer") and module.get_base_layer() is not module:
            module = module.get_base_layer()
        return bool(getattr(module, "is_transposed", False))

    return transposed


def merge_expert_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale_of_rank: Callable[[int], float],
    transposed: bool,
) -> torch.Tensor:
    """weight: (E, out, in), or (E, in, out) when `transposed`; lora_a: (E * r, in); lora_b: (out, r * E)
    -> weight + each expert's `B_e @ A_e * scale(r)`, in weight's dtype."""
    experts = weight.size(0)
    a = lora_a.float().reshape(experts, -1, lora_a.size(-1))  # (E, r, in)
    b = lora_b.float().reshape(lora_b.size(0), -1, experts).permute(2, 0, 1)  # (E, out, r)
    delta = torch.bmm(b, a) * scale_of_rank(a.size(1))  # (E, out, in)
    if transposed:
        delta = delta.transpose(1, 2)
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)
