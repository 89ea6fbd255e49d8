"""Checks of the generative reward model (verl's reward loop with a custom reward function), before Ray."""

from __future__ import annotations

from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.workers.reward_config import REWARD_SERVING_ENGINES

__all__ = ["check_generative_reward_model"]

def check_generative_reward_model(cfg: PPOConfig) -> None:
    """The served judge's engine and layout, the rule weight it replaces, and the function that must query it."""
    section, serving = cfg.reward_model, cfg.reward_model.rollout
    if serving.engine not in REWARD_SERVING_ENGINES:
        raise ValueError(
            f"reward_model.rollout.name={serving.name!r} serves the generative reward model (a custom reward "
            f"function with use_reward_loop=True); hybridflow serves it with {list(REWARD_SERVING_ENGINES)}"
        )
    if serving.expert_parallel_size != 1:
        raise ValueError(
            f"reward_model.rollout.expert_parallel_size={serving.expert_parallel_size} with a generative reward model: "
            "its replicas split by tensor parallelism only; set it to 1"
        )
    if section.rule_reward_coef != 0:
        raise ValueError(
            f"reward_model.rule_reward_coef={section.rule_reward_coef} with a generative reward model: the custom "
            "reward function's score is the whole reward (it may add a rule score itself); leave it at 0"
        )
    from hybridflow.rewards.custom import GENRM_KEYWORDS, load_custom_reward_fn, takes_keywords

    custom = cfg.custom_reward_function
    function = load_custom_reward_fn(custom.path, custom.name, dict(custom.reward_kwargs)).function()
    if not takes_keywords(function, GENRM_KEYWORDS):
        raise ValueError(
            f"custom_reward_function.name={custom.name!r} does not take {list(GENRM_KEYWORDS)}: with "
            "reward_model.enable=True and use_reward_loop=True verl hands the function the served reward model's "
            "address and tokenizer to judge with; add them to its parameters, or set use_reward_loop=False"
        )
