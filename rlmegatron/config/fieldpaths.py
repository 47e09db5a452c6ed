"""Walks the JobSpec field tree by dotted path: which keys exist where, and the nearest key to a typo."""
from __future__ import annotations

import types
import typing
from collections.abc import Sequence

from pydantic import BaseModel

from rlmegatron.config.errors import did_you_mean


def _unwrap(annotation: object) -> object:
    """Strip Annotated[...] and Optional[...] down to the type a present value has."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            present = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(present) != 1:
                return annotation
            annotation = present[0]
        else:
            return annotation


def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_passthrough(annotation: object) -> bool:
    # Free-form dicts (megatron.extra, sglang.extra_args) take any key below them.
    return annotation is dict or typing.get_origin(annotation) is dict


def section_at(root: type[BaseModel], keys: Sequence[str]) -> type[BaseModel] | None:
    """The section model found by following `keys` from `root`, or None if they do not lead to one."""
    section = root
    for key in keys:
        field = section.model_fields.get(key)
        if field is None:
            return None
        annotation = _unwrap(field.annotation)
        if not _is_section(annotation):
            return None
        section = annotation
    return section


def unknown_key_reason(root: type[BaseModel], keys: Sequence[str]) -> str:
    """Why the last of `keys` is not a field of the section the others lead to."""
    where = ".".join(keys[:-1]) or "the top level"
    section = section_at(root, keys[:-1])
    known = list(section.model_fields) if section is not None else []
    return f"unknown key '{keys[-1]}' in {where}; {did_you_mean(keys[-1], known)}"


def path_problem(root: type[BaseModel], keys: Sequence[str]) -> str | None:
    """Why `keys` names no settable field of `root`, or None when it does."""
    section = root
    for depth, key in enumerate(keys):
        field = section.model_fields.get(key)
        if field is None:
            return unknown_key_reason(root, keys[: depth + 1])
        annotation = _unwrap(field.annotation)
        is_last = depth == len(keys) - 1
        if _is_passthrough(annotation) or is_last:
            return None
        if not _is_section(annotation):
            return f"{'.'.join(keys[: depth + 1])} is a value, not a section"
        section = annotation
    return None
