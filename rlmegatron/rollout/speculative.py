"""MTP speculative decoding in the local engine (rollout.speculative): the model's first MTP layer drafts k tokens,
chained (each draft step takes the previous step's output and drafted token, as SGLang's NEXTN reuses its one MTP
layer), and one forward of the main model over the pending token and the k drafts verifies them.

Acceptance is the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): draft x, drawn from the
draft's distribution q, is kept with probability min(1, p(x) / q(x)), p the main model's; at the first rejection the
token is drawn from norm(max(0, p - q)); when all k are kept, one more from p. Every token is then distributed as
the main model's sampler draws it (p and q both after temperature, top-k and top-p, as `_sample` filters); greedy
rows keep a draft exactly when it is the main model's argmax. The reported log-probs are the main model's (the local
engine's convention), from the verification forward.

The batch's rows accept different numbers of drafts: the main model's KV cache keeps a rejected draft's entry and the
attention mask hides it from then on (as the left padding of the prompts is hidden), so no row waits for another. Once
hidden entries are most of a cache, it is compacted: each row's visible entries moved to its end (`_compacted`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from rlmegatron.rollout.engine import FinishReason, GenerationResult
from rlmegatron.rollout.sampling import RequestSample, filter_for_samples, prompt_batch, raise_if_not_finite

if TYPE_CHECKING:
    from rlmegatron.rollout.mtp_draft import MTPDraft


class DecodingEngine(Protocol):
    """What speculative decoding reads of the engine it decodes for (rollout.local.LocalEngine, which holds the
    decoder: a protocol, so that this module does not import it back)."""

    model: nn.Module
    device: torch.device
    generator: torch.Generator
    pad_token_id: int
    eos_token_ids: frozenset[int]
    cache_argument: str
    """The model's forward's name for the KV cache."""
    weight_version: str | None


@dataclass
class _Rows:
    """What each row of the batch has produced so far."""

    outputs: list[list[int]]
    logprobs: list[list[float]]
    finish: list[FinishReason | None]
    verifications: list[int]
    accepted: list[int]

    def commit(self, samples: list[RequestSample], eos: frozenset, tokens: list[list[int]], logprobs: list[list[float]]
               ) -> None:
        """Appends each unfinished row's tokens until one ends it (a stop token, max_new_tokens)."""
        for row, sample in enumerate(samples):
            for token, logprob in zip(tokens[row], logprobs[row]):
                if self.finish[row] is not None:
                    break
                self.outputs[row].append(token)
                self.logprobs[row].append(logprob)
                if token in sample.sampling.stop_token_ids or token in eos:
                    self.finish[row] = "stop"
                elif len(self.outputs[row]) >= sample.sampling.max_new_tokens:
                    self.finish[row] = "length"


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor,
                  greedy: torch.Tensor, main_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts per row [B], the distribution of each row's next token [B, V]).

    `p` [B, k+1, V]: the main model's distributions at the pending token and each draft; `q` [B, k, V]: the draft's;
    `drafts` [B, k]; `uniform` [B, k]; `greedy` [B] rows decoding greedily, whose draft j is kept when it equals
    `main_argmax` [B, k+1] at j (their next token is main_argmax at the first mismatch, not a draw).
    """
    k = drafts.shape[1]
    p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_draft = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    # u < p/q, written without the division: q of a drawn draft is positive.
    kept = torch.where(greedy.unsqueeze(-1), drafts == main_argmax[:, :k], uniform * q_draft < p_draft)
    accepted = kept.long().cumprod(-1).sum(-1)
    rows = torch.arange(len(drafts), device=drafts.device)
    p_next = p[rows, accepted]
    residual = (p_next - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0)
    residual = torch.where((accepted < k).unsqueeze(-1), residual, p_next)
    # Rejection needs p(x) < q(x), so p exceeds q somewhere: an all-zero residual is rounding where p equals q.
    return accepted, torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)


def _compacted(cache, mask: torch.Tensor) -> torch.Tensor:
    """The attention mask after the KV cache `cache` keeps only its visible entries (`mask` 1), each row's right-
    aligned in their order, the rows left-padded to the longest (as the prompts are); the cache as it is while the
    visible entries are at least half of it. A hidden entry is never attended, so the attention is the same."""
    keep = mask.bool()
    width = int(keep.sum(-1).max())
    if 2 * width > mask.shape[1]:
        return mask
    # A stable sort puts each row's hidden columns first and its visible ones, in order, last.
    index = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices[:, -width:]
    for layer in cache.layers:
        for name in ("keys", "values"):
            held = getattr(layer, name)  # [rows, heads, positions, dim]
            setattr(layer, name, held.gather(2, index[:, None, :, None].expand(*held.shape[:2], width,
                                                                               held.shape[-1])))
    return mask.gather(-1, index)


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] (unnormalised, float64) by inverse CDF from `uniform` [B] in [0, 1)."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1).clamp(
        max=probs.shape[-1] - 1)


class SpeculativeDecoder:
    """Generates a batch of the local engine's samples with `draft` proposing `num_draft_tokens` per verification."""

    def __init__(self, draft: "MTPDraft", num_draft_tokens: int) -> None:
        self.draft, self.k = draft, num_draft_tokens

    @torch.inference_mode()
    def generate_batch(self, engine: DecodingEngine, samples: list[RequestSample],
                       interrupted: Callable[[], bool] | None = None) -> list[GenerationResult]:
        from transformers import DynamicCache

        k, draft, model = self.k, self.draft, engine.model
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        batch = len(samples)
        prompts = prompt_batch(samples, engine.pad_token_id, engine.device)
        device = prompts.input_ids.device
        temperatures = torch.tensor([s.sampling.temperature for s in samples], device=device)
        greedy = temperatures == 0
        divisors = torch.where(greedy, torch.ones_like(temperatures), temperatures).view(-1, 1, 1)
        uniforms = _Uniforms(samples, engine.generator)
        rows = _Rows([[] for _ in samples], [[] for _ in samples], [None] * batch, [0] * batch, [0] * batch)

        def distributions(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """(logits at temperature, sampling distribution after top-k/top-p in float64, argmax) of [B, m, V]."""
            scaled = logits.float() / divisors
            return scaled, torch.softmax(filter_for_samples(scaled, samples).double(), -1), scaled.argmax(-1)

        # Prefill: the main model over the distinct prompts, then a row per sample; its first token as `_sample`'s.
        out = decoder(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                      position_ids=prompts.position_ids, use_cache=True, **{engine.cache_argument: None})
        cache, hidden = getattr(out, engine.cache_argument), out.last_hidden_state
        input_ids, mask, positions = prompts.input_ids, prompts.attention_mask, prompts.position_ids
        if prompts.distinct < batch:
            cache.reorder_cache(prompts.prompt_of)
            hidden, input_ids, mask, positions = (t[prompts.prompt_of] for t in (hidden, input_ids, mask, positions))
        logits = head(hidden[:, -1:])
        raise_if_not_finite(logits[:, -1], 0, rows.finish)
        scaled, p, argmax = distributions(logits)
        logprobs = torch.log_softmax(scaled, -1)
        pending = torch.where(greedy, argmax[:, 0], _draw(p[:, 0], uniforms(1)[:, 0]))
        rows.commit(samples, engine.eos_token_ids, [[t] for t in pending.tolist()],
                    [[v] for v in logprobs[:, 0].gather(-1, pending.unsqueeze(-1)).squeeze(-1).tolist()])

        # The draft layer's prefill: each prompt position's hidden state with the token after it (the first output
        # token after the last); its last output drafts from there on.
        draft_cache = DynamicCache()
        draft_mask = mask
        out, draft_logits = draft(hidden, torch.cat([input_ids[:, 1:], pending.unsqueeze(-1)], -1), positions, mask,
                                  draft_cache)
        position = positions[:, -1:] + 1  # the pending token's
        while not all(reason is not None for reason in rows.finish):
            if interrupted is not None and interrupted():
                rows.finish = [reason or "abort" for reason in rows.finish]
                break
            noise = uniforms(2 * k + 1)
            # Draft k tokens, the first from the last draft output, each next one from the step before.
            drafts, q = [], []
            step_out, step_logits = out[:, -1:], draft_logits[:, -1:]
            for j in range(k):
                if j > 0:
                    draft_mask = torch.cat([draft_mask, draft_mask.new_ones((batch, 1))], -1)
                    step_out, step_logits = draft(step_out, drafts[-1].unsqueeze(-1), position + j - 1, draft_mask,
                                                  draft_cache)
                _, q_j, q_argmax = distributions(step_logits)
                drafts.append(torch.where(greedy, q_argmax[:, 0], _draw(q_j[:, 0], noise[:, j])))
                q.append(q_j[:, 0])
            drafts_t = torch.stack(drafts, -1)
            # Verify: one forward of the main model over the pending token and the drafts.
            mask = torch.cat([mask, mask.new_ones((batch, k + 1))], -1)
            out = decoder(input_ids=torch.cat([pending.unsqueeze(-1), drafts_t], -1), attention_mask=mask,
                          position_ids=position + torch.arange(k + 1, device=device), use_cache=True,
                          **{engine.cache_argument: cache})
            cache, hidden = getattr(out, engine.cache_argument), out.last_hidden_state
            logits = head(hidden)
            for j in range(k + 1):
                raise_if_not_finite(logits[:, j], max(map(len, rows.outputs)) + j, rows.finish)
            scaled, p, argmax = distributions(logits)
            logprobs = torch.log_softmax(scaled, -1)
            accepted, next_probs = accept_drafts(p, torch.stack(q, 1), drafts_t, noise[:, k:2 * k], greedy, argmax)
            next_token = torch.where(greedy, argmax.gather(-1, accepted.unsqueeze(-1)).squeeze(-1),
                                     _draw(next_probs, noise[:, 2 * k]))
            # Row r's tokens: its accepted drafts, then the next token, at verification positions 0..accepted[r].
            tokens = torch.cat([drafts_t, drafts_t[:, :1]], -1).scatter(-1, accepted.unsqueeze(-1),
                                                                       next_token.unsqueeze(-1))
            chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            counts = accepted.tolist()
            for row, count in enumerate(counts):
                if rows.finish[row] is None:
                    rows.verifications[row] += 1
                    rows.accepted[row] += count
            rows.commit(samples, engine.eos_token_ids, [t[:c + 1] for t, c in zip(tokens.tolist(), counts)],
                        [v[:c + 1] for v, c in zip(chosen.tolist(), counts)])
            # A rejected draft's entry stays in the main cache, hidden from every later query.
            mask[:, -(k + 1):] = (torch.arange(k + 1, device=device) <= accepted.unsqueeze(-1)).to(mask.dtype)
            # The draft cache drops its chained steps (their inputs were drafts) and takes the verified positions:
            # each accepted draft's main hidden state with the token after it, right-aligned, a masked hole before.
            draft_cache.crop(-(k - 1))
            draft_mask = draft_mask[:, : draft_mask.shape[1] - (k - 1)]
            width = max(counts) + 1
            index = torch.arange(width, device=device) - (width - 1 - accepted).unsqueeze(-1)
            valid, index = index >= 0, index.clamp(min=0)
            draft_mask = torch.cat([draft_mask, valid.to(draft_mask.dtype)], -1)
            out, draft_logits = draft(hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])),
                                      tokens.gather(1, index), position + index, draft_mask, draft_cache)
            mask, draft_mask = _compacted(cache, mask), _compacted(draft_cache, draft_mask)
            pending, position = next_token, position + accepted.unsqueeze(-1) + 1
        return [
            GenerationResult(
                request_index=sample.request_index,
                sample_index=sample.sample_index,
                output_token_ids=tuple(rows.outputs[row]),
                output_token_logprobs=tuple(rows.logprobs[row]),
                finish_reason=rows.finish[row] or "length",
                weight_version=engine.weight_version,
                spec_verify_ct=rows.verifications[row],
                spec_num_correct_drafts=rows.accepted[row],
                spec_num_proposed_drafts=rows.verifications[row] * k,
            )
            for row, sample in enumerate(samples)
        ]


class _Uniforms:
    """Uniforms in [0, 1) for the rows' draws, float64: a seeded sample's from its own generator (its stream does not
    depend on the batch), the others' from the engine's in one draw."""

    def __init__(self, samples: list[RequestSample], generator: torch.Generator) -> None:
        self.generators = [s.generator for s in samples]
        self.shared = [row for row, g in enumerate(self.generators) if g is None]
        self.generator = generator

    def __call__(self, count: int) -> torch.Tensor:
        device = self.generator.device
        uniform = torch.empty((len(self.generators), count), dtype=torch.float64, device=device)
        for row, generator in enumerate(self.generators):
            if generator is not None:
                uniform[row].uniform_(generator=generator)
        if self.shared:
            uniform[self.shared] = torch.rand((len(self.shared), count), generator=self.generator,
                                              dtype=torch.float64, device=device)
        return uniform
