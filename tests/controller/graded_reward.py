"""A reward in five levels that varies within most groups of random responses, and is 0 for every response to a
digit prompt, so that those groups are all-equal and DAPO's dynamic sampling drops them."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth.isdigit():
        return 0.0
    return (sum(map(ord, solution_str)) % 5) / 4
