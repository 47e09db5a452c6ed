"""An `async def` reward function, for the checks of reward.async_concurrency."""


async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)
