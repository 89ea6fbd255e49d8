"""hybridflow: RL post-training for LLMs with a hybrid controller on Ray."""

__version__ = "0.1.0"
