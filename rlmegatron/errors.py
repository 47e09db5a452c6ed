"""UserError: a mistake the user can fix (a spec field, a data file, a plug-in), as opposed to a bug of ours;
DiskFull: the run's disk filled up (the user's to fix too); and Divergence: training produced NaN or inf.

`rlm` prints a user error's message and exits 2, with no traceback unless RLM_DEBUG=1 or `rlm --debug`; anything
else keeps its traceback. The message is the whole report: one line per problem, naming the file, field or row and
the fix. Imports nothing, so every module, however light, can raise one.

A Divergence stops the run before the step it happened in can be saved: the trainer reports it as TrainingStopped
(exit 3) with the step and the last complete checkpoint.
"""
from __future__ import annotations

import errno
import sys
from collections.abc import Sequence
from typing import Any


class UserError(Exception):
    """Base of every error type that reports a user's mistake (SpecError, DatasetError, PluginError, ...)."""


class EngineCannotJoin(RuntimeError):
    """A rollout engine asked to join a running job did not start or take its first weights; the run goes on
    without it."""


class WeightSyncMismatch(RuntimeError):
    """An engine's weights after a sync are not what a full push gives (trainer.check_sync_every): the samples it
    would make come from other weights than the trainer's."""


class Divergence(FloatingPointError):
    """NaN or inf where training needs finite numbers: rollout logits, log-probs, entropy, values, a loss term, a
    gradient norm or the weights after an optimizer step. The message starts with the metric's name."""


class OffPolicy(RuntimeError):
    """trainer.on_policy_check: the engine's log-prob of a sampled token is farther from the actor's than the check
    allows, so the engine did not sample with the weights the actor trains (a weight-sync or routing bug)."""


def user_error_in(error: BaseException) -> UserError | None:
    """The user error `error` is, or carries from a Ray worker; None for anything else (a bug)."""
    while True:
        # ray.get re-raises a worker's exception as a RayTaskError that also subclasses the original's type, but
        # its text is the remote traceback; the original is its `cause`. Ray is looked up, never imported here.
        ray_exceptions = sys.modules.get("ray.exceptions")
        if ray_exceptions is not None and isinstance(error, ray_exceptions.RayTaskError):
            cause = getattr(error, "cause", None)
            if isinstance(cause, BaseException) and cause is not error:
                error = cause
                continue
        return error if isinstance(error, UserError) else None


class DiskFull(UserError):
    """The disk the run writes to is full: one line naming the run directory and the last complete checkpoint."""


# How a full disk reads where no OSError carries its errno: sqlite's words (through MLflow and SQLAlchemy), and the
# text of a rank's OSError that reached the driver only as its traceback.
_DISK_FULL_TEXTS = ("No space left on device", "database or disk is full", "Disk quota exceeded")


def disk_full_in(error: BaseException) -> str | None:
    """The words of the full disk behind `error` (itself, or anything in its chain of causes), else None."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{current.strerror}{f': {current.filename}' if current.filename else ''}"
        text = str(current)
        found = next((words for words in _DISK_FULL_TEXTS if words in text), None)
        if found is not None:
            return found
        todo += [linked for linked in (current.__cause__, current.__context__, getattr(current, "cause", None))
                 if isinstance(linked, BaseException)]
    return None


def one_of(values: Sequence[Any]) -> str:
    """'1, 2, 4 or 8': the valid choices a fix can pick from."""
    shown = [str(value) for value in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
