"""UserError: a mistake the user can fix (a spec field, a data file, a plug-in), as opposed to a bug of ours; and
Divergence: training produced NaN or inf.

`rlm` prints a user error's message and exits 2, with no traceback unless RLM_DEBUG=1 or `rlm --debug`; anything
else keeps its traceback. The message is the whole report: one line per problem, naming the file, field or row and
the fix. Imports nothing, so every module, however light, can raise one.

A Divergence stops the run before the step it happened in can be saved: the trainer reports it as TrainingStopped
(exit 3) with the step and the last complete checkpoint.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


class UserError(Exception):
    """Base of every error type that reports a user's mistake (SpecError, DatasetError, PluginError, ...)."""


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


def one_of(values: Sequence[Any]) -> str:
    """'1, 2, 4 or 8': the valid choices a fix can pick from."""
    shown = [str(value) for value in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
