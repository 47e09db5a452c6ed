"""Rule-based GSM8K reward: strict (the number after `####`) or flexible (the last number in the text)."""
from __future__ import annotations

import re
from typing import Literal

_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]*[0-9]")
# Only the tail is searched: the answer comes last, and a bounded input keeps the regexes cheap.
_TAIL_CHARS = 300


def extract_gsm8k_answer(text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer in a response, commas and a trailing '.' stripped; None if there is none."""
    tail = text[-_TAIL_CHARS:]
    matches = _STRICT_ANSWER.findall(tail) if method == "strict" else _ANY_NUMBER.findall(tail)
    candidates = [m.replace(",", "").rstrip(".") for m in matches]
    candidates = [c for c in candidates if c not in ("", "-")]
    return candidates[-1] if candidates else None


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` for the right answer, `format_score` for a wrong one that is well formed, 0 for none."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, str(ground_truth)) else format_score


def _same_number(answer: str, truth: str) -> bool:
    truth = truth.replace(",", "").strip()
    if answer == truth:
        return True
    try:
        return float(answer) == float(truth)  # "18.00" and "18" are the same answer
    except ValueError:
        return False
