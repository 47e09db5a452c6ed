"""What plain and speculative decoding in the local engine share: the samples a batch generates, the prompts'
prefill batch (each distinct prompt once), the top-k/top-p filter and the finite-logits check."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlmegatron.data.images import PromptImages
from rlmegatron.errors import Divergence
from rlmegatron.rollout.engine import SamplingSpec


@dataclass
class RequestSample:
    """One response to generate: its request and index among the request's n, its prompt, how to sample it, its own
    generator when seeded, its images."""

    request_index: int
    sample_index: int
    prompt: tuple[int, ...]
    sampling: SamplingSpec
    generator: torch.Generator | None
    images: PromptImages | None = None


def filter_top_k_top_p(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) the tokens outside the top-k and outside the smallest nucleus holding `top_p` of the mass."""
    logits = scaled_logits
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p; the first token always stays.
        outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return logits


def raise_if_not_finite(logits: torch.Tensor, position: int, finish: list) -> None:
    """Divergence if a sample still generating has logits that are NaN, +inf or all -inf: sampling would fail on
    them and greedy decoding would pick an arbitrary token. A -inf on some tokens (a masked vocabulary) is fine.
    One reduction over the logits, beside the sampling's own."""
    top = logits.amax(dim=-1)  # NaN if any logit is NaN, inf if any is +inf, -inf if all are
    bad = [row for row, value in enumerate(top.tolist()) if finish[row] is None and not math.isfinite(value)]
    if bad:
        raise Divergence(f"rollout logits: NaN or inf for {len(bad)} of the {len(finish)} samples at response "
                         f"token {position + 1}; the rollout model's weights are not usable")


@dataclass(frozen=True)
class PromptBatch:
    """A batch's prompts, left-padded: each distinct prompt (its tokens and its images) once."""

    prompt_of: torch.Tensor
    """[samples]: each sample's row among the distinct prompts."""
    padding: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    images: list
    """Each distinct prompt's images (None: none)."""

    @property
    def distinct(self) -> int:
        return len(self.padding)


def prompt_batch(samples: list[RequestSample], pad_token_id: int, device: torch.device) -> PromptBatch:
    """The samples of one prompt (GRPO's n per prompt) share its prefill, as SGLang's prefix cache does: each
    distinct prompt is run once and its KV cache rows repeated, 1/n of the prefill's compute. A prompt is its tokens
    and its images: same-sized images have the same placeholder tokens."""
    distinct: dict[tuple, int] = {}
    prompt_of = torch.tensor([distinct.setdefault((s.prompt, s.images), len(distinct)) for s in samples],
                             device=device)
    prompts = [prompt for prompt, _ in distinct]
    prompt_width = max(len(prompt) for prompt in prompts)
    # Left-padded, each tensor made whole from Python lists: faster than a tensor per prompt copied into place
    # (benchmarks/RESULTS.md, "Measured reasons in the code").
    padding = [prompt_width - len(prompt) for prompt in prompts]
    input_ids = torch.tensor([(pad_token_id,) * pad + prompt for pad, prompt in zip(padding, prompts)], device=device)
    attention_mask = torch.tensor([[0] * pad + [1] * (prompt_width - pad) for pad in padding], device=device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return PromptBatch(prompt_of, padding, input_ids, attention_mask, position_ids,
                       [prompt_images for _, prompt_images in distinct])


def filter_for_samples(scaled: torch.Tensor, samples: list[RequestSample]) -> torch.Tensor:
    """`scaled` (logits / temperature, a row per sample first) with each sample's top-k/top-p filter applied; the
    filtering runs on the whole batch at once."""
    filtered = scaled
    for top_k, top_p in {(s.sampling.top_k, s.sampling.top_p) for s in samples}:
        rows = [row for row, s in enumerate(samples) if (s.sampling.top_k, s.sampling.top_p) == (top_k, top_p)]
        if len(rows) == len(samples):
            # One setting for the batch, as a rollout has: no copy and scatter of the rows, and none of the logits
            # at all without top-k/top-p (benchmarks/RESULTS.md, "Measured reasons in the code").
            filtered = filter_top_k_top_p(scaled, top_k, top_p)
        else:
            filtered = scaled.clone() if filtered is scaled else filtered
            filtered[rows] = filter_top_k_top_p(scaled[rows], top_k, top_p)
    return filtered
