"""YAML in and out for job specs: safe_load that also reads 1e-6 as a float, and block-style dumps."""
from __future__ import annotations

import re
from typing import Any

import yaml


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: PyYAML's 1.1 rules read `1e-6` (no dot) as a string."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """Parse one YAML document (a spec file or an override value); raises yaml.YAMLError."""
    return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass


def dump_yaml(data: Any) -> str:
    """Block-style YAML in the given key order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
