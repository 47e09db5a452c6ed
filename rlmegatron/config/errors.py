"""SpecProblem and SpecError: how the job spec says what is wrong, where, and how to fix it."""
from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from rlmegatron.errors import UserError


class _NoValue:
    """Marks a problem that has no offending value to show (a missing field, an unreadable file)."""

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True)
class SpecProblem:
    """One rejection: `file: field=value: reason`, where the reason names the fix when there is one."""

    field: str
    value: Any  # NO_VALUE when there is nothing to show
    reason: str
    file: str = ""

    def __str__(self) -> str:
        subject = self.field
        if self.value is not NO_VALUE:
            subject += "=" + render_value(self.value)
        return ": ".join(part for part in (self.file, subject, self.reason) if part)


class SpecError(UserError, ValueError):
    """Every problem found in a job spec, reported together so one run fixes them all."""

    def __init__(self, problems: Iterable[SpecProblem]):
        self.problems: tuple[SpecProblem, ...] = tuple(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))

    def __reduce__(self):
        # Rebuilt from its problems, not its text, when it crosses a process boundary (Ray, the rank processes).
        return (SpecError, (self.problems,))


def render_value(value: Any) -> str:
    """Show a value the way it would be written in YAML or on the command line."""
    try:
        text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9)
    except yaml.YAMLError:
        return repr(value)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def did_you_mean(key: str, known: Sequence[str]) -> str:
    """The suggestion that ends an unknown-key message: the closest known key, else all of them."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return "known keys: " + ", ".join(known)
