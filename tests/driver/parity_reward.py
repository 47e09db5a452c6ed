"""A reward that half of all random responses earn (odd character code), so even the first steps have gradients."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ord(solution_str[:1] or "\0") % 2)
