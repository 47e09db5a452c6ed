"""Rank-side bodies of the vision-language tests: a tiny Qwen2.5-VL converted at each layout, its log-probs on
image+text prompts, its round trip back to HF."""
from __future__ import annotations

import json
import os

import torch

from rlmegatron.runtime import ParallelLayout as L
from tests.models.conversion_jobs import _differences
from tests.models.tiny_vl import image_prompts, next_token_log_probs

LAYOUTS = (L(), L(tp=2), L(pp=2), L(tp=2, pp=2))


def hf_vl_log_probs(hf_dir: str) -> torch.Tensor:
    """transformers' own log-probs of the prompts (its own M-RoPE positions: mm_token_type_ids marks the images)."""
    from transformers import AutoModelForImageTextToText

    from tests.models.tiny_vl import IMAGE_TOKEN

    tokens, pixels, grids = image_prompts()
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens, pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids),
                       mm_token_type_ids=(tokens == IMAGE_TOKEN).int()).logits
    return next_token_log_probs(logits, tokens)


def megatron_vl_log_probs(chunks, facts):
    from rlmegatron.models.convert import megatron_logits
    from rlmegatron.models.mrope import mrope_position_ids

    tokens, pixels, grids = image_prompts()
    vision = facts.arch.vision
    positions = mrope_position_ids(tokens, torch.cat(grids), vision.image_token_id, vision.spatial_merge_size)
    logits = megatron_logits(chunks, facts, tokens, positions,
                             [dict(pixel_values=p, image_grid_thw=g) for p, g in zip(pixels, grids)])
    return None if logits is None else next_token_log_probs(logits, tokens)


def _max_diff(reference, log_probs):
    return None if log_probs is None else float((reference - log_probs).abs().max())


def round_trip_job(workdir: str) -> dict:
    """Per layout: HF -> Megatron log-probs vs transformers', Megatron -> HF bitwise (config.json too), and the
    dist checkpoint reloaded at TP=PP=1 giving the same log-probs. Every rank returns its view."""
    from rlmegatron.models.convert import import_hf, load_mcore, save_mcore
    from rlmegatron.resharding import export_hf

    hf_dir = os.path.join(workdir, "hf")
    original = _read(hf_dir)
    reference = hf_vl_log_probs(hf_dir)
    report = {"vision_weights": sum(k.startswith("visual.") for k in original)}
    for layout in LAYOUTS:
        facts, weight_map, chunks = import_hf(hf_dir, layout)
        entry = {"log_probs_vs_hf": _max_diff(reference, megatron_vl_log_probs(chunks, facts)),
                 "vision_tower_here": any(hasattr(c, "vision") and c.vision is not None for c in chunks)}
        mcore_dir, out = os.path.join(workdir, f"{layout}-mcore"), os.path.join(workdir, f"{layout}-hf")
        save_mcore(chunks, weight_map, mcore_dir, "fp32")
        export_hf(chunks, weight_map, out, facts.hf)
        facts, weight_map, chunks = load_mcore(mcore_dir, L())
        entry["reloaded_tp1_log_probs_vs_hf"] = _max_diff(reference, megatron_vl_log_probs(chunks, facts))
        if torch.distributed.get_rank() == 0:
            entry["exported"] = _differences(original, out)
            entry["config_equal"] = _config(out) == _config(hf_dir)
            entry["from_pretrained_log_probs_vs_hf"] = _max_diff(reference, hf_vl_log_probs(out))
        report[str(layout)] = entry
    return report


def _read(directory: str) -> dict:
    from tests.models.conversion_jobs import _read_safetensors

    return _read_safetensors(directory)


def _config(directory: str) -> dict:
    return json.loads(open(os.path.join(directory, "config.json")).read())


def train_step_job(hf_dir: str, freeze: bool) -> dict:
    """One Adam step of the tiny Qwen2.5-VL on the image prompts, the tower frozen or not as the actor builds it
    (freeze_vision_tower before Megatron's DDP); which weights moved."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlmegatron.models.convert import HFCheckpoint, build_chunks, load_hf_weights
    from rlmegatron.models.mrope import mrope_position_ids
    from rlmegatron.models.vision import freeze_vision_tower
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.runtime import init_model_parallel
    from rlmegatron.rank.roles.megatron_step import build_model_chunks

    checkpoint = HFCheckpoint(hf_dir)
    facts = checkpoint.facts(1)
    init_model_parallel(L())

    def provide(pre, post, vp):
        (model,) = build_chunks(facts, L(), "fp32")
        load_hf_weights([model], WeightMap(facts), checkpoint)
        freeze_vision_tower([model], freeze)
        return model

    chunks = build_model_chunks(provide, wrap_ddp=True, use_distributed_optimizer=False)
    before = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), chunks)
    tokens, pixels, grids = image_prompts()
    positions = mrope_position_ids(tokens, torch.cat(grids), facts.arch.vision.image_token_id, 2)

    def forward_step(data_iterator, model):
        next(data_iterator)
        loss = model(tokens, positions, None, labels=tokens, pixel_values=torch.cat(pixels),
                     image_grid_thw=torch.cat(grids))
        return loss, lambda output: (output.float().mean(), {})

    optimizer.zero_grad()
    chunks[0].zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([0]), model=chunks[0],
                                num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=2, forward_only=False)
    optimizer.step()
    after = dict(chunks[0].module.named_parameters())
    moved = {n for n, p in after.items() if not torch.equal(p.detach(), before[n])}
    return {"vision_moved": sum(n.startswith("vision.") for n in moved),
            "language_moved": sum(not n.startswith("vision.") for n in moved),
            "vision_weights": sum(n.startswith("vision.") for n in after)}


def sync_bytes_job(hf_dir: str, freeze: bool) -> dict:
    """Bytes the weight sync's exporter streams at TP=2 after the first push (frozen tower skipped), and in full."""
    from rlmegatron.models.convert import import_hf
    from rlmegatron.models.vision import freeze_vision_tower
    from rlmegatron.resharding.export import HFWeightExporter

    facts, weight_map, chunks = import_hf(hf_dir, L(tp=2))
    freeze_vision_tower(chunks, freeze)
    exporter = HFWeightExporter(chunks, weight_map)

    def nbytes(stream):
        return sum(t.numel() * t.element_size() for _, t in stream)

    later = list(exporter.stream(skip_frozen_vision=True))
    return {"later_sync": nbytes(later), "full": nbytes(exporter.stream()),
            "later_names": sorted({name.split(".")[0] for name, _ in later})}
