"""Dotted overrides: YAML-typed values, paths checked against the spec, and pass-through dicts."""
import pytest

from rlmegatron.config import JobSpec
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
from rlmegatron.config.overrides import Override, apply_overrides, parse_override
from tests.config.specs import minimal_spec, problems_of


@pytest.mark.parametrize(
    "text, value",
    [
        ("rollout.n=8", 8),
        ("actor.optim.lr=1e-6", 1e-6),
        ("actor.use_kl_loss=true", True),
        ("data.val_files=[a.jsonl, b.jsonl]", ["a.jsonl", "b.jsonl"]),
        ("rollout.num_gpus=null", None),
        ("model.path=Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B"),
        ("trainer.resume=ckpt/step=10", "ckpt/step=10"),
        ("trainer.experiment_name=", ""),
    ],
)
def test_values_are_read_as_yaml(text, value):
    parsed = parse_override(text)
    assert isinstance(parsed, Override)
    assert parsed.value == value


def test_unknown_override_key_suggests_the_nearest():
    assert problems_of(minimal_spec(), "actor.optim.lrr=1e-6") == [
        "command line: actor.optim.lrr=1.0e-06: unknown key 'lrr' in actor.optim; did you mean 'lr'?"
    ]


def test_unknown_top_level_section_suggests_the_nearest():
    assert problems_of(minimal_spec(), "rolout.n=4") == [
        "command line: rolout.n=4: unknown key 'rolout' in the top level; did you mean 'rollout'?"
    ]


def test_unknown_key_without_a_near_match_lists_the_known_keys():
    [problem] = problems_of(minimal_spec(), "reward.zzz=1")
    assert problem.startswith("command line: reward.zzz=1: unknown key 'zzz' in reward; known keys: function, manager,")


def test_override_below_a_value_is_rejected():
    assert problems_of(minimal_spec(), "rollout.n.x=1") == [
        "command line: rollout.n.x=1: rollout.n is a value, not a section"
    ]


def test_override_without_equals_sign_shows_the_syntax():
    assert problems_of(minimal_spec(), "rollout.n") == [
        "command line: rollout.n: an override must look like section.key=value (e.g. rollout.n=8)"
    ]


def test_invalid_yaml_value_is_reported():
    [problem] = problems_of(minimal_spec(), "data.val_files=[a.jsonl")
    assert problem.startswith("command line: data.val_files='[a.jsonl': is not a valid YAML value")


def test_pass_through_dicts_take_any_nested_key():
    spec = spec_from_raw(
        minimal_spec(),
        ["actor.megatron.extra.moe_router_dtype=fp32", "rollout.engine=sglang",
         "rollout.sglang.extra_args.disable-radix-cache=true"],
    )
    assert spec.actor.megatron.extra == {"moe_router_dtype": "fp32"}
    assert spec.rollout.sglang.extra_args == {"disable-radix-cache": True}


def test_override_fills_a_section_left_empty_in_yaml():
    raw = minimal_spec()
    raw["critic"] = None  # `critic:` with nothing under it
    merged, applied, problems = apply_overrides(raw, ["critic.cliprange_value=0.2"], JobSpec)
    assert merged["critic"] == {"cliprange_value": 0.2}
    assert [override.path for override in applied] == ["critic.cliprange_value"]
    assert problems == []


def test_applying_overrides_leaves_the_raw_spec_alone():
    raw = minimal_spec()
    apply_overrides(raw, ["rollout.n=16"], JobSpec)
    assert raw["rollout"]["n"] == 4
