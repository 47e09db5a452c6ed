"""Driver-side rollout data: prompts -> requests, engine results -> a RolloutBatch, scores and step metrics."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlmegatron.data import Sample
from rlmegatron.rewards import RewardInput, RewardResult
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, SamplingSpec
from rlmegatron.models.mrope import mrope_position_ids
from rlmegatron.rank.roles import RolloutBatch
from rlmegatron.rank.roles.batch import BatchImages


@dataclass
class Rollout:
    """One step's responses: row i is response `results[i]` to prompt `prompts[i]`, in group `uids[i]`."""

    prompts: list[Sample]
    uids: list[int]
    results: list[GenerationResult]
    batch: RolloutBatch
    scores: torch.Tensor
    """[B] what the reward function returned."""
    rewards: torch.Tensor
    """[B] scores plus any shaping (DAPO overlong penalty): what the estimator sees."""

    def __len__(self) -> int:
        return len(self.uids)

    def select(self, rows: Sequence[int]) -> Rollout:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return Rollout(
            prompts=[self.prompts[i] for i in rows],
            uids=[self.uids[i] for i in rows],
            results=[self.results[i] for i in rows],
            batch=self.batch.select(index),
            scores=self.scores[index],
            rewards=self.rewards[index],
        )

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        return Rollout(
            prompts=[p for part in parts for p in part.prompts],
            uids=[u for part in parts for u in part.uids],
            results=[r for part in parts for r in part.results],
            batch=concat_batches([part.batch for part in parts]),
            scores=torch.cat([part.scores for part in parts]),
            rewards=torch.cat([part.rewards for part in parts]),
        )


def sampling_spec(params, max_new_tokens: int, stop_token_ids: Sequence[int], seed: int) -> SamplingSpec:
    return SamplingSpec(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )


def shard_requests(requests: list[GenerationRequest], parts: int) -> list[list[GenerationRequest]]:
    """Contiguous, near-equal shares of the requests, one per engine."""
    size, extra = divmod(len(requests), parts)
    shares, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        shares.append(requests[start:end])
        start = end
    return shares


def merge_results(shares: list[list[GenerationRequest]], answers: list[list[GenerationResult]]) -> list[GenerationResult]:
    """Per-engine results -> one list whose request_index counts over all requests."""
    merged, offset = [], 0
    for share, results in zip(shares, answers):
        merged += [dataclasses.replace(result, request_index=result.request_index + offset) for result in results]
        offset += len(share)
    return merged


def build_batch(prompt_ids: list[list[int]], results: list[GenerationResult], response_width: int) -> RolloutBatch:
    """Left-padded prompts then right-padded responses; rollout log-probs aligned with response_mask, which is 0 on
    a multi-turn response's tool answers (`GenerationResult.response_mask`)."""
    # One tensor built from flat lists and scattered in place, not a few small tensors per row: per-row slicing
    # was the reward phase's largest part (benchmarks/RESULTS.md, "Measured reasons in the code").
    prompt_width = max(len(p) for p in prompt_ids)
    rows = len(results)
    input_ids = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids])
    response_lengths = torch.tensor([len(r.output_token_ids) for r in results])
    columns = torch.arange(prompt_width + response_width)
    in_prompt = (columns >= prompt_width - prompt_lengths[:, None]) & (columns < prompt_width)
    in_response = (columns >= prompt_width) & (columns < prompt_width + response_lengths[:, None])
    input_ids[in_prompt] = torch.tensor([token for prompt in prompt_ids for token in prompt], dtype=torch.long)
    input_ids[in_response] = torch.tensor([t for r in results for t in r.output_token_ids], dtype=torch.long)
    attention_mask = (in_prompt | in_response).long()
    response_cells = in_response[:, prompt_width:]
    response_mask = response_cells.float()
    if any(r.response_mask is not None for r in results):
        response_mask[response_cells] = torch.tensor(
            [m for r in results for m in (r.response_mask or [1] * len(r.output_token_ids))], dtype=torch.float)
    rollout_log_probs = torch.zeros(rows, response_width)
    rollout_log_probs[response_cells] = torch.tensor(
        [v for r in results for v in r.output_token_logprobs], dtype=torch.float)
    routed = None
    if any(r.routed_experts is not None for r in results):
        # Every token the engine ran: the prompt and the response but its last token, whose record would come from a
        # call that never happens. Tool answers route freely (-1): the engine read them, the policy did not write them.
        ran = in_prompt | (in_response & (columns < prompt_width + response_lengths[:, None] - 1))
        routed = torch.full((*input_ids.shape, *_routing_shape(results)), -1, dtype=torch.int16)
        routed[ran] = torch.cat([r.checked_routing(len(prompt), f"request {r.request_index} (sample "
                                                                 f"{r.sample_index}, row {index})")
                                 for index, (r, prompt) in enumerate(zip(results, prompt_ids))])
        routed[:, prompt_width:][response_cells & (response_mask == 0)] = -1
    return RolloutBatch(input_ids, attention_mask, response_mask, rollout_log_probs=rollout_log_probs,
                        routed_experts=routed)


def with_images(batch: RolloutBatch, prompts: Sequence[Sample], image_prompts: Any) -> RolloutBatch:
    """`batch` (row i answering `prompts[i]`) with its prompts' images as the actor takes them: pixel values from the
    image processor (`image_prompts`, data.images.ImagePrompts) and every token's M-RoPE positions over the whole
    row, prompt and response; `batch` itself when no prompt has images."""
    if all(p.images is None or not p.images.data for p in prompts):
        return batch
    if image_prompts is None:
        raise ValueError("prompts with images need the model's image processor; a data.dataset_class that yields "
                         "images must be read with the model's processor (RLDataset's image_prompts)")
    pixels, grids, per_row = [], [], []
    for prompt in prompts:
        count = 0 if prompt.images is None else len(prompt.images.data)
        if count:
            pixel_values, grid_thw = image_prompts.pixel_values(prompt.images)
            pixels.append(pixel_values)
            grids.append(grid_thw)
        per_row.append(count)
    grid_thw = torch.cat(grids).long()
    positions = mrope_position_ids(batch.input_ids, grid_thw, image_prompts.pad_id, image_prompts.merge,
                                   batch.attention_mask, batch.input_ids.shape[1] - batch.response_length)
    return dataclasses.replace(batch, images=BatchImages(torch.cat(pixels), grid_thw, torch.tensor(per_row)),
                               mrope_positions=positions.permute(1, 2, 0).contiguous())


def _routing_shape(results: list[GenerationResult]) -> tuple[int, int]:
    return next(tuple(r.routed_experts.shape[1:]) for r in results if r.routed_experts is not None)


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """Rows of several batches in one; narrower prompt blocks are left-padded to the widest."""
    width = max(b.input_ids.shape[1] for b in batches)

    def left_pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0))

    def left_pad_routing(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, 0, width - t.shape[1], 0), value=-1)

    routed = [b.routed_experts for b in batches]
    images = [b.images for b in batches]
    if any(part is None for part in images) and not all(part is None for part in images):
        raise ValueError("cannot concatenate batches with and without images")
    return RolloutBatch(
        input_ids=torch.cat([left_pad(b.input_ids) for b in batches]),
        attention_mask=torch.cat([left_pad(b.attention_mask) for b in batches]),
        response_mask=torch.cat([b.response_mask for b in batches]),
        rollout_log_probs=torch.cat([b.rollout_log_probs for b in batches]),
        routed_experts=None if routed[0] is None else torch.cat([left_pad_routing(t) for t in routed]),
        images=None if images[0] is None else BatchImages.concat(images),
        mrope_positions=None if images[0] is None else torch.cat(
            [torch.nn.functional.pad(b.mrope_positions, (0, 0, width - b.input_ids.shape[1], 0)) for b in batches]),
    )


def reward_inputs(prompts: list[Sample], results: list[GenerationResult], tokenizer: Any) -> list[RewardInput]:
    """What the reward function reads; of a multi-turn response, the model's last turn (its final answer)."""
    return [
        RewardInput(
            sample_id=f"{prompt.sample_id}/{result.sample_index}",
            data_source=prompt.data_source,
            solution_str=tokenizer.decode(result.output_token_ids[result.agent.answer_start if result.agent else 0:],
                                          skip_special_tokens=True),
            ground_truth=prompt.ground_truth,
            response_length=len(result.output_token_ids),
            extra_info=prompt.extra_info,
            prompt=prompt.prompt,
            token_ids=(*prompt.prompt_ids, *result.output_token_ids),
        )
        for prompt, result in zip(prompts, results)
    ]


def traced_samples(rollout: Rollout, tokenizer: Any, prompts: int | None) -> list[dict[str, Any]]:
    """The rows of the first `prompts` groups (every group when None), as text: what the policy saw and wrote, and
    what it scored. The prompt keeps its special tokens (the chat template); the response is decoded as the reward
    function read it."""
    groups = list(dict.fromkeys(rollout.uids))
    chosen = set(groups if prompts is None else groups[:prompts])
    prompt_texts: dict[int, str] = {}
    samples = []
    for row, uid in enumerate(rollout.uids):
        if uid not in chosen:
            continue
        prompt = rollout.prompts[row]
        if uid not in prompt_texts:
            prompt_texts[uid] = tokenizer.decode(prompt.prompt_ids, skip_special_tokens=False)
        result = rollout.results[row]
        samples.append({
            "sample_id": prompt.sample_id,
            "sample": result.sample_index,
            "prompt": prompt_texts[uid],
            "response": (tokenizer.decode(result.output_token_ids, skip_special_tokens=True) if result.agent is None
                         else trajectory_text(result, tokenizer)),
            "ground_truth": str(prompt.ground_truth),
            "score": float(rollout.scores[row]),
            "reward": float(rollout.rewards[row]),
            "response_length": len(result.output_token_ids),
            **({} if result.agent is None else {"turns": result.agent.turns, "tool_calls": result.agent.tool_calls,
                                                "tool_errors": result.agent.tool_errors}),
        })
    return samples


def trajectory_text(result: GenerationResult, tokenizer: Any) -> str:
    """A multi-turn response as it went: each model turn, then the tool answers rendered after it, each under a
    label; decoded with the template's tokens, which show where a turn ends and a tool answer begins."""
    parts, turn = [], 0
    for by_model, run in itertools.groupby(zip(result.output_token_ids, result.response_mask), key=lambda p: p[1]):
        turn += bool(by_model)
        parts += [f"[turn {turn}: {'model' if by_model else 'tool answers'}]",
                  tokenizer.decode([token for token, _ in run], skip_special_tokens=False)]
    return "\n".join(parts)


def scored(prompts: list[Sample], uids: list[int], results: list[GenerationResult], batch: RolloutBatch,
           reward: RewardResult) -> Rollout:
    """The reward is the reward manager's plus, for a multi-turn response, its tools' reward deltas."""
    tool_rewards = torch.tensor([r.agent.tool_reward if r.agent else 0.0 for r in results], dtype=torch.float32)
    return Rollout(prompts, uids, results, batch, torch.tensor(reward.scores, dtype=torch.float32),
                   torch.tensor(reward.rewards, dtype=torch.float32) + tool_rewards)


def token_level(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A sequence reward placed on its last model token (a multi-turn response may end with a tool's answer)."""
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    last = ((response_mask > 0) * positions).argmax(-1)
    tokens = torch.zeros_like(response_mask)
    tokens[torch.arange(len(last)), last] = per_sequence
    return tokens * response_mask


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{name}/mean": float(values.mean()), f"{name}/max": float(values.max()), f"{name}/min": float(values.min())}


def batch_metrics(rollout: Rollout, max_response_length: int) -> dict[str, float]:
    """verl's data metrics: scores, rewards, advantages, returns, values, response and prompt lengths; and the
    number of samples."""
    batch = rollout.batch
    mask = batch.response_mask.bool()
    # Every response token, a multi-turn response's tool answers too: the budget they share is max_response_length.
    response_lengths = batch.attention_mask[:, -batch.response_mask.shape[1]:].sum(-1)
    prompt_lengths = batch.attention_mask.sum(-1) - response_lengths
    metrics = {
        "rollout/samples": float(len(rollout.scores)),  # the step's responses: none lost to an engine that left
        **_stats("critic/score", rollout.scores),
        **_stats("critic/rewards", rollout.rewards),
        **_stats("response_length", response_lengths),
        "response_length/clip_ratio": float((response_lengths >= max_response_length).float().mean()),
        **_stats("prompt_length", prompt_lengths),
    }
    for name, value in (("advantages", batch.advantages), ("returns", batch.returns), ("values", batch.values)):
        if value is not None and mask.any():  # rollout correction may have rejected every token
            metrics.update(_stats(f"critic/{name}", value[mask]))
    return metrics | agent_metrics(rollout.results) | speculative_metrics(rollout.results)


def speculative_metrics(results: list[GenerationResult]) -> dict[str, float]:
    """rollout.speculative: the share of the step's drafted tokens that the verifications accepted (SGLang's
    spec_accept_rate, over all samples) and the drafted tokens accepted per verification (0 to num_draft_tokens; the
    tokens a verification yields are one more); none without speculative decoding."""
    verifications = sum(r.spec_verify_ct for r in results)
    if not verifications:
        return {}
    accepted = sum(r.spec_num_correct_drafts for r in results)
    return {"rollout/spec_accept_rate": accepted / sum(r.spec_num_proposed_drafts for r in results),
            "rollout/spec_accepted_tokens_mean": accepted / verifications}


def agent_metrics(results: list[GenerationResult]) -> dict[str, float]:
    """Multi-turn rollouts: turns per trajectory, tool calls, errors and timeouts, tools' create/release failures,
    model tokens per turn, and the tools' own metrics (summed per trajectory, averaged here); none for single
    completions."""
    records = [(r.agent, sum(r.response_mask)) for r in results if r.agent is not None]
    if not records:
        return {}
    metrics = {
        **_stats("agent/turns", torch.tensor([a.turns for a, _ in records])),
        **_stats("agent/tool_calls", torch.tensor([a.tool_calls for a, _ in records])),
        "agent/tool_errors/sum": float(sum(a.tool_errors for a, _ in records)),
        "agent/tool_timeouts/sum": float(sum(a.tool_timeouts for a, _ in records)),
        "agent/tool_setup_errors/sum": float(sum(a.tool_setup_errors for a, _ in records)),
        **_stats("agent/tokens_per_turn", torch.tensor([tokens / max(a.turns, 1) for a, tokens in records])),
        "agent/tool_reward/mean": sum(a.tool_reward for a, _ in records) / len(records),
    }
    for name in sorted({name for a, _ in records for name in a.tool_metrics}):
        metrics[f"agent/{name}/mean"] = sum(a.tool_metrics.get(name, 0.0) for a, _ in records) / len(records)
    return metrics
