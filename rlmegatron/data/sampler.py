"""Seeded, epoch-aware, resumable batching of prompt indices, and the dataloader built on it."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from rlmegatron.data.dataset import DatasetError, PromptDataset
from rlmegatron.data.records import Sample


@dataclass
class SamplerState:
    """Where the sampler stands: the next batch is batch `position` of epoch `epoch`."""

    epoch: int = 0
    position: int = 0


class ResumableBatchSampler:
    """Batches of dataset indices; each epoch's order depends only on (seed, epoch), so a saved
    (epoch, position) replays exactly the batches an uninterrupted run would have produced."""

    def __init__(self, dataset_size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        if dataset_size < batch_size and drop_last:
            raise DatasetError(
                f"the dataset has {dataset_size} prompts, fewer than one batch of {batch_size}; "
                "lower data.train_batch_size or add data"
            )
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.state = SamplerState()

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_size, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.dataset_size)
        # Seeded by (seed, epoch) rather than a running generator, so no RNG state needs saving.
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def next_batch(self) -> list[int]:
        """The next batch's indices, moving on to a fresh epoch when this one is used up."""
        if self.state.position >= self.batches_per_epoch:
            self.state = SamplerState(epoch=self.state.epoch + 1, position=0)
        start = self.state.position * self.batch_size
        batch = self.epoch_order(self.state.epoch)[start : start + self.batch_size]
        self.state.position += 1
        return [int(i) for i in batch]

    def epoch_finished(self) -> bool:
        return self.state.position >= self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        # The shape is saved too, so a resume against a changed dataset or batch size fails loudly.
        return {**asdict(self.state), "seed": self.seed, "dataset_size": self.dataset_size,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "dataset_size", "batch_size", "shuffle"):
            if state[key] != getattr(self, key):
                raise DatasetError(
                    f"cannot resume the dataloader: checkpoint has {key}={state[key]}, "
                    f"this run has {getattr(self, key)}"
                )
        self.state = SamplerState(epoch=int(state["epoch"]), position=int(state["position"]))


class PromptDataLoader:
    """Batches of Samples from a dataset, resumable through state_dict()/load_state_dict()."""

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        self.dataset = dataset
        self.sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed,
                                             drop_last=drop_last)

    @property
    def epoch(self) -> int:
        return self.sampler.state.epoch

    def next_batch(self) -> list[Sample]:
        return [self.dataset[i] for i in self.sampler.next_batch()]

    def iter_epoch(self) -> Iterator[list[Sample]]:
        """The rest of the current epoch's batches (all of them for a fresh epoch)."""
        if self.sampler.epoch_finished():
            self.sampler.state = SamplerState(epoch=self.sampler.state.epoch + 1)
        while not self.sampler.epoch_finished():
            yield self.next_batch()

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
