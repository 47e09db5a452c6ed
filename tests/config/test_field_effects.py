"""No setting without an effect: every leaf of the job spec has an entry in tests/config/field_effects.py naming the
tests that show what it changes, and every test named there exists (read with `ast`; nothing is imported or run)."""
from __future__ import annotations

import ast
import functools
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from rlmegatron.config.spec import JobSpec
from tests.config.field_effects import EFFECTS

REPO_ROOT = Path(__file__).resolve().parents[2]

def sections_in(annotation) -> list[type[BaseModel]]:
    """The spec sections an annotation names (`Section`, `Section | None`), or none for a leaf."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [arg for arg in typing.get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
    return []


def leaves(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """Every dotted field of the spec that holds a value rather than a section; a dict field is one leaf."""
    found = []
    for name, field in model.model_fields.items():
        sections = sections_in(field.annotation)
        if sections:
            found += [leaf for section in sections for leaf in leaves(section, f"{prefix}{name}.")]
        else:
            found.append(prefix + name)
    return found


@functools.cache
def defined_tests(path: str) -> frozenset[str]:
    """`name` and `Class::name` of every test function defined in a test file."""
    tree = ast.parse((REPO_ROOT / path).read_text(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(names)


def missing_test(node_id: str) -> str | None:
    """Why `node_id` (path::name, path::Class::name, each with an optional [parameters]) names no test, or None."""
    path, _, name = node_id.partition("::")
    name = name.split("[", 1)[0]
    if not path.startswith("tests/") or not path.endswith(".py") or not name:
        return f"{node_id}: not a test node id (tests/path.py::test_name)"
    if not (REPO_ROOT / path).is_file():
        return f"{node_id}: no file {path}"
    if name not in defined_tests(path):
        return f"{node_id}: {path} defines no {name}"
    return None


def test_every_leaf_of_the_spec_names_the_tests_of_its_effect():
    missing = [leaf for leaf in leaves() if leaf not in EFFECTS]
    assert not missing, ("spec fields without an effect test; add each to tests/config/field_effects.py with the "
                         "test that shows what it changes (or that it is rejected): " + ", ".join(missing))


def test_every_entry_is_a_leaf_of_the_spec_and_in_order():
    fields = set(leaves())
    assert not [name for name in EFFECTS if name not in fields], \
        f"entries for fields the spec does not have: {[name for name in EFFECTS if name not in fields]}"
    assert list(EFFECTS) == sorted(EFFECTS), "keep tests/config/field_effects.py sorted by field"


def test_every_named_test_exists():
    problems = []
    for field, (changes, node_ids) in EFFECTS.items():
        if not changes or not node_ids:
            problems.append(f"{field}: needs what it changes and at least one test")
        problems += [f"{field}: {why}" for why in map(missing_test, node_ids) if why]
    assert not problems, "\n".join(problems)
