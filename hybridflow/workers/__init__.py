"""Role workers the driver calls: the hybrid-engine actor/rollout/ref worker, the critic, the reward model and the
SFT worker, and PRIME's implicit process reward model."""

from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.prime_reward_model import PrimeRewardModelWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.sft import SFTWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "PrimeRewardModelWorker", "RewardModelWorker", "SFTWorker"]
