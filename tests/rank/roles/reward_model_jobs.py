"""Rank-side body of the reward-model tests: a tiny HF sequence-classification model scored at a layout."""
from __future__ import annotations

from dataclasses import replace

from rlmegatron.models.convert import HFCheckpoint
from rlmegatron.models.hf_config import build_gpt_model, transformer_config
from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.rank.roles.reward_model import RewardModelSettings, RewardModelWorker


def reward_model_job(path: str, layouts: list[ParallelLayout], sequences: list[list[int]]) -> dict:
    """Scores of `sequences` at each layout (micro-batches of 2, so several passes with different padding)."""
    scores = {}
    for layout in layouts:
        init_model_parallel(layout)
        facts = replace(HFCheckpoint(path).facts(layout.tp), tie_word_embeddings=False)
        config = transformer_config(facts, layout)
        worker = RewardModelWorker(RewardModelSettings(micro_batch_size=2),
                                   lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
        worker.init()
        worker.load(path, facts)
        worker.offload()
        worker.onload()
        scores[str(layout)] = worker.score(sequences)
    return scores
