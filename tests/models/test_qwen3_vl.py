"""Qwen3-VL: the family reads transformers' config and tower (DeepStack mergers included), interleaved M-RoPE and
the positions are transformers', and the Megatron model's log-probs on image+text prompts equal transformers' at
TP=1, TP=2, PP=2 and TP=2 x PP=2 (DeepStack through hooks on the first stage's layers), with a bitwise round trip back
to HF that transformers loads and generates from as from the original."""
from __future__ import annotations

import pytest
import torch

from rlmegatron.models.families import FAMILIES, architecture_of
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_vl import IMAGE_TOKEN, VL_FAMILIES, image_prompts, save_tiny_vl, vl_config



def test_the_tower_the_family_describes_is_the_one_transformers_builds():
    from transformers import Qwen3VLForConditionalGeneration

    config = vl_config("qwen3_vl")
    model = Qwen3VLForConditionalGeneration(config)
    arch = architecture_of(config.to_dict())
    built = {name: tuple(p.shape) for name, p in model.model.visual.named_parameters()}
    assert arch.vision.parameter_shapes() == built
    assert arch.vision.num_parameters == sum(p.numel() for p in model.model.visual.parameters())
    assert arch.vision.deepstack_layers == len(model.model.visual.deepstack_merger_list) == 2
    assert arch.qk_norm and not arch.qkv_bias and arch.head_dim == 16 and arch.num_hidden_layers == 4


@pytest.mark.parametrize("model_type", VL_FAMILIES)
def test_vision_defaults_are_transformers_own(model_type):
    from transformers import AutoConfig

    vision = AutoConfig.for_model(model_type).vision_config
    defaults = FAMILIES[model_type].vision_defaults
    assert {key: getattr(vision, key) for key in defaults} == dict(defaults)


def test_interleaved_mrope_takes_each_frequency_from_transformers_axis():
    """Which of time, height and width each rotary frequency reads: transformers' Qwen3-VL recomposition of a
    frequency tensor whose every value is its axis, against models.mrope.interleaved_mrope_axes."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from rlmegatron.models.mrope import interleaved_mrope_axes

    for section, head_dim in (([24, 20, 20], 128), ([2, 3, 3], 16), ([4, 2, 2], 16)):
        text = vl_config("qwen3_vl", head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}).text_config
        rotary = Qwen3VLTextRotaryEmbedding(text)
        axis_valued = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, head_dim // 2).clone()
        expected = rotary.recomposition_frequencies(axis_valued)[0, 0, : head_dim // 2].long()
        assert torch.equal(interleaved_mrope_axes(section, head_dim // 2), expected), section
    # Not Qwen2.5-VL's contiguous sections.
    assert interleaved_mrope_axes([2, 3, 3], 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


def test_mrope_positions_are_qwen3_vl_get_rope_index():
    from transformers import Qwen3VLForConditionalGeneration

    from rlmegatron.models.mrope import mrope_position_ids

    model = Qwen3VLForConditionalGeneration(vl_config("qwen3_vl"))
    tokens, _, grids = image_prompts(seed=3)
    grid = torch.cat(grids)
    mask = torch.ones_like(tokens)
    mask[1, -3:] = 0  # a padded tail
    expected, _ = model.model.get_rope_index(tokens, (tokens == IMAGE_TOKEN).int(), grid, attention_mask=mask)
    assert torch.equal(mrope_position_ids(tokens, grid, IMAGE_TOKEN, 2, attention_mask=mask), expected)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests.models.vision_jobs import round_trip

    workdir = str(tmp_path_factory.mktemp("qwen3_vl"))
    save_tiny_vl(f"{workdir}/hf", model_type="qwen3_vl")
    return round_trip(workdir)


@pytest.mark.timeout(500)
def test_log_probs_on_images_equal_transformers_and_the_export_generates_as_the_original(report):
    from tests.models.vision_jobs import check_round_trip_report

    # patch embedding (2) and position grid, 3 blocks of 12, the merger and 2 DeepStack mergers of 6 each
    assert report[1]["vision_weights"] == 3 + 3 * 12 + 3 * 6
    check_round_trip_report(report)
    # DeepStack's layers 0 and 1 must be on the tower's stage: with one layer there, the first stage refuses.
    refusals = [rank["one_layer_first_stage"] for rank in report[0]]
    assert sum(r is not None for r in refusals) == 2, refusals  # the first stage's ranks, at TP=1 x DP=2
    assert "num_layers_in_first_pipeline_stage >= 2" in next(r for r in refusals if r), refusals


def test_a_pipeline_split_that_takes_deepstack_layers_off_the_first_stage_is_refused_before_any_rank_starts():
    from tests.config.specs import problems_with

    # Qwen3-VL-8B adds DeepStack features after decoder layers 0, 1 and 2.
    fix = "set actor.megatron.extra.num_layers_in_first_pipeline_stage >= 3, or lower the (virtual) pipeline size"
    first = problems_with({"actor.megatron.pipeline_model_parallel_size": 2,
                           "actor.megatron.extra": {"num_layers_in_first_pipeline_stage": 2}}, "qwen3-vl-8b")
    assert len(first) == 1 and "extra.num_layers_in_first_pipeline_stage=2: puts 2 decoder" in first[0], first
    assert first[0].endswith(fix)
    virtual = problems_with({"actor.megatron.pipeline_model_parallel_size": 2,
                             "actor.megatron.virtual_pipeline_model_parallel_size": 18}, "qwen3-vl-8b")
    assert len(virtual) == 1 and "pipeline_model_parallel_size=2: puts 1 decoder" in virtual[0], virtual
    assert problems_with({"actor.megatron.pipeline_model_parallel_size": 2}, "qwen3-vl-8b") == []


def test_a_full_recompute_which_would_rerun_deepstack_layers_without_their_features_is_refused():
    from tests.config.specs import problems_with

    (full,) = problems_with({"actor.megatron.recompute_granularity": "full"}, "qwen3-vl-8b")
    assert "actor.megatron.recompute_granularity=full: reruns decoder layers" in full and full.endswith(
        "use selective or none")
    assert problems_with({"actor.megatron.recompute_granularity": "selective"}, "qwen3-vl-8b") == []
    assert problems_with({"actor.megatron.recompute_granularity": "full"}, "qwen2.5-vl-7b") == []  # no DeepStack


@pytest.mark.timeout(300)
def test_a_frozen_towers_weights_are_not_resent_after_the_first_sync(tmp_path):
    from safetensors.torch import load_file

    from tests.models.vision_jobs import sync_bytes_job

    hf_dir = save_tiny_vl(str(tmp_path / "hf"), model_type="qwen3_vl")
    tensors = load_file(f"{hf_dir}/model.safetensors")
    language = sum(t.numel() * t.element_size() for k, t in tensors.items() if not k.startswith("model.visual."))
    everything = sum(t.numel() * t.element_size() for t in tensors.values())
    frozen = run_ranks(sync_bytes_job, 2, hf_dir, True, timeout_s=240)[0]
    trained = run_ranks(sync_bytes_job, 2, hf_dir, False, timeout_s=240)[0]
    assert frozen["later_sync"] == language < everything == frozen["full"]
    assert trained["later_sync"] == trained["full"] == everything
