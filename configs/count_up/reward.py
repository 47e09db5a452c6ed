"""The count-up task's reward: the share of the 8 answer digits right before the first wrong one. Counting from the
first digit rewards the first (the quickstart's one-digit task) before the later ones, each of which only counts once
the digits before it are right: a curriculum GRPO's one advantage per response can follow."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = 0
    for answer, expected in zip(solution_str, ground_truth):
        if answer != expected:
            break
        right += 1
    return right / len(ground_truth)
