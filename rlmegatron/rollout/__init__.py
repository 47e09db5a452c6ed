"""Rollout engines: the generation interface, the in-process HF engine, and the SGLang server integration."""
from rlmegatron.rollout.engine import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingSpec,
)

__all__ = ["FinishReason", "GenerationRequest", "GenerationResult", "RolloutEngine", "SamplingSpec"]
