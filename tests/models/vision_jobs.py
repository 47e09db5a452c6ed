"""Rank-side bodies of the vision-language tests: a tiny Qwen2.5-VL or Qwen3-VL converted at each layout, its
log-probs on image+text prompts, its round trip back to HF and what transformers generates from the export."""
from __future__ import annotations

import json
import os

import torch

from rlmegatron.runtime import ParallelLayout as L
from tests.models.conversion_jobs import _differences, _max_diff, _read_safetensors
from tests.models.tiny_vl import image_prompts, next_token_log_probs

LAYOUTS = (L(), L(tp=2), L(pp=2), L(tp=2, pp=2))


LOG_PROB_TOLERANCE = 1e-5


def check_round_trip_report(report: tuple[list[dict], dict]) -> None:
    """What round_trip's reports must show for any family, at every layout: log-probs equal transformers' on each
    rank that has them, also reloaded at TP=1 and from the export; the tower on the first pipeline stage only; the
    export bitwise, its config.json equal; transformers generates from the export as from the original."""
    ranks, checked = report
    generated, logits = checked["generated"]
    assert [len(row) for row in generated] == [GENERATED_TOKENS] * 2
    for layout in map(str, LAYOUTS):
        entries, entry = [rank[layout] for rank in ranks], checked[layout]
        diffs = [_max_diff(checked["reference"], e["log_probs"]) for e in entries if e["log_probs"] is not None]
        assert len(diffs) == (2 if "PP2" in layout else 4) and max(diffs) < LOG_PROB_TOLERANCE, (layout, diffs)
        assert entry["reloaded_tp1_log_probs_vs_hf"] < LOG_PROB_TOLERANCE, layout
        assert sum(e["vision_tower_here"] for e in entries) == (2 if "PP2" in layout else 4), layout
        assert entry["exported"] == {"key_mismatch": [], "not_bitwise": []}, (layout, entry["exported"])
        assert entry["config_equal"], layout
        assert entry["from_pretrained_log_probs_vs_hf"] < LOG_PROB_TOLERANCE, layout
        assert entry["generated"][0] == generated and torch.equal(entry["generated"][1], logits), layout


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


GENERATED_TOKENS = 8


def hf_vl_generate(hf_dir: str) -> tuple[list[list[int]], torch.Tensor]:
    """The tokens transformers' model in `hf_dir` generates greedily after each image prompt (KV cache, M-RoPE
    positions continued from its rope deltas), and the logits [steps, prompts, vocab] each was picked from (a tiny
    random model may repeat one token; its logits still tell two models apart)."""
    from transformers import AutoModelForImageTextToText

    from tests.models.tiny_vl import IMAGE_TOKEN

    tokens, pixels, grids = image_prompts()
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=tokens, pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids),
                             mm_token_type_ids=(tokens == IMAGE_TOKEN).int(), max_new_tokens=GENERATED_TOKENS,
                             min_new_tokens=GENERATED_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, tokens.shape[1]:].tolist(), torch.stack(out.logits)


def megatron_vl_log_probs(chunks, facts):
    from rlmegatron.models.convert import megatron_logits
    from rlmegatron.models.mrope import mrope_position_ids

    tokens, pixels, grids = image_prompts()
    vision = facts.arch.vision
    positions = mrope_position_ids(tokens, torch.cat(grids), vision.image_token_id, vision.spatial_merge_size)
    logits = megatron_logits(chunks, facts, tokens, positions,
                             [dict(pixel_values=p, image_grid_thw=g) for p, g in zip(pixels, grids)])
    return None if logits is None else next_token_log_probs(logits, tokens)


def round_trip(workdir: str) -> tuple[list[dict], dict]:
    """The VL checkpoint in `workdir`/hf converted at every layout on 4 ranks (convert_job), then checked on one
    (check_job): what round_trip's two reports are, check_round_trip_report says."""
    from rlmegatron.transport.local_ranks import run_ranks

    return run_ranks(convert_job, 4, workdir, timeout_s=400), run_ranks(check_job, 1, workdir, timeout_s=400)[0]


def convert_job(workdir: str) -> dict:
    """Per layout, on every rank: HF -> Megatron, the sharded model's log-probs (None off the last stage), whether
    the tower is here, the dist checkpoint and the HF export straight from the shards."""
    from rlmegatron.models.convert import build_chunks, import_hf, save_mcore
    from rlmegatron.resharding import export_hf
    from rlmegatron.runtime import init_model_parallel

    hf_dir = os.path.join(workdir, "hf")
    report = {}
    for layout in LAYOUTS:
        facts, weight_map, chunks = import_hf(hf_dir, layout)
        report[str(layout)] = {"log_probs": megatron_vl_log_probs(chunks, facts),
                               "vision_tower_here": any(hasattr(c, "vision") and c.vision is not None for c in chunks)}
        save_mcore(chunks, weight_map, os.path.join(workdir, f"{layout}-mcore"), "fp32")
        export_hf(chunks, weight_map, os.path.join(workdir, f"{layout}-hf"), facts.hf)
    # One decoder layer on the first stage: a model with DeepStack layers past it refuses to be built there.
    layout = L(pp=2, first_stage_layers=1)
    init_model_parallel(layout)
    try:
        build_chunks(facts, layout, "fp32")
        report["one_layer_first_stage"] = None
    except ValueError as err:
        report["one_layer_first_stage"] = str(err)
    return report


def check_job(workdir: str) -> dict:
    """On one rank, after convert_job: transformers' log-probs and generation (the reference); per layout, the
    checkpoint reloaded at TP=PP=1, the export's bytes and config.json, and transformers on the export. One rank:
    four at TP=PP=1 would each load and check the same whole model."""
    from rlmegatron.models.convert import load_mcore
    from rlmegatron.models.families import FAMILIES

    hf_dir = os.path.join(workdir, "hf")
    original = _read_safetensors(hf_dir)
    reference = hf_vl_log_probs(hf_dir)
    family = FAMILIES[_config(hf_dir)["model_type"]]
    report = {"reference": reference, "generated": hf_vl_generate(hf_dir),
              "vision_weights": sum(k.startswith(family.hf_vision_prefix) for k in original)}
    for layout in LAYOUTS:
        out = os.path.join(workdir, f"{layout}-hf")
        facts, _, chunks = load_mcore(os.path.join(workdir, f"{layout}-mcore"), L())
        report[str(layout)] = {"reloaded_tp1_log_probs_vs_hf": _max_diff(reference, megatron_vl_log_probs(chunks, facts)),
                               "exported": _differences(original, out), "config_equal": _config(out) == _config(hf_dir),
                               "from_pretrained_log_probs_vs_hf": _max_diff(reference, hf_vl_log_probs(out)),
                               "generated": hf_vl_generate(out)}
    return report


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

    later = list(exporter.stream(skip_frozen=True))
    return {"later_sync": nbytes(later), "full": nbytes(exporter.stream()),
            "later_names": sorted({name.split(".")[0] for name, _ in later})}


# (image sizes in pixels, samples) per prompt: one 8x8 image (1 merged token), a 16x8 and an 8x16 one (2 tokens, the
# grid transposed), two images in one prompt, and a text-only prompt; the first two share their text and their
# images' sizes, so only their pixels tell them apart (shared-prompt groups must not merge them).
ROLLOUT_PROMPTS = (([(8, 8)], 3, "r"), ([(8, 8)], 2, "b"), ([(16, 8)], 2, "g"), ([(8, 16), (8, 8)], 2, "y"),
                   ([], 2, None))
ACTOR_LAYOUTS = {  # settings of each micro-batching the parity test runs
    "padded": dict(use_packing=False, share_prompts=False, micro_batch_size=3),
    "packed": dict(use_packing=True, share_prompts=False, micro_batch_size=4),
    "token_budget": dict(use_packing=True, share_prompts=False, max_token_len=40),
    "shared_prompts": dict(share_prompts=True, micro_batch_size=4),
}


# (prompt, sample) whose response holds the image placeholder token: one in a prompt with images, one text-only.
SAMPLED_PLACEHOLDER = {(0, 1), (4, 0)}


def vision_rollout(hf_dir: str):
    """(Samples, GenerationResults, the actor's RolloutBatch) of ROLLOUT_PROMPTS, the images read through the
    image processor in `hf_dir` as the driver reads them (rollout_data.build_batch, with_images)."""
    from rlmegatron.data import Sample
    from rlmegatron.data.images import ImagePrompts, PromptImages
    from rlmegatron.driver.rollout_data import build_batch, with_images
    from rlmegatron.rollout.engine import GenerationResult
    from tests.data.vision_assets import png
    from tests.models.tiny_vl import IMAGE_TOKEN, VISION_END, VISION_START

    gen = torch.Generator().manual_seed(5)
    images = ImagePrompts(hf_dir, _TokenIds(IMAGE_TOKEN), "images", 64 * 64)
    samples, results = [], []
    for index, (sizes, n, colour) in enumerate(ROLLOUT_PROMPTS):
        data = tuple(png(colour, size) for size in sizes)
        prompt_images = PromptImages(data, tuple(images.grids([_decode(d) for d in data]))) if data else None
        ids = [7, 8]
        for grid in (prompt_images.grids if prompt_images else ()):
            ids += [VISION_START] + [IMAGE_TOKEN] * (grid[0] * grid[1] * grid[2] // 4) + [VISION_END]
        ids += [9, 10]
        sample = Sample(index, "", ids, "vision", None, images=prompt_images)
        for k in range(n):
            length = 2 + (index + 2 * k) % 4
            tokens = torch.randint(0, IMAGE_TOKEN, (length,), generator=gen).tolist()
            if (index, k) in SAMPLED_PLACEHOLDER:
                tokens[1] = IMAGE_TOKEN  # a policy can sample the placeholder token: it is text there, no image
            results.append(GenerationResult(len(samples), k, tuple(tokens), (0.0,) * length, "stop"))
            samples.append(sample)
    batch = build_batch([s.prompt_ids for s in samples], results, 6)
    return samples, results, with_images(batch, samples, images)


class _TokenIds:
    """The one tokenizer method ImagePrompts asks: the tiny checkpoint's image pad id (its vocabulary has no text)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.pad_id


def _decode(data: bytes):
    from rlmegatron.data.images import decode_image

    return decode_image(data, "test", 0, 64 * 64)


def hf_rollout_log_probs(hf_dir: str, samples, results) -> list[list[float]]:
    """transformers' log-probs of each response token, one sequence at a time, its images through transformers'
    own processor path (pixel values of the same processor): the prompt with its images, then the response as a
    continuation through the KV cache, as an engine generated it (a placeholder token the policy sampled is text)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from tests.models.tiny_vl import IMAGE_TOKEN

    processor = AutoImageProcessor.from_pretrained(hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for sample, result in zip(samples, results):
        prompt = torch.tensor([sample.prompt_ids])
        extra = {}
        if sample.images is not None:
            pixels = processor(images=[_decode(d) for d in sample.images.data], return_tensors="pt")
            extra = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        response = torch.tensor([list(result.output_token_ids)])
        with torch.no_grad():
            first = model(input_ids=prompt, mm_token_type_ids=(prompt == IMAGE_TOKEN).int(), use_cache=True, **extra)
            rest = model(input_ids=response, past_key_values=first.past_key_values, use_cache=True).logits
        logits = torch.cat([first.logits[:, -1:], rest[:, :-1]], dim=1)
        out.append(torch.log_softmax(logits[0].double(), -1).gather(-1, response[0, :, None])[:, 0].tolist())
    return out


def actor_log_probs_job(hf_dir: str, tp: int) -> dict:
    """The actor worker's log-probs of `vision_rollout` at TP=`tp`, under each micro-batching of ACTOR_LAYOUTS, and
    the micro-batches' shapes (to show each layout ran as named)."""
    from rlmegatron.models.convert import HFCheckpoint, load_hf_weights
    from rlmegatron.models.hf_config import build_gpt_model, transformer_config
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.rank.roles import ActorSettings, ActorWorker
    from rlmegatron.rank.roles.megatron_step import unwrap
    from rlmegatron.runtime import ParallelLayout, init_model_parallel

    layout = ParallelLayout(tp=tp)
    init_model_parallel(layout)
    checkpoint = HFCheckpoint(hf_dir)
    facts = checkpoint.facts(layout.tp)
    config = transformer_config(facts, layout)
    _, _, batch = vision_rollout(hf_dir)
    report = {}
    for name, fields in ACTOR_LAYOUTS.items():
        actor = ActorWorker(ActorSettings(vocab_size=facts.vocab_size, **fields),
                            lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
        actor.init(parallel_state_ready=True)
        load_hf_weights([unwrap(chunk) for chunk in actor.chunks], WeightMap(facts), checkpoint)
        micro = actor._micro_batches(batch)
        log_probs, _ = actor.compute_log_prob(batch, with_entropy=False)
        report[name] = {"log_probs": log_probs, "micro_batches": len(micro),
                        "packed": [m.packed_seq_params is not None for m in micro],
                        "shared": [type(m.packed_seq_params).__name__ == "SharedPromptParams" for m in micro],
                        "images": [0 if m.image_grid_thw is None else len(m.image_grid_thw) for m in micro]}
    checkpoint.close()
    return report
