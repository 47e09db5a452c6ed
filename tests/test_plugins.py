"""Plug-in references: loading `file.py:name`, and checking a plug-in against the call it will get."""
import pytest

from rlmegatron.plugins import PluginError, call_problem, is_plugin_reference, load_plugin, plugin_problem

PLUGIN = """
import math

LIMIT = 3

def scale(x, y, *, factor=2.0):
    return (x + y) * factor

def needs_more(x, y, z):
    return x
"""


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_plugin.py"
    path.write_text(PLUGIN)
    return path


def test_reference_form():
    assert is_plugin_reference("dir/my_loss.py:reinforce")
    for text in ("vanilla", "my_loss.py", "my_loss:reinforce", "my_loss.py:1bad"):
        assert not is_plugin_reference(text), text


def test_load_plugin_returns_the_named_object_and_names_what_is_missing(plugin_file):
    assert load_plugin(f"{plugin_file}:scale")(1, 2) == 6.0
    with pytest.raises(PluginError, match="my_plugin.py defines no 'scal'"):
        load_plugin(f"{plugin_file}:scal")
    with pytest.raises(PluginError, match="no such file"):
        load_plugin(f"{plugin_file.parent / 'absent.py'}:scale")


def test_call_problem_binds_without_calling():
    def loss(a, b, *, config, aggregation=None):
        raise AssertionError("never called")

    assert call_problem(loss, ["a", "b"], ["config", "aggregation"]) is None
    assert call_problem(loss, ["a", "b"], ["config", "extra"]) == (
        "cannot be called as loss(a, b, config=, extra=): got an unexpected keyword argument 'extra'"
    )
    assert call_problem(loss, ["a", "b"], []) == "cannot be called as loss(a, b): missing a required argument: 'config'"
    assert call_problem(loss, ["a", "b", "c"], ["config"]) == (
        "cannot be called as loss(a, b, c, config=): too many positional arguments"
    )
    assert call_problem(3, ["a"]) == "is not a function that can be called as (a); it is of type int"


def test_plugin_problem_covers_loading_and_the_call(plugin_file, tmp_path):
    assert plugin_problem(f"{plugin_file}:scale", ["x", "y"], ["factor"]) is None
    assert plugin_problem(f"{plugin_file}:needs_more", ["x", "y"]) == (
        "cannot be called as needs_more(x, y): missing a required argument: 'z'"
    )
    assert plugin_problem(f"{plugin_file}:LIMIT", ["x"]) == (
        "is not a function that can be called as (x); it is of type int"
    )
    assert plugin_problem(f"{plugin_file}:nope", ["x"]) == "my_plugin.py defines no 'nope'"
    # Keywords chosen by the plug-in's own signature (the estimator protocol):
    assert plugin_problem(f"{plugin_file}:needs_more", ["x", "y"], lambda fn: ["z"]) is None
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    assert plugin_problem(f"{broken}:f", ["x"]) == (
        f"importing {broken} raised ModuleNotFoundError: No module named 'no_such_module_here'"
    )
