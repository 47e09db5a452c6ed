"""Minimal valid job specs for the config tests, and the problems a variant of one raises."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rlmegatron.config import SpecError
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "configs" / "models"
SPEC_FILE = "job.yaml"


def minimal_spec(model: str = "tiny-qwen3") -> dict[str, Any]:
    """A raw spec that passes every check: tiny model, 8 CPU ranks, GRPO with groups of 4."""
    return copy.deepcopy(
        {
            "model": {"path": str(MODELS_DIR / model)},
            "data": {
                "train_files": ["train.parquet"],
                "val_files": ["val.parquet"],
                "max_prompt_length": 64,
                "max_response_length": 64,
                "train_batch_size": 16,
            },
            "actor": {"ppo_mini_batch_size": 8},
            "rollout": {"engine": "local", "n": 4},
            "placement": {"device": "cpu", "nnodes": 1, "gpus_per_node": 8},
        }
    )


def problems_with(settings: dict[str, Any], model: str = "tiny-qwen3") -> list[str]:
    """problems_of(minimal_spec(model)) with `settings` ({"rollout.n": 1, ...}) written into its YAML."""
    raw = minimal_spec(model)
    for path, value in settings.items():
        *sections, key = path.split(".")
        target = raw
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
    return problems_of(raw)


def problems_of(raw: dict[str, Any], *overrides: str) -> list[str]:
    """Every rejection of `raw` plus `overrides`, as printed; empty when the spec is accepted."""
    try:
        spec_from_raw(raw, overrides, file=SPEC_FILE)
    except SpecError as err:
        return [str(problem) for problem in err.problems]
    return []
