"""Checks of the generative reward model (verl's reward loop with a custom reward function), before Ray."""

from __future__ import annotations

from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.workers.reward_config import REWARD_SERVING_ENGINES

__all__ = ["check_custom_reward_function", "check_generative_reward_model"]

CALL_KEYWORDS = {
    "naive": ("data_source", "solution_str", "ground_truth", "extra_info"),
    "prime": ("data_source", "solution_str", "ground_truth", "extra_info"),
    "dapo": ("data_source", "solution_str", "ground_truth", "extra_info"),
    "batch": ("data_sources", "solution_strs", "ground_truths", "extra_infos"),
}
"""The keywords each built-in reward manager calls `custom_reward_function` with (custom managers: their own)."""


def check_custom_reward_function(cfg: PPOConfig) -> None:
    """Before Ray (and in --dry-run): the file loads, defines `custom_reward_function.name`, takes its
    `reward_kwargs` and the keywords the reward manager calls it with; each failure names the key and the fix."""
    from hybridflow.rewards.custom import call_error, load_custom_reward_fn

    custom = cfg.custom_reward_function
    try:
        function = load_custom_reward_fn(custom.path, custom.name, dict(custom.reward_kwargs)).function()
    except (FileNotFoundError, AttributeError, TypeError) as err:
        raise ValueError(str(err)) from err
    except Exception as err:  # the user's file raised while it was imported
        raise ValueError(f"custom_reward_function.path={custom.path!r} raised {type(err).__name__} when it was "
                         f"imported: {err}") from err
    manager = cfg.reward_model.reward_manager
    keywords = CALL_KEYWORDS.get(manager)
    if keywords is None or (cfg.reward_model.enable and cfg.reward_model.use_reward_loop):
        return  # a custom manager's call, or the generative judge's (check_generative_reward_model)
    err = call_error(function, [*keywords, *custom.reward_kwargs])
    if err is not None:
        raise ValueError(
            f"custom_reward_function.name={custom.name!r} in {custom.path} cannot be called as reward_model."
            f"reward_manager={manager!r} calls it, with keywords {list(keywords)}"
            f"{' and reward_kwargs ' + str(sorted(custom.reward_kwargs)) if custom.reward_kwargs else ''}: {err}; "
            "give it those parameters (others need defaults)"
        ) from err


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
