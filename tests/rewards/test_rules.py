"""Answer extraction and scoring of the built-in GSM8K and math rules, and dispatch by data source."""
import pytest

from rlmegatron.rewards import (
    UnknownDataSource,
    default_compute_score,
    extract_gsm8k_answer,
    gsm8k_score,
    last_boxed_answer,
    math_score,
    normalize_math_answer,
)


@pytest.mark.parametrize("text, strict, flexible", [
    ("9 eggs, so 9*2 = 18.\n#### 18", "18", "18"),
    ("#### 1,234", "1234", "1234"),
    ("first #### 3 then #### -4.5", "-4.5", "-4.5"),
    ("The answer is 72.", None, "72"),
    ("####72", None, "72"),  # strict wants the space, as verl
    ("no numbers at all", None, None),
    ("costs $1,000.", None, "1000"),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_score():
    assert gsm8k_score("#### 18", "18") == 1.0
    assert gsm8k_score("#### 18.0", "18") == 1.0
    assert gsm8k_score("#### 17", "18") == 0.0
    assert gsm8k_score("#### 17", "18", format_score=0.1) == 0.1
    assert gsm8k_score("it is 18", "18") == 0.0
    assert gsm8k_score("it is 18", "18", method="flexible") == 1.0


@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed 7", "7"),
    ("\\fbox{x}", "x"),
    ("cut off \\boxed{\\frac{1", None),
    ("nothing boxed", None),
])
def test_last_boxed_answer(text, boxed):
    assert last_boxed_answer(text) == boxed


@pytest.mark.parametrize("a, b", [
    ("\\dfrac{1}{2}", "\\frac12"), ("0.50", ".5"), ("x = 3", "3"), ("90^\\circ", "90"),
    ("10\\%", "10"), ("\\left( 1, 2 \\right)", "(1,2)"), ("5.", "5"), ("1,000", "1000"), ("\\text{5 cm}", "5cm"),
])
def test_math_normalisation_equates_spellings(a, b):
    assert normalize_math_answer(a) == normalize_math_answer(b)


def test_math_score():
    assert math_score("thus \\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}") == 1.0
    assert math_score("thus \\boxed{3}", "\\boxed{3}") == 1.0
    assert math_score("thus \\boxed{4}", "3") == 0.0
    assert math_score("thus 3", "3") == 0.0


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{5}", "5") == 1.0
    assert default_compute_score("aime24", "\\boxed{5}", "5", {}) == 1.0
    with pytest.raises(UnknownDataSource, match="set reward.function"):
        default_compute_score("my_task", "5", "5")
