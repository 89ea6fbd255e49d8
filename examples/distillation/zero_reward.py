"""Reward 0 on training prompts, so that the KL loss to the teacher is the only training signal; validation
prompts (extra_info.split != 'train') are scored by the task's own verifier, so accuracy stays measurable."""

from hybridflow.rewards.score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if (extra_info or {}).get("split", "train") == "train":
        return 0.0
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
