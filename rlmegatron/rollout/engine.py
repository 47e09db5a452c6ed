"""The rollout engine contract: typed generation requests/results and the abstract engine every backend implements."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence, Union

import torch

from rlmegatron.data.images import PromptImages
from rlmegatron.rollout.buckets import FlattenedBucket
from rlmegatron.tracking.progress import Progress

FinishReason = Literal["stop", "length", "abort"]

NamedTensor = tuple[str, torch.Tensor]
WeightStream = Iterable[Union[NamedTensor, FlattenedBucket]]
"""What `update_weights` consumes: HF-named full tensors, or buckets already flattened by `buckets.py`."""

MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
INITIAL_VERSION = "init"
"""The weight version of the weights the run starts from (before any update)."""
"""SGLang's memory-saver tags; the local engine accepts the same names."""


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Makes sampling reproducible; None draws from the engine's generator."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {self.n} and {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"invalid sampling parameters {self}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    tool_context: Optional[Mapping[str, Any]] = field(default=None, hash=False, compare=False)
    """Multi-turn: the prompt row's extra_info, which its tools see (`agent.tools.ToolContext`)."""
    return_routed_experts: bool = False
    """MoE: the results carry each token's experts (`GenerationResult.routed_experts`)."""
    images: Optional[PromptImages] = field(default=None, hash=False, compare=False)
    """A vision-language prompt's images (encoded bytes and patch grids), whose placeholder tokens the prompt holds:
    the local engine runs them through its image processor, SGLang gets them as `image_data`."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a prompt needs at least one token")


@dataclass(frozen=True)
class AgentRecord:
    """What a multi-turn sample did (`rlmegatron.rollout.agent_loop`)."""

    turns: int
    tool_calls: int
    tool_errors: int
    """Calls that raised, timed out, named no known tool or could not be read."""
    tool_timeouts: int
    tool_setup_errors: int
    """Tools' per-trajectory `create` or `release` that raised or timed out."""
    tool_reward: float
    """The sum of the tools' reward deltas, added to the sample's reward."""
    answer_start: int
    """Where the model's last turn (its final answer) starts in `output_token_ids`."""
    tool_metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationResult:
    """One sample. `output_token_logprobs[i]` is log p(output_token_ids[i]) under softmax(logits / temperature),
    without top-p/top-k renormalisation (SGLang's `output_token_logprobs` convention); greedy uses temperature 1."""

    request_index: int
    """Position of the originating request in the `generate` call; a request with n samples yields n results."""
    sample_index: int
    output_token_ids: tuple[int, ...]
    output_token_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: str | None = None
    """The weights that produced the last token."""
    token_weight_versions: tuple[str | None, ...] = ()
    """The weights that produced each token, when they changed mid-sample (partial rollout); empty: all of them
    came from `weight_version`."""
    response_mask: tuple[int, ...] | None = None
    """Multi-turn: 1 on the model's tokens, 0 on tool answers and template tokens (whose log-probs are 0);
    None: every output token is the model's."""
    agent: AgentRecord | None = None
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    """When asked (`GenerationRequest.return_routed_experts`): the experts each MoE layer chose for each token the
    engine ran, [prompt + output - 1 tokens, MoE layers, top-k] int16 (SGLang's convention: the last output token is
    never fed back)."""
    spec_verify_ct: int = 0
    """Speculative decoding (rollout.speculative): the main model's verification forwards this sample took; 0 without
    speculative decoding. The three spec_ fields are SGLang's meta_info names."""
    spec_num_correct_drafts: int = 0
    """Drafted tokens the verifications accepted."""
    spec_num_proposed_drafts: int = 0
    """Drafted tokens proposed (num_draft_tokens per verification)."""

    def checked_routing(self, prompt_length: int, answer: str) -> torch.Tensor:
        """`routed_experts`, which must hold a row for each token the engine ran after a prompt of `prompt_length`;
        `answer` names this answer in the error (a missing or short record is never replayed as free routing)."""
        expected = prompt_length + len(self.output_token_ids) - 1
        routed = self.routed_experts
        if routed is None or routed.shape[0] != expected:
            got = "none" if routed is None else f"{routed.shape[0]} tokens"
            raise ValueError(f"the engine's answer to {answer} has routing for {got}, not the {expected} tokens it "
                             f"ran (prompt + response - 1); routing replay cannot route it as the rollout did")
        return routed

    @property
    def oldest_weight_version(self) -> str | None:
        return self.token_weight_versions[0] if self.token_weight_versions else self.weight_version


def version_step(version: str | None) -> int:
    """The trainer step whose update produced weight version `version`: k for "step_<k>", else 0 (the initial
    weights: "init", or a server's own name for the weights it loaded)."""
    return int(version[5:]) if version and version.startswith("step_") else 0


class RolloutEngine(abc.ABC):
    """Generates samples and takes new weights; results come back ordered by (request_index, sample_index)."""

    stale: bool = False
    """Restarted after a failure and not yet given the trained weights: `generate` refuses until `update_weights`."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest], progress: Progress = None) -> list[GenerationResult]:
        """`progress` is told of finished samples (`tracking.progress.report`)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: WeightStream, version: str) -> None:
        """Loads every tensor of the stream (an unknown name is an error) and tags later samples with `version`."""

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None: ...

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None: ...

    def wake_up_with_weights(self, named_tensors: WeightStream, version: str) -> None:
        """After training: weights memory back, new weights in, then the KV cache (and CUDA graphs) back,
        so the KV cache never competes with the weight buckets for memory."""
        self.resume_memory(["weights"])
        self.update_weights(named_tensors, version)
        self.resume_memory(["kv_cache", "cuda_graph"])

    @abc.abstractmethod
    def health(self) -> bool: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


def check_memory_tags(tags: Sequence[str]) -> tuple[str, ...]:
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
    return tuple(tags)
