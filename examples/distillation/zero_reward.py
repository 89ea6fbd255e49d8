"""A reward of 0 for every response: with it, the only training signal is the KL loss to the teacher."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
