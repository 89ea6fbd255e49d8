"""Role workers the driver calls: the hybrid-engine actor/rollout/ref worker and the critic."""

from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker"]
