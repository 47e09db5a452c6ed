"""Rule-based math reward: the last `\\boxed{...}` of a response, normalised, against the ground truth."""
from __future__ import annotations

import re


def last_boxed_answer(text: str) -> str | None:
    """Contents of the last \\boxed{...} (or \\fbox{...}) in the text, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # "\boxed 5" is valid LaTeX for a single-token argument.
        match = re.match(r"\\boxed ([^\s$]+)", text[start:])
        return match.group(1) if match else None
    depth = 0
    for position in range(brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : position]
    return None  # unbalanced: the response was cut off inside the box


_REMOVED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\displaystyle", "^\\circ", "^{\\circ}", "\\%", "%", "$")
_UNITS_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{([^}]*)\}")


def normalize_math_answer(answer: str) -> str:
    """A canonical form so trivially different spellings compare equal (\\dfrac vs \\frac, 0.5 vs .5, x=3 vs 3)."""
    answer = _UNITS_TEXT.sub(r"\1", answer.strip())
    for token in _REMOVED:
        answer = answer.replace(token, "")
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace(" ", "")
    answer = re.sub(r"^[a-zA-Z]\s*=", "", answer)  # "x=3" answers the question "x"
    answer = answer.rstrip(".")
    answer = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", answer)  # \frac12 -> \frac{1}{2}
    if re.fullmatch(r"-?[0-9,]*\.?[0-9]+", answer):
        number = float(answer.replace(",", ""))
        answer = str(int(number)) if number.is_integer() else repr(number)
    return answer


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals the ground truth after normalisation, else 0.0."""
    answer = last_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    truth = last_boxed_answer(str(ground_truth)) or str(ground_truth)
    return 1.0 if normalize_math_answer(answer) == normalize_math_answer(truth) else 0.0
