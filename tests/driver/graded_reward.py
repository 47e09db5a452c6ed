"""A reward in five levels that varies within most groups of random responses, and is 0 for every response to a
prompt whose answer is an even digit (the quickstart's answers are digits), so that those groups are all-equal and
DAPO's dynamic sampling drops them."""


def scores_nothing(ground_truth: str) -> bool:
    return int(ground_truth) % 2 == 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if scores_nothing(ground_truth):
        return 0.0
    return (sum(map(ord, solution_str)) % 5) / 4
