"""Role workers the driver calls: the hybrid-engine actor/rollout/ref worker, the critic, the reward model and the
SFT worker."""

from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.sft import SFTWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "SFTWorker"]
