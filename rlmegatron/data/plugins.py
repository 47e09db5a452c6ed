"""Loading user plug-ins named as `path/to/file.py:name` (custom datasets and reward functions)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A plug-in reference that cannot be loaded; the message names the file and the attribute."""


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
