"""Rollout samples (rollout_data.traced_samples' rows) as every backend shows them: text to read, and a table."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def format_samples(samples: Sequence[Mapping[str, Any]], step: int) -> str:
    """Rollout samples for reading: each prompt once, then each of its responses with its score (and a multi-turn
    response's turns and tool calls)."""
    lines = [f"══ step {step}: rollout samples ══"]
    shown_prompt = None
    for sample in samples:
        if sample["prompt"] != shown_prompt or sample["sample"] == 0:
            shown_prompt = sample["prompt"]
            lines += [f"── prompt {sample['sample_id']} (ground truth: {sample['ground_truth']}) ──", sample["prompt"]]
        agent = (f", {sample['turns']} turns, {sample['tool_calls']} tool calls ({sample['tool_errors']} failed)"
                 if "turns" in sample else "")
        lines += [f"── response {sample['sample']}: score {sample['score']:.4g}, reward {sample['reward']:.4g}, "
                  f"{sample['response_length']} tokens{agent} ──", sample["response"]]
    return "\n".join(lines) + "\n"


def sample_table(samples: Sequence[Mapping[str, Any]], step: int) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows, one row per sample, led by the step: MLflow's log_table layout, which a W&B Table takes
    as it is."""
    columns = ["step", *samples[0]]
    return columns, [[step, *(sample[key] for key in columns[1:])] for sample in samples]
