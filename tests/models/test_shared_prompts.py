"""Shared-prompt micro-batches (models/shared_prompts.py) against HF transformers, each sequence run on its own."""
import os

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import save_tiny_model

# Qwen3: query/key norms, grouped KV heads, tied embeddings; Llama-3.2's rope scaling, applied by Megatron's table.
FAMILIES = ("qwen3", "llama3.2_rope")
PROMPT_COLUMNS, RESPONSE_COLUMNS = 8, 6


def _grouped_batch(vocab_size: int):
    """Three prompts (3, 5 and 8 tokens) with three responses each (0-6 tokens), rows in a shuffled order."""
    from rlmegatron.rank.roles.batch import RolloutBatch

    generator = torch.Generator().manual_seed(4)
    rows = []
    for prompt_length, response_lengths in ((3, (2, 0, 6)), (5, (1, 4, 4)), (8, (6, 3, 1))):
        prompt = torch.randint(0, vocab_size, (prompt_length,), generator=generator)
        for response_length in response_lengths:
            ids = torch.zeros(PROMPT_COLUMNS + RESPONSE_COLUMNS, dtype=torch.long)
            mask = torch.zeros_like(ids)
            ids[PROMPT_COLUMNS - prompt_length : PROMPT_COLUMNS] = prompt
            ids[PROMPT_COLUMNS : PROMPT_COLUMNS + response_length] = torch.randint(0, vocab_size, (response_length,),
                                                                                  generator=generator)
            mask[PROMPT_COLUMNS - prompt_length : PROMPT_COLUMNS + response_length] = 1
            rows.append((ids, mask))
    order = torch.randperm(len(rows), generator=generator).tolist()
    return RolloutBatch(torch.stack([rows[i][0] for i in order]), torch.stack([rows[i][1] for i in order]),
                        torch.stack([rows[i][1][PROMPT_COLUMNS:] for i in order]).float())


def _hf_response_log_probs(hf_dir: str, batch) -> torch.Tensor:
    """[B, R] log p of each response token, each row's real tokens run alone through the HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    grid = torch.zeros(batch.response_mask.shape)
    with torch.no_grad():
        for row in range(len(batch)):
            real = batch.attention_mask[row].bool()
            tokens = batch.input_ids[row][real]
            log_probs = torch.log_softmax(model(tokens[None]).logits[0].float(), -1)
            prompt_length = int(real[:PROMPT_COLUMNS].sum())
            for k in range(len(tokens) - prompt_length):
                grid[row, k] = log_probs[prompt_length + k - 1, tokens[prompt_length + k]]
    return grid


def shared_prompt_job(workdir: str) -> dict:
    from rlmegatron.models.convert import import_hf
    from rlmegatron.models.shared_prompts import rope_at_token_positions, shared_prompts_supported
    from rlmegatron.runtime import ParallelLayout
    from rlmegatron.rank.roles.batch import build_shared_prompt_micro_batch

    report = {}
    for name in FAMILIES:
        hf_dir = save_tiny_model(name, os.path.join(workdir, name))
        facts, _, chunks = import_hf(hf_dir, ParallelLayout())
        model = chunks[0].eval()
        batch = _grouped_batch(facts.vocab_size)
        micro = build_shared_prompt_micro_batch(batch, list(range(len(batch))))
        params = micro.packed_seq_params
        with torch.no_grad(), rope_at_token_positions(model, micro.position_ids, params.max_seqlen_q):
            logits = model(micro.input_ids, micro.position_ids, None, packed_seq_params=params)
        predicting = logits.reshape(-1, logits.shape[-1])[micro.source_index, : facts.vocab_size]
        log_probs = torch.log_softmax(predicting, -1).gather(1, micro.target_labels[:, None]).squeeze(1)
        shared = micro.targets_to_grid(log_probs)
        report[name] = {
            "supported": shared_prompts_supported(chunks),
            "max_diff": float((shared - _hf_response_log_probs(hf_dir, batch)).abs().max()),
            "tokens": (micro.input_ids.shape[1], int(batch.attention_mask.sum())),
            "targets": (len(micro.target_index), int(batch.response_mask.sum())),
        }
    # MLA applies its own rotary embedding inside attention, and DeepSeek-V3's MTP layers shift labels: not supported.
    _, _, chunks = import_hf(save_tiny_model("deepseek_v3", os.path.join(workdir, "deepseek_v3")), ParallelLayout())
    report["deepseek_v3"] = {"supported": shared_prompts_supported(chunks)}
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_ranks(shared_prompt_job, 1, str(tmp_path_factory.mktemp("shared")), timeout_s=300)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_response_after_its_shared_prompt_has_the_log_probs_hf_gives_the_sequence_alone(report, family):
    result = report[family]
    assert result["supported"]
    assert result["max_diff"] < 1e-5, result
    laid_out, real = result["tokens"]
    assert laid_out == real - 2 * 3 - 2 * 5 - 2 * 8  # each prompt once instead of three times
    assert result["targets"][0] == result["targets"][1]  # every response token predicted, the first ones included


def test_a_model_with_multi_latent_attention_does_not_share_prompts(report):
    assert report["deepseek_v3"]["supported"] is False
