"""A format-reward probe for the demo (`custom_reward_function.path`): reasoning-gym's verifier score of the answer
(the row's extraction, flexible for the demo) plus `FORMAT_BONUS` when the response has the 'Answer:' line the prompt
asks for (strict extraction finds one), whether or not the answer is right.

The demo's model answers "a op b = c" and never writes that line, so an evaluation that reads only the line scores it
0%. This probe asks whether a small bonus teaches the line without costing accuracy (docs/recipes.md).

    python -m hybridflow.trainer.main_ppo --config-name grpo_smollm2_demo \
        custom_reward_function.path=benchmarks/answer_line_reward.py
"""

from hybridflow.rewards.score.reasoning_gym import compute_score as verifier_score
from hybridflow.rewards.score.reasoning_gym import extract_answer

FORMAT_BONUS = 0.2


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_bonus=FORMAT_BONUS):
    """`format_bonus` (custom_reward_function.reward_kwargs.format_bonus) is added for an 'Answer:' line."""
    score = verifier_score(data_source, solution_str, ground_truth, extra_info)
    return score + (format_bonus if extract_answer(solution_str) is not None else 0.0)
