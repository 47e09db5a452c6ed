"""The reward of TRL's echo task (../shared/peers/trl_grpo/run.py's echo_reward), as a reward.function plug-in:
1 when the response's first non-space character is the row's answer."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.lstrip(" ")[:1] == ground_truth else 0.0
