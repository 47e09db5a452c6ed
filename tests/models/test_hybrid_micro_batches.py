"""A hybrid model (Qwen3.5-MoE's Gated DeltaNet and gated attention) through every micro-batch path of the actor:
right-padded rows, THD-packed rows, a token budget, and shared prompts asked for (which such a model lays out packed:
its recurrence would carry one response into the next). Each path's log-probs are transformers' own, row by row."""
from __future__ import annotations

import torch

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import save_tiny_model

VARIANTS = {
    "padded": dict(use_packing=False, share_prompts=False, micro_batch_size=1),
    "packed": dict(use_packing=True, share_prompts=False, micro_batch_size=4),
    "token-budget": dict(use_packing=True, share_prompts=False, max_token_len=16),
    "shared-prompt asked": dict(use_packing=True, share_prompts=True, micro_batch_size=4),
}


def paths_job(path: str) -> dict:
    from rlmegatron.models.convert import HFCheckpoint, load_hf_weights
    from rlmegatron.models.hf_config import build_gpt_model, transformer_config
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.rank.roles import ActorSettings, ActorWorker
    from rlmegatron.rank.roles.megatron_step import unwrap
    from rlmegatron.rank.roles.training import micro_batches
    from rlmegatron.runtime import ParallelLayout, init_model_parallel
    from tests.models.lora_jobs import SETTINGS
    from tests.rank.roles.jobs import _layout_of, rollout_batch

    layout = ParallelLayout()
    init_model_parallel(layout)
    checkpoint = HFCheckpoint(path)
    facts = checkpoint.facts(layout.tp)
    config = transformer_config(facts, layout)
    batch = rollout_batch(n=8, seed=5, samples_per_prompt=4)  # two prompts of four responses: sharing would pay
    report = {"batch": batch}
    for label, settings in VARIANTS.items():
        actor = ActorWorker(ActorSettings(**{**SETTINGS, **settings}, vocab_size=facts.vocab_size),
                            lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
        actor.init(parallel_state_ready=True)
        load_hf_weights([unwrap(chunk) for chunk in actor.chunks], WeightMap(facts), checkpoint)
        report[label] = {"log_probs": actor.compute_log_prob(batch, with_entropy=False)[0],
                         "layouts": sorted({_layout_of(micro) for micro in micro_batches(actor.settings, batch,
                                                                                          actor.chunks)})}
    checkpoint.close()
    return report


def _transformers_log_probs(path: str, batch) -> torch.Tensor:
    """Each row's response log-probs from transformers' model of the checkpoint, on the row's real tokens alone."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    out = torch.zeros_like(batch.response_mask)
    with torch.no_grad():
        for row in range(len(batch)):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()]
            responses = int(batch.response_mask[row].sum())
            log_probs = model(ids[None]).logits[0, :-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]
            out[row, :responses] = log_probs[-responses:]
    return out


def test_every_micro_batch_path_of_a_hybrid_model_gives_transformers_log_probs(tmp_path):
    path = save_tiny_model("qwen3_5_moe", str(tmp_path / "hf"), vocab_size=128)
    report = run_ranks(paths_job, 1, path)[0]
    reference = _transformers_log_probs(path, report["batch"])
    mask = report["batch"].response_mask.bool()
    assert report["padded"]["layouts"] == ["padded"]
    assert report["packed"]["layouts"] == report["token-budget"]["layouts"] == ["packed"]
    assert report["shared-prompt asked"]["layouts"] == ["packed"]  # not laid out shared for a recurrence
    for label in VARIANTS:
        off = (report[label]["log_probs"] - reference)[mask].abs().max()
        assert off < 1e-5, (label, float(off))
