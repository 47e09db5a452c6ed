"""Measured timings stay out of rlmegatron's comments and docstrings: they go stale with the machine and the code, so
they belong in benchmarks/RESULTS.md ("Measured reasons in the code"), which a comment may name."""
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlmegatron"
# A number with a unit of time or bandwidth: "7 ms", "1.4 us", "about 5 s", "44.7 GB/s".
MEASURED = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|seconds|minutes|GB/s|MB/s)\b")


def prose(source: str):
    """(line, text) of each comment and docstring of a module."""
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                           tokenize.NL):
            yield token.start[0], token.string  # a string on a line of its own: a docstring
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type


def measured_numbers(source: str) -> list[tuple[int, str]]:
    return [(line, match.group()) for line, text in prose(source) for match in MEASURED.finditer(text)]


def test_the_check_finds_timings_in_comments_and_docstrings_and_not_in_code():
    source = '"""Module: 5 s of start-up."""\nTIMEOUT = 60  # seconds\nx = f(timeout_s=600)  # 1.4 us each\n' \
             'def f():\n    """3 ms."""\n    return "7 ms"\n'
    assert measured_numbers(source) == [(1, "5 s"), (3, "1.4 us"), (5, "3 ms")]


def test_no_measured_timing_in_a_comment_or_docstring():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {number!r}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, number in measured_numbers(path.read_text())]
    assert not found, "measured numbers belong in benchmarks/RESULTS.md, not in the code:\n" + "\n".join(found)
