"""Role workers the driver calls: the hybrid-engine actor/rollout/ref worker, the critic, the reward model and the
SFT worker, and PRIME's implicit process reward model.
"""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py: the config sections in this
# package import without torch).
_EXPORTS = {
    "ActorRolloutRefWorker": "actor_rollout_ref",
    "CriticWorker": "critic",
    "PrimeRewardModelWorker": "prime_reward_model",
    "RewardModelWorker": "reward_model",
    "SFTWorker": "sft",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
