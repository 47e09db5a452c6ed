"""tool_lookup's reward: 1 if the final answer (the model's last turn) is the digit stored under the prompt's key."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == ground_truth else 0.0
