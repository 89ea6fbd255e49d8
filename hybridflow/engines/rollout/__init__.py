"""Rollout engines behind one interface (`BaseRollout`), looked up by name in `ROLLOUTS`.

    rollout = ROLLOUTS.get("hf")(model_or_path, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=256))
    batch = rollout.generate_sequences(prompts)

`hf` (transformers' `generate`) and `native` (continuous batching over a preallocated KV cache, Llama/Qwen2
models) are always available. `vllm` (a vLLM engine; optional, see `vllm.py`) registers lazily: its module is
imported when the name is first requested, and without the vllm package that raises ImportError with the
install command. What each backend can do is its `RolloutSpec` (`registry.py`), which the config checks read.
"""

from __future__ import annotations

from hybridflow.engines.rollout.registry import ROLLOUTS, RolloutSpec, backends_with, register_rollout, rollout_spec
from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py).
_EXPORTS = {
    "OVERRIDABLE_KEYS": "base",
    "BaseRollout": "base",
    "SamplingParams": "base",
    "AgentLoopConfig": "config",
    "MultiTurnConfig": "config",
    "RolloutConfig": "config",
    "SamplingConfig": "config",
    "HFRollout": "hf",
    "NativeRollout": "native",
}
__all__ = ["ROLLOUTS", "RolloutSpec", "backends_with", "register_rollout", "rollout_spec", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
