"""Rollout engines behind one interface (`BaseRollout`), looked up by name in `ROLLOUTS`.

    rollout = ROLLOUTS.get("hf")(model_or_path, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=256))
    batch = rollout.generate_sequences(prompts)

`hf` (transformers' `generate`) and `native` (continuous batching over a preallocated KV cache, Llama/Qwen2
models) are always available. `vllm` (a vLLM engine; optional, see `vllm.py`) registers lazily: its module is
imported when the name is first requested, and without the vllm package that raises ImportError with the
install command.
"""

from __future__ import annotations

from hybridflow.engines.rollout.base import OVERRIDABLE_KEYS, BaseRollout, SamplingParams
from hybridflow.engines.rollout.config import AgentLoopConfig, MultiTurnConfig, RolloutConfig, SamplingConfig
from hybridflow.engines.rollout.hf import HFRollout
from hybridflow.engines.rollout.native import NativeRollout
from hybridflow.utils.registry import Registry

ROLLOUTS: Registry[type[BaseRollout]] = Registry("rollout")
ROLLOUTS.register("hf", HFRollout)
ROLLOUTS.register("native", NativeRollout)
ROLLOUTS.register_lazy("vllm", "hybridflow.engines.rollout.vllm:VLLMRollout")

__all__ = [
    "OVERRIDABLE_KEYS",
    "ROLLOUTS",
    "AgentLoopConfig",
    "BaseRollout",
    "HFRollout",
    "MultiTurnConfig",
    "NativeRollout",
    "RolloutConfig",
    "SamplingConfig",
    "SamplingParams",
]
