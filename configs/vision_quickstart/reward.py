"""The vision quickstart's verifiable reward: 1 if the response starts with the image's colour letter."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str[:1] == ground_truth else 0.0
