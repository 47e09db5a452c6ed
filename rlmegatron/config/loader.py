"""The schema stage's reading of a spec: a YAML file plus command-line overrides become a JobSpec, or the problems that
keep it from being one (rlmegatron/prelaunch/spec_pipeline.py runs the stages and raises)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlmegatron.config.errors import NO_VALUE, SpecProblem
from rlmegatron.config.fieldpaths import unknown_key_reason
from rlmegatron.config.overrides import REMOVE, Override, apply_overrides
from rlmegatron.config.spec import JobSpec
from rlmegatron.config.yamlio import dump_yaml, parse_yaml

COMMAND_LINE = "command line"

# Pydantic error types whose stock message would not tell a YAML author what to do.
_SECTION_TYPE_ERRORS = {"model_type", "model_attributes_type", "dict_type"}


@dataclass(frozen=True)
class ParsedSpec:
    """A spec as the schema read it: the JobSpec (None when the schema rejects it), what the YAML and the overrides
    wrote (`merged`, which the relevance rules read), and the schema's problems, each naming where it was written."""

    spec: JobSpec | None
    merged: dict[str, Any]
    applied: tuple[Override, ...]
    file: str
    problems: list[SpecProblem]

    @property
    def command_line(self) -> set[str]:
        """The fields the overrides set (rather than removed)."""
        return {override.path for override in self.applied if override.value is not REMOVE}

    def attributed(self, problems: Iterable[SpecProblem]) -> list[SpecProblem]:
        """`problems` of later checks, each naming the command line (and the key that set the field) or the file."""
        return _attributed(problems, self.file, self.applied)


def parse_spec(raw: dict[str, Any], overrides: Sequence[str | Override] = (), file: str = "<spec>") -> ParsedSpec:
    """The schema: `overrides` (`a.b=value`, `~a.b`) applied to the YAML's `raw`, then pydantic's types, ranges and
    unknown keys. Problems are attributed to `file` or the command line; nothing is raised (spec_pipeline decides)."""
    merged, applied, override_problems = apply_overrides(raw, overrides, JobSpec)
    problems = [replace(problem, file=COMMAND_LINE) for problem in override_problems]
    try:
        spec = JobSpec.model_validate(merged)
    except ValidationError as err:
        return ParsedSpec(None, merged, tuple(applied), file,
                          problems + _attributed(_problems_from_pydantic(err), file, applied))
    return ParsedSpec(spec, merged, tuple(applied), file, problems)


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML, every default filled in; loading it back gives an equal spec."""
    return dump_yaml(spec.model_dump(mode="json"))


def read_spec_file(file: str) -> dict[str, Any] | SpecProblem:
    """The YAML mapping at `file`, or why it cannot be one."""
    def fail(reason: str) -> SpecProblem:
        return SpecProblem("", NO_VALUE, reason, file=file)

    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return fail(f"cannot read the spec: {getattr(err, 'strerror', None) or err}")
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as err:
        return fail(f"not valid YAML: {_describe_yaml_error(err)}")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        return fail("must be a YAML mapping of sections (model:, data:, actor:, ...)")
    return raw


def _describe_yaml_error(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def _problems_from_pydantic(err: ValidationError) -> list[SpecProblem]:
    problems = []
    for error in err.errors(include_url=False):
        loc = error["loc"]
        field = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in loc)
        field = field.removeprefix(".")
        value = error.get("input", NO_VALUE)
        kind = error["type"]
        if kind == "extra_forbidden":
            reason = unknown_key_reason(JobSpec, [str(key) for key in loc])
        elif kind == "missing":
            reason, value = "is required but missing", NO_VALUE
        elif kind in _SECTION_TYPE_ERRORS:
            reason = "must be a section: a mapping of keys to values"
        else:
            reason = error["msg"].removeprefix("Value error, ").replace("Input should", "should", 1)
        problems.append(SpecProblem(field, value, reason))
    return problems


def _attributed(
    problems: Iterable[SpecProblem], file: str, applied: Sequence[Override]
) -> list[SpecProblem]:
    """Name the command line as the source of problems on overridden fields, and the YAML file otherwise."""

    def source(field: str) -> Override | None:
        for override in reversed(applied):  # the last override of a field is the one in force
            if field == override.path or field.startswith((override.path + ".", override.path + "[")):
                return override
            if override.path.startswith(field + "."):
                return override
        return None

    attributed = []
    for problem in problems:
        override = source(problem.field)
        if override is None:
            attributed.append(replace(problem, file=file))
        else:
            attributed.append(replace(problem, file=COMMAND_LINE, reason=override.blame(problem.reason)))
    return attributed
