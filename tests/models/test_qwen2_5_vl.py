"""Qwen2.5-VL: the family reads transformers' config and tower, M-RoPE positions are transformers', and the
Megatron model's log-probs on image+text prompts equal transformers' at TP=1, TP=2, PP=2 and TP=2 x PP=2, with a
bitwise round trip back to HF (vision tower and config.json included)."""
from __future__ import annotations

import pytest
import torch

from rlmegatron.models.families import architecture_of
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_vl import IMAGE_TOKEN, image_prompts, save_tiny_vl, vl_config



def test_the_tower_the_family_describes_is_the_one_transformers_builds():
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = vl_config()
    model = Qwen2_5_VLForConditionalGeneration(config)
    arch = architecture_of(config.to_dict())
    built = {name: tuple(p.shape) for name, p in model.model.visual.named_parameters()}
    assert arch.vision.parameter_shapes() == built
    assert arch.vision.num_parameters == sum(p.numel() for p in model.model.visual.parameters())
    assert arch.num_hidden_layers == 4 and arch.qkv_bias and arch.hidden_size == 64


def test_mrope_positions_are_transformers_get_rope_index():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rlmegatron.models.mrope import mrope_position_ids

    model = Qwen2_5_VLForConditionalGeneration(vl_config())
    tokens, _, grids = image_prompts(seed=3)
    grid = torch.cat(grids)
    mask = torch.ones_like(tokens)
    mask[1, -3:] = 0  # a padded tail
    expected, _ = model.model.get_rope_index(tokens, (tokens == IMAGE_TOKEN).int(), grid, attention_mask=mask)
    ours = mrope_position_ids(tokens, grid, IMAGE_TOKEN, 2, attention_mask=mask)
    assert torch.equal(ours, expected)
    # On an image the three rows differ (time, height, width); on text they agree; padding is 0.
    assert not torch.equal(ours[0], ours[1]) and not torch.equal(ours[1], ours[2])
    assert ours[:, 0, -1].tolist() == [11, 11, 11] and ours[:, 1, -3:].abs().sum() == 0


def test_a_placeholder_token_after_the_prompt_columns_is_text():
    """A policy may sample the image placeholder token (a random one does); in the response columns it is text,
    one position past the previous token, and asks no image of the grids."""
    from rlmegatron.models.mrope import mrope_position_ids

    tokens, _, grids = image_prompts(seed=3)
    response = torch.tensor([[5, IMAGE_TOKEN], [IMAGE_TOKEN, IMAGE_TOKEN]])
    rows = torch.cat([tokens, response], dim=1)
    ours = mrope_position_ids(rows, torch.cat(grids), IMAGE_TOKEN, 2, prompt_columns=tokens.shape[1])
    prompt_only = mrope_position_ids(tokens, torch.cat(grids), IMAGE_TOKEN, 2)
    assert torch.equal(ours[..., :tokens.shape[1]], prompt_only)
    last = prompt_only[:, :, -1:]
    assert torch.equal(ours[..., tokens.shape[1]:], torch.cat([last + 1, last + 2], dim=-1))
    with pytest.raises((ValueError, RuntimeError)):  # without prompt_columns the response's token asks an image
        mrope_position_ids(rows, torch.cat(grids), IMAGE_TOKEN, 2)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests.models.vision_jobs import round_trip

    workdir = str(tmp_path_factory.mktemp("vl"))
    save_tiny_vl(f"{workdir}/hf")
    return round_trip(workdir)


@pytest.mark.timeout(500)
def test_log_probs_on_images_equal_transformers_and_the_round_trip_is_bitwise(report):
    from tests.models.vision_jobs import check_round_trip_report

    assert report[1]["vision_weights"] == 1 + 2 * 12 + 5  # patch embedding, 2 blocks, merger
    check_round_trip_report(report)
    # No DeepStack: any pipeline split builds.
    assert all(rank["one_layer_first_stage"] is None for rank in report[0])


def test_actor_vision_freeze_reaches_the_trainer_ranks():
    from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from tests.config.specs import minimal_spec

    assert trainer_rank_settings(spec_from_raw(minimal_spec("tiny-qwen3"), []), 1).freeze_vision is True
    unfrozen = spec_from_raw(minimal_spec("tiny-qwen3"), ["actor.vision.freeze=false"])
    assert trainer_rank_settings(unfrozen, 1).freeze_vision is False


@pytest.mark.timeout(300)
def test_a_frozen_tower_keeps_its_weights_through_an_update_and_a_trained_one_moves(tmp_path):
    from tests.models.vision_jobs import train_step_job

    hf_dir = save_tiny_vl(str(tmp_path / "hf"))
    (frozen,) = run_ranks(train_step_job, 1, hf_dir, True, timeout_s=240)
    (trained,) = run_ranks(train_step_job, 1, hf_dir, False, timeout_s=240)
    assert frozen["vision_weights"] == trained["vision_weights"] == 30
    assert frozen["vision_moved"] == 0 and frozen["language_moved"] > 0
    assert trained["vision_moved"] == 30 and trained["language_moved"] == frozen["language_moved"]


@pytest.mark.timeout(300)
def test_a_frozen_towers_weights_are_not_resent_after_the_first_sync(tmp_path):
    from safetensors.torch import load_file

    from tests.models.vision_jobs import sync_bytes_job

    hf_dir = save_tiny_vl(str(tmp_path / "hf"))
    tensors = load_file(f"{hf_dir}/model.safetensors")
    language = sum(t.numel() * t.element_size() for k, t in tensors.items() if not k.startswith("visual."))
    everything = sum(t.numel() * t.element_size() for t in tensors.values())
    frozen = run_ranks(sync_bytes_job, 2, hf_dir, True, timeout_s=240)[0]
    trained = run_ranks(sync_bytes_job, 2, hf_dir, False, timeout_s=240)[0]
    assert frozen["later_sync"] == language < everything == frozen["full"]
    assert trained["later_sync"] == trained["full"] == everything
    assert frozen["later_names"] == ["lm_head", "model"]


def test_context_and_sequence_parallelism_are_refused_before_any_rank_starts():
    from tests.config.specs import problems_with

    why = "a vision-language model's image embeddings replace placeholders of whole sequences; use"
    cp = problems_with({"actor.megatron.context_parallel_size": 2}, "qwen2.5-vl-7b")
    assert any(p.endswith(f"actor.megatron.context_parallel_size=2: {why} 1") for p in cp), cp
    sp = problems_with({"actor.megatron.tensor_model_parallel_size": 2, "actor.megatron.sequence_parallel": True},
                       "qwen2.5-vl-7b")
    assert any(p.endswith(f"actor.megatron.sequence_parallel=true: {why} false") for p in sp), sp
    assert problems_with({"actor.megatron.tensor_model_parallel_size": 2}, "qwen2.5-vl-7b") == []
