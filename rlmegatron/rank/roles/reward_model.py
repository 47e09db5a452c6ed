"""The reward-model worker: an HF `*ForSequenceClassification` with one label, as a Megatron GPTModel with a value
head at its own layout, scoring whole sequences (prompt + response) by the head's output at their last token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rlmegatron.runtime import ParallelLayout
from rlmegatron.rank.roles import megatron_step
from rlmegatron.rank.roles.batch import RolloutBatch
from rlmegatron.rank.roles.critic import load_score_model, response_values, value_model_provider
from rlmegatron.rank.roles.offload import Offloader
from rlmegatron.rank.roles.training import micro_batches


@dataclass(frozen=True)
class RewardModelSettings:
    """How the reward model batches its forward passes (the batching fields micro_batches reads)."""

    micro_batch_size: int = 4
    max_token_len: int | None = None
    use_packing: bool = True
    share_prompts: bool | None = None  # the same sequence in several rows laid out once, when that pays


def sequence_batch(sequences: Sequence[Sequence[int]]) -> RolloutBatch:
    """The sequences left-padded, each followed by one placeholder "response" token: the value the model gives
    that token's position is the head's output at the sequence's last token (causal attention: the placeholder
    changes nothing before it)."""
    length = max(len(tokens) for tokens in sequences) + 1
    input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(sequences):
        input_ids[row, length - 1 - len(tokens): length - 1] = torch.as_tensor(list(tokens), dtype=torch.long)
        attention_mask[row, length - 1 - len(tokens):] = 1
    return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask,
                        response_mask=torch.ones(len(sequences), 1))


class RewardModelWorker:
    """One rank of the reward model: forward only, no optimizer; every rank returns the same scores."""

    def __init__(self, settings: RewardModelSettings, model_provider: megatron_step.ModelProvider,
                 layout: ParallelLayout):
        self.settings = settings
        self.model_provider = value_model_provider(model_provider)
        self.layout = layout
        self.chunks: list = []
        self.offloader: Offloader | None = None

    def init(self, parallel_state_ready: bool = True) -> None:
        self.chunks = megatron_step.build_model_chunks(self.model_provider, wrap_ddp=False)
        self.offloader = Offloader(self.chunks)

    def load(self, path: str, facts) -> None:
        load_score_model(self.chunks, path, facts, "reward.model.path")

    def offload(self, parts: Sequence[str] = ("params",)) -> None:
        self.offloader.offload(parts)

    def onload(self) -> None:
        self.offloader.onload()

    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The model's score [B] of each token sequence."""
        batch = sequence_batch(sequences)

        def per_token(micro_batch, output):
            return (response_values(micro_batch, output),)

        scores = megatron_step.run_forward_only(self.chunks, batch, micro_batches(self.settings, batch, self.chunks),
                                                per_token, outputs=1)[0]
        return scores[:, 0]
