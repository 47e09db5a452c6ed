"""User plug-ins named as `path/to/file.py:name`: loading them, and checking that one fits the call it will get.

Datasets, reward functions, advantage estimators and policy losses are all plug-ins of this form.
Torch-free, so the job-spec checks can use it.
"""
from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Union

from rlmegatron.errors import UserError

# The keywords a plug-in is called with, or a function of the plug-in giving them (for protocols
# where the callee picks its inputs by name, like advantage estimators).
Keywords = Union[Iterable[str], Callable[[Any], Iterable[str]]]

PLUGIN_REFERENCE = re.compile(r"^.+\.py:[A-Za-z_][A-Za-z0-9_]*$")


class PluginError(UserError, ValueError):
    """A plug-in reference that cannot be loaded; the message names the file and the attribute."""


def is_plugin_reference(text: str) -> bool:
    """Whether `text` has the form path/to/file.py:name (rather than a registered name)."""
    return bool(PLUGIN_REFERENCE.match(text))


def load_plugin(reference: str) -> Any:
    """The object `name` defined in `file.py`, for a reference `file.py:name`."""
    file_part, sep, name = reference.rpartition(":")
    if not sep or not file_part.endswith(".py") or not name:
        raise PluginError(f"{reference!r}: must look like path/to/file.py:name")
    path = Path(file_part).resolve()
    if not path.is_file():
        raise PluginError(f"{reference!r}: no such file {path}")
    # A name unique per file, so two plug-ins both called reward.py do not replace each other.
    module_name = f"rlmegatron_plugin_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        # Registered before running so worker processes (pickling by module name) and dataclasses find it.
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    if not hasattr(module, name):
        raise PluginError(f"{reference!r}: {path.name} defines no {name!r}")
    return getattr(module, name)


def is_async_function(function: Any) -> bool:
    """Whether calling the plug-in returns a coroutine (`async def`, or an object whose __call__ is one): the reward
    manager awaits those, and the spec's relevance rules ask it whether reward.async_concurrency means anything."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


def call_problem(function: Any, positional: Sequence[str], keywords: Iterable[str] = ()) -> str | None:
    """Why `function(*positional, **{k: ... for k in keywords})` would fail on its signature alone; None if it fits.

    Nothing is called: the arguments are bound to the signature, so a missing, surplus or misnamed
    parameter is found before any worker starts.
    """
    keywords = list(keywords)
    call = ", ".join([*positional, *(f"{name}=" for name in keywords)])
    if not callable(function):
        return f"is not a function that can be called as ({call}); it is of type {type(function).__name__}"
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin without an introspectable signature: trust it
    try:
        signature.bind(*positional, **{name: name for name in keywords})
    except TypeError as err:
        return f"cannot be called as {getattr(function, '__name__', 'it')}({call}): {err}"
    return None


def loaded_or_problem(load: Callable[[str], Any], reference: str) -> tuple[Any, str | None]:
    """`load(reference)` and None, or None and why it failed: the loader's message, or what the user's module
    raised while importing."""
    try:
        return load(reference), None
    except PluginError as err:
        return None, str(err).removeprefix(f"{reference!r}: ")
    except Exception as err:  # the user's module failed while importing
        return None, f"importing {reference.rpartition(':')[0]} raised {type(err).__name__}: {err}"


def plugin_problem(reference: str, positional: Sequence[str], keywords: Keywords = ()) -> str | None:
    """Why the plug-in `reference` cannot be loaded or called with these arguments; None if it can."""
    function, problem = loaded_or_problem(load_plugin, reference)
    if problem:
        return problem
    if callable(keywords):
        keywords = keywords(function) if callable(function) else ()
    return call_problem(function, positional, keywords)
