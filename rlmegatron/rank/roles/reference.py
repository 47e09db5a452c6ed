"""A frozen policy that only computes log-probs: the reference (a copy of the actor's model or, with LoRA, the actor's
own model with its adapters off), and on-policy distillation's teacher (a model of its own, rank/role_models.py)."""
from __future__ import annotations

from typing import Sequence

from rlmegatron.models.lora import adapters_disabled
from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.rank.roles import megatron_step
from rlmegatron.rank.roles.actor import ActorSettings, compute_log_prob
from rlmegatron.rank.roles.batch import RolloutBatch
from rlmegatron.rank.roles.offload import Offloader
from rlmegatron.rank.roles.training import raise_if_not_finite_tokens


class ReferenceWorker:
    """One rank of the reference policy: no DDP, no optimizer, no gradients.

    It takes ActorSettings because log-probs must be computed exactly as the actor's (temperature,
    vocabulary); only those and the batching fields are used, and the batching is the reference's own.
    """

    def __init__(self, settings: ActorSettings, model_provider: megatron_step.ModelProvider, layout: ParallelLayout,
                 label: str = "ref"):
        self.settings = settings
        self.label = label  # its metrics' and errors' prefix: ref, or teacher
        self.model_provider = model_provider
        self.layout = layout
        self.chunks: list = []
        self.offloader: Offloader | None = None

    def init(self, parallel_state_ready: bool = False) -> None:
        if not parallel_state_ready:
            init_model_parallel(self.layout)
        self.chunks = megatron_step.build_model_chunks(self.model_provider, wrap_ddp=False)
        self.offloader = Offloader(self.chunks)

    @classmethod
    def base_of(cls, settings: ActorSettings, adapted_chunks: list, layout: ParallelLayout) -> "ReferenceWorker":
        """The reference as the base model of a LoRA actor's `adapted_chunks`: no weights of its own."""
        reference = cls(settings, None, layout)
        reference.chunks = adapted_chunks
        return reference

    def load_weights(self, path: str) -> None:
        megatron_step.load_weights(self.chunks, path)

    def offload(self, parts: Sequence[str] = ("params",)) -> None:
        """Weights to host memory between uses, so the reference costs no GPU memory while idle."""
        self.offloader.offload(parts)

    def onload(self) -> None:
        self.offloader.onload()

    def compute_log_prob(self, batch: RolloutBatch):
        """log p(response token) [B, R] under this model, zero outside response_mask."""
        with adapters_disabled(self.chunks):
            log_probs = compute_log_prob(self.chunks, self.settings, batch, with_entropy=False)[0]
        raise_if_not_finite_tokens({f"{self.label}/log_prob": log_probs}, batch.response_mask)
        return log_probs
