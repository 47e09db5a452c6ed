"""The generic registry, plug-in references, and the names each algorithm registry exposes."""

import pytest

from rlmegatron.plugins import PluginError

from rlmegatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    grpo_advantages,
)


def test_register_get_and_aliases():
    registry = Registry("widget")

    @registry.register("square", "sq")
    def square(x):
        return x * x

    assert registry.get("square") is square and registry.get("sq") is square
    assert registry.names() == ("sq", "square")
    assert "sq" in registry and "cube" not in registry
    assert list(registry) == ["sq", "square"]


def test_unknown_name_lists_known_names():
    registry = Registry("widget")
    registry.register("b")(lambda: None)
    registry.register("a")(lambda: None)
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; known: a, b"):
        registry.get("c")
    assert issubclass(UnknownNameError, LookupError)


def test_conflicting_registration_is_refused_but_reregistering_is_idempotent():
    registry = Registry("widget")

    def first():
        return 1

    registry.register("w")(first)
    registry.register("w")(first)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("w")(lambda: 2)
    with pytest.raises(ValueError, match="at least one name"):
        registry.register()


def test_package_registries_expose_the_documented_names():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {
        "gae", "grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gpg", "opo",
    }
    assert set(POLICY_LOSSES.names()) == {"vanilla", "ppo", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"}
    assert set(KL_ESTIMATORS.names()) == {"k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"}
    assert set(LOSS_AGGREGATIONS.names()) == {
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
    }
    # GSPO changes the ratio, not the advantage: its estimator name is GRPO's.
    assert ADVANTAGE_ESTIMATORS.get("gspo") is grpo_advantages


def test_resolve_takes_a_registered_name_or_a_plugin_reference(tmp_path):
    registry = Registry("widget")
    registry.register("square")(lambda x: x * x)
    (tmp_path / "widgets.py").write_text("def cube(x):\n    return x ** 3\n")
    assert registry.resolve("square")(3) == 9
    assert registry.resolve(f"{tmp_path / 'widgets.py'}:cube")(3) == 27
    with pytest.raises(UnknownNameError, match="unknown widget 'cube'"):
        registry.resolve("cube")
    with pytest.raises(PluginError, match="widgets.py defines no 'cub'"):
        registry.resolve(f"{tmp_path / 'widgets.py'}:cub")
