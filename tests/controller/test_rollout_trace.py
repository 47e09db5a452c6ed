"""Which rollout samples a step traces, and how they read: whole groups, in rollout order, decoded."""
import torch

from rlmegatron.controller.rollout_data import Rollout, traced_samples
from rlmegatron.data import Sample
from rlmegatron.rollout.engine import GenerationResult


class SpecialTokenTokenizer:
    """Ids below 3 are special tokens, shown as <s> unless skipped; id i >= 3 is the letter chr(94 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i < 3 and skip_special_tokens else "<s>" if i < 3 else chr(94 + i) for i in ids)


def rollout() -> Rollout:
    """Three prompts (groups 7, 5, 9 in rollout order), two responses each; scores 0.5 * row."""
    prompts = [Sample(index=i, prompt=[], prompt_ids=[1, 3 + i], data_source="s", ground_truth=i) for i in range(3)]
    uids, rows, results = [7, 7, 5, 5, 9, 9], [0, 0, 1, 1, 2, 2], []
    for row, prompt in enumerate(rows):
        results.append(GenerationResult(request_index=prompt, sample_index=row % 2,
                                        output_token_ids=(3 + row, 2), output_token_logprobs=(-0.1, -0.2),
                                        finish_reason="stop"))
    scores = 0.5 * torch.arange(6, dtype=torch.float32)
    return Rollout([prompts[p] for p in rows], uids, results, batch=None, scores=scores, rewards=scores - 1,
                   reward_metrics={})


def test_the_first_groups_in_rollout_order_with_every_response_decoded():
    samples = traced_samples(rollout(), SpecialTokenTokenizer(), prompts=2)
    assert [(s["sample_id"], s["sample"]) for s in samples] == [("s#0", 0), ("s#0", 1), ("s#1", 0), ("s#1", 1)]
    assert [s["prompt"] for s in samples] == ["<s>a", "<s>a", "<s>b", "<s>b"]  # the template's tokens kept
    assert [s["response"] for s in samples] == ["a", "b", "c", "d"]  # EOS (a special token) skipped
    assert [s["score"] for s in samples] == [0.0, 0.5, 1.0, 1.5]
    assert [s["reward"] for s in samples] == [-1.0, -0.5, 0.0, 0.5]
    assert [s["ground_truth"] for s in samples] == ["0", "0", "1", "1"]
    assert {s["response_length"] for s in samples} == {2}


def test_no_limit_traces_every_group():
    samples = traced_samples(rollout(), SpecialTokenTokenizer(), prompts=None)
    assert [s["sample_id"] for s in samples] == ["s#0", "s#0", "s#1", "s#1", "s#2", "s#2"]
