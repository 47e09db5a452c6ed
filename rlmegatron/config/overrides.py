"""Dotted command-line overrides (`actor.optim.lr=1e-6`): parsed as YAML values and laid over the raw spec;
`~actor.ppo_micro_batch_size_per_gpu` (Hydra's and so verl's spelling) removes a key the YAML sets."""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from rlmegatron.config.errors import NO_VALUE, SpecProblem
from rlmegatron.config.fieldpaths import path_problem
from rlmegatron.config.yamlio import parse_yaml


REMOVE: Any = object()
"""The value of a `~key` override: the key goes, and the field takes its default."""


@dataclass(frozen=True)
class Override:
    keys: tuple[str, ...]
    value: Any
    origin: str = ""
    """The key the user wrote, when it is not `path` itself (a verl key translated onto the spec)."""

    @property
    def path(self) -> str:
        return ".".join(self.keys)

    def blame(self, reason: str) -> str:
        """`reason`, naming the key the user wrote when this override was translated from it."""
        return f"{reason} (set by {self.origin})" if self.origin else reason


def parse_override(text: str) -> Override | SpecProblem:
    """`a.b.c=value` -> Override(("a", "b", "c"), value), the value read as YAML (so 8, 1e-6, true, [x, y]);
    `~a.b.c` -> Override(("a", "b", "c"), REMOVE)."""
    if text.startswith("~"):
        keys = tuple(text[1:].strip().split("."))
        if "=" in text or not all(keys):
            return SpecProblem(text, NO_VALUE, "a removal must look like ~section.key (e.g. ~rollout.n), no value")
        return Override(keys, REMOVE)
    path, sep, value_text = text.partition("=")
    keys = tuple(path.strip().split("."))
    if not sep or not all(keys):
        return SpecProblem(text, NO_VALUE, "an override must look like section.key=value (e.g. rollout.n=8)")
    try:
        value = parse_yaml(value_text) if value_text.strip() else ""
    except yaml.YAMLError as err:
        return SpecProblem(path, value_text, f"is not a valid YAML value: {_first_line(err)}")
    return Override(keys, value)


def apply_overrides(
    raw: dict[str, Any], overrides: Sequence[str | Override], root: type[BaseModel]
) -> tuple[dict[str, Any], list[Override], list[SpecProblem]]:
    """A copy of `raw` with every valid override (text, or already parsed) applied, the overrides applied, and the
    rejected ones."""
    result = copy.deepcopy(raw)
    applied: list[Override] = []
    problems: list[SpecProblem] = []
    for text in overrides:
        parsed = text if isinstance(text, Override) else parse_override(text)
        if isinstance(parsed, SpecProblem):
            problems.append(parsed)
            continue
        reason = path_problem(root, parsed.keys) or _set_in(result, parsed)
        if reason:
            removal = parsed.value is REMOVE
            problems.append(SpecProblem("~" + parsed.path if removal else parsed.path,
                                        NO_VALUE if removal else parsed.value, parsed.blame(reason)))
        else:
            applied.append(parsed)
    return result, applied, problems


def _set_in(raw: dict[str, Any], override: Override) -> str | None:
    """Set the override's value in `raw`, creating sections on the way; a reason if YAML blocks the path."""
    section = raw
    for depth, key in enumerate(override.keys[:-1]):
        child = section.get(key)
        if child is None:  # `critic:` with nothing under it reads as None
            child = section[key] = {}
        if not isinstance(child, dict):
            where = ".".join(override.keys[: depth + 1])
            return f"cannot set it: {where} is {child!r} in the YAML, not a section"
        section = child
    if override.value is REMOVE:
        if override.keys[-1] not in section:
            return "cannot remove it: the YAML does not set it (nor does an override before this one)"
        del section[override.keys[-1]]
        return None
    section[override.keys[-1]] = override.value
    return None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]
