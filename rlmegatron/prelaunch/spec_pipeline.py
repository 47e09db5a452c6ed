"""The one place a job spec is accepted or rejected: a pipeline of named stages that each command runs once, before
anything starts. Every SpecError comes from `check_job` (tests/prelaunch/test_spec_pipeline.py fails on a module elsewhere that
makes one); the other modules return problems (SpecProblem) and the stage that called them decides.

The stages, in order:
- schema: the YAML and the overrides (verl's keys translated first, with --verl), pydantic's types, ranges and
  unknown keys (config/loader.py, config/verl_keys.py);
- cross-field: layouts against the model and the cluster, batch arithmetic, option clashes (config/checks.py);
- relevance: a setting the rest of the spec makes meaningless (config/relevance.py);
- launch: the spec against the environment it launches from: placement.transport against RAY_ADDRESS;
- schedule: the learning-rate warmup against the run's length: trainer.total_steps; a run trained by epochs waits
  for the data stage to count the batches (and has nothing to check where the command reads no data);
- preflight: what the spec points at: model, tokenizer, the first rows of the data, plug-ins, the run directory,
  the tracking packages (preflight.py);
- data: every row of the data files, built into the datasets the run trains on (`rlm train` only).

A stage runs when those it reads from passed: cross-field, relevance, launch and schedule need a parsed spec, so
their problems come together; preflight reads the files of a spec that passed every check before it (and may
download a hub model: not for a spec that is wrong anyway); data needs preflight's tokenizer. Each command picks
its stages: SPEC_STAGES (`rlm plan`, which reads only the spec and the model's config.json), VALIDATE_STAGES
(`rlm validate`) and TRAIN_STAGES (`rlm train`).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlmegatron.config.checks import check_spec, schedule_problems
from rlmegatron.config.errors import SpecError, SpecProblem
from rlmegatron.config.loader import COMMAND_LINE, ParsedSpec, parse_spec, read_spec_file
from rlmegatron.config.relevance import unused_settings
from rlmegatron.config.spec import JobSpec
from rlmegatron.config.verl_keys import follows_checked, translate
from rlmegatron.prelaunch.preflight import preflight

STAGES = ("schema", "cross-field", "relevance", "launch", "schedule", "preflight", "data")
SPEC_STAGES = ("schema", "cross-field", "relevance", "schedule")
VALIDATE_STAGES = ("schema", "cross-field", "relevance", "launch", "schedule", "preflight")
TRAIN_STAGES = STAGES


@dataclass(frozen=True)
class SpecSource:
    """What a command was given: the spec file (None: verl's command line alone), the overrides, and whether they are
    verl's keys. `raw`: the file's YAML already read (`rlm plan --search` checks many override sets on one file)."""

    config: Optional[str]
    overrides: Sequence[str] = ()
    verl: bool = False
    raw: Optional[Mapping[str, Any]] = None


@dataclass
class CheckedJob:
    """A spec that passed the stages a command ran, with what they found on the way."""

    spec: JobSpec
    stages: tuple[str, ...]
    """The stages that ran (those asked for, less those with nothing to check: a schedule without a known length)."""
    notes: list[str] = field(default_factory=list)
    """What stops nothing but is worth knowing (verl keys accepted as what rlmegatron does anyway, a data file that
    `rlm prepare` has not written yet, ...); check_job prints them."""
    transport: Optional[str] = None
    """launch: "processes" or "ray", as placement.transport applies here; None: one rank in the driver's process
    (driver.job.check_training's in_process)."""
    tokenizer: Any = None
    """preflight (train): the run's tokenizer."""
    loader: Any = None
    """data: the training prompts' loader (its length: batches per epoch)."""
    val_set: Any = None
    """data: the validation dataset, None without data.val_files."""
    total_steps: Optional[int] = None
    """schedule: the run's trainer steps, once known."""


def check_job(source: SpecSource, stages: Sequence[str] = TRAIN_STAGES,
              before_preflight: Callable[[CheckedJob], None] | None = None) -> CheckedJob:
    """Run `stages` (in STAGES' order) on the spec `source` names; the checked job, or a SpecError naming every
    problem found. The notes go to stderr when it passes. `before_preflight`: called once the spec has passed the
    checks before preflight (`rlm train` starts its ranks' imports there, to overlap preflight's; nothing of the job)."""
    unknown = set(stages) - set(STAGES)
    assert not unknown, f"no such stage: {sorted(unknown)}"
    run = _Run(source, launching="data" in stages)
    parsed = run.schema()
    if parsed.spec is None:
        raise SpecError(run.problems)
    job = CheckedJob(parsed.spec, ("schema",), run.notes)
    deferred: list[str] = []  # the schedule of a run trained by epochs, waiting for the data stage's count
    for stage in [name for name in STAGES[1:] if name in stages]:
        if stage in _NEEDS_A_CLEAN_SPEC and run.problems:
            break
        if stage == "preflight" and before_preflight is not None:
            before_preflight(job)
        for name in [stage, *deferred] if stage == "data" else [stage]:
            outcome = _STAGE_CHECKS[name](run, parsed, job, later=name != "data" and "data" in stages
                                          and "data" not in job.stages)
            if outcome is _LATER:
                deferred.append(name)
            elif outcome is not _NOTHING_TO_CHECK:
                job.stages += (name,)
    if run.problems:  # a rejected spec is its problems alone, one line each, without the notes
        raise SpecError(run.problems)
    for note in run.notes:
        print(note, file=sys.stderr, flush=True)
    return job


def load_spec(path: str | os.PathLike, overrides: Sequence[str] = ()) -> JobSpec:
    """The spec at `path` with `overrides`, through the stages of the spec alone (SPEC_STAGES), for code and tests
    that build a job themselves."""
    return check_job(SpecSource(str(path), tuple(overrides)), SPEC_STAGES).spec


def spec_from_raw(raw: Mapping[str, Any], overrides: Sequence[str] = (), file: str | os.PathLike = "<spec>") -> JobSpec:
    """As load_spec, for a spec already parsed from YAML; problems are attributed to `file`."""
    return check_job(SpecSource(str(file), tuple(overrides), raw=raw), SPEC_STAGES).spec


def transport_for(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> str:
    """placement.transport as it applies to this run: "ray" or "processes" (see the field). The launch stage has
    refused "processes" beside a RAY_ADDRESS."""
    placement = spec.placement
    if placement.transport == "auto":
        return "processes" if placement.fits_processes and not environ.get("RAY_ADDRESS") else "ray"
    return placement.transport


# Stages that read what the checks before them vouch for: the files of a valid spec; the rows, with its tokenizer.
_NEEDS_A_CLEAN_SPEC = frozenset({"preflight", "data"})
_NOTHING_TO_CHECK = object()
_LATER = object()


class _Run:
    def __init__(self, source: SpecSource, launching: bool) -> None:
        self.source, self.launching = source, launching
        self.problems: list[SpecProblem] = []
        self.notes: list[str] = []

    def schema(self) -> ParsedSpec:
        source = self.source
        file = source.config if source.config is not None else COMMAND_LINE
        raw: Any = dict(source.raw) if source.raw is not None else read_spec_file(file) if source.config else {}
        if isinstance(raw, SpecProblem):
            self.problems.append(raw)
            return ParsedSpec(None, {}, (), file, [])
        overrides: Sequence[Any] = source.overrides
        translation = None
        if source.verl:
            translation = translate(source.overrides, raw)
            self.problems += translation.problems
            self.notes += translation.notes
            overrides = translation.overrides
        parsed = parse_spec(raw, overrides, file)
        self.problems += parsed.problems
        if translation is not None and parsed.spec is not None:
            problems, notes = follows_checked(translation, parsed.spec)
            self.problems += problems
            self.notes += notes
        return parsed


def _cross_field(run: _Run, parsed: ParsedSpec, job: CheckedJob, later: bool) -> None:
    run.problems += parsed.attributed(check_spec(job.spec))


def _relevance(run: _Run, parsed: ParsedSpec, job: CheckedJob, later: bool) -> None:
    run.problems += parsed.attributed(unused_settings(job.spec, parsed.merged, parsed.command_line))


def _launch(run: _Run, parsed: ParsedSpec, job: CheckedJob, later: bool) -> None:
    cluster = os.environ.get("RAY_ADDRESS")
    if job.spec.placement.transport == "processes" and cluster:
        run.problems += parsed.attributed([SpecProblem(
            "placement.transport", "processes", f"runs the ranks on this machine without Ray, but RAY_ADDRESS="
            f"{cluster} names a Ray cluster; use placement.transport=ray or auto, or unset RAY_ADDRESS")])
    job.transport = transport_for(job.spec)


def _preflight(run: _Run, parsed: ParsedSpec, job: CheckedJob, later: bool) -> None:
    checked = preflight(job.spec, launching=run.launching)
    run.notes += checked.notes
    run.problems += checked.problems
    if checked.problems or not run.launching:
        return
    # The workers read local files only: a hub id becomes the snapshot fetched for it.
    model = job.spec.model
    model.path = str(checked.snapshots.get(model.path, model.path))
    model.tokenizer_path = str(checked.snapshots.get(model.tokenizer_path, model.tokenizer_path))
    teacher = job.spec.teacher
    if teacher.path is not None:
        teacher.path = str(checked.snapshots.get(teacher.path, teacher.path))
    job.tokenizer = checked.tokenizer


def _data(run: _Run, parsed: ParsedSpec, job: CheckedJob, later: bool) -> None:
    # Rows past the first FIRST_ROWS that preflight read: a bad one is a DatasetError naming its file and line.
    from rlmegatron.data import DatasetError, PromptDataLoader, build_dataset  # lazy: torch

    data = job.spec.data
    processor = job.spec.model.tokenizer_path or job.spec.model.path  # a vision-language model's image processor

    def dataset(kind: str, files: Sequence[str]) -> Any:
        try:
            return build_dataset(files, job.tokenizer, data, processor)
        except DatasetError as error:
            # Named by its field, as preflight names a problem of the first rows: the row's own file:line follows.
            index = next((index for index, file in enumerate(files) if str(error).startswith(f"{Path(file)}:")), None)
            raise DatasetError(f"data.{kind}{'' if index is None else f'[{index}]'}: {error}") from error

    train_set = dataset("train_files", data.train_files)
    job.val_set = dataset("val_files", data.val_files) if data.val_files else None
    job.loader = PromptDataLoader(train_set, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)


def _schedule(run: _Run, parsed: ParsedSpec, job: CheckedJob, later: bool) -> object:
    """`later`: the data stage is still to come, and counts the batches of a run trained by epochs."""
    spec = job.spec
    if spec.trainer.total_steps is not None:
        job.total_steps, known_from = spec.trainer.total_steps, "trainer.total_steps"
    elif job.loader is not None:
        job.total_steps = spec.total_steps(len(job.loader))
        known_from = f"trainer.total_epochs={spec.trainer.total_epochs} x {len(job.loader)} batches of data.train_files"
    elif later:
        return _LATER
    else:  # trained by epochs, and this command does not read the data
        return _NOTHING_TO_CHECK
    run.problems += parsed.attributed(schedule_problems(spec, job.total_steps, known_from))
    return None


_STAGE_CHECKS: dict[str, Callable[..., Any]] = {
    "cross-field": _cross_field, "relevance": _relevance, "launch": _launch, "preflight": _preflight,
    "data": _data, "schedule": _schedule,
}
