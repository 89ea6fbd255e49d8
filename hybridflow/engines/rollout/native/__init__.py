"""The `native` rollout engine: hybridflow's own batched decoding for HF Llama-family models.

- `kv_cache.py`: preallocated per-slot KV cache (one sequence per slot, no padding inside)
- `model.py`: compact prefill/decode forward reading the HF module's weights
- `sampler.py`: greedy / temperature / top-k / top-p sampling and sampled-token log-probs
- `batcher.py`: continuous batching (admission, shared prefill for n samples, retirement)
- `prefix_cache.py`: finished sequences' caches kept for their conversation's next turn (`serve`)
- `rollout.py`: `NativeRollout`, the `BaseRollout` implementation registered as `native`
"""

from hybridflow.engines.rollout.native.rollout import NativeRollout

__all__ = ["NativeRollout"]
