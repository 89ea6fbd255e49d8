"""A reward file for nodes without reasoning-gym (`custom_reward_function.path`): 1 when the response's
'Answer: X' (or else its last number) equals the row's ground truth as a number, else 0. On the demo's two-term
integer arithmetic this agrees with reasoning-gym's verifier."""

from fractions import Fraction

from hybridflow.rewards.score.gsm8k import normalize_number
from hybridflow.rewards.score.reasoning_gym import extract_answer_flexible


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extract_answer_flexible(solution_str)
    if answer is None:
        return 0.0
    try:
        return float(Fraction(normalize_number(answer)) == Fraction(normalize_number(str(ground_truth))))
    except (ValueError, ZeroDivisionError):
        return 0.0
