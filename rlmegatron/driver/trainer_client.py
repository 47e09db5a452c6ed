"""The trainer ranks as the driver calls them: one typed method per PolicyRank method the driver uses."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from rlmegatron.rank.policy_rank import PolicyRank
from rlmegatron.rank.weight_push import SyncReport
from rlmegatron.rollout.sglang.servers import ServerDevices
from rlmegatron.transport.worker_group import WorkerGroup
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult
from rlmegatron.tracking.progress import Progress
from rlmegatron.rank.roles import RolloutBatch


class TrainerClient:
    """Each method runs the PolicyRank method of the same name on every rank, as Ray actors or in this process: the
    ranks run collectives together. Every rank returns the same result (the workers gather over data parallelism)
    and rank 0's is returned, except for `generate`, whose ranks serve their own shares."""

    def __init__(self, group: WorkerGroup[PolicyRank]) -> None:
        self.group = group
        self.owner = threading.RLock()
        """Held by the thread that uses the ranks: the fit loop's, or, for a weight push to an engine that
        restarted, the thread that makes rollouts ahead of it (driver.rollout_buffer.Ahead)."""

    @property
    def world_size(self) -> int:
        return len(self.group)

    # --- rollout, in the colocated engines ---

    def engine_ranks(self) -> list[int]:
        """The ranks that lead a colocated engine, in engine order."""
        return [rank for rank, serves in enumerate(self.group.call_all(PolicyRank.serves_rollout)) if serves]

    def generate(self, shares: dict[int, list[GenerationRequest]],
                 progress: Progress = None) -> dict[int, Optional[list[GenerationResult]]]:
        """Rank -> its engine's samples for its share (None: the engine restarted and needs the weights first)."""
        per_rank = {rank: (shares[rank], progress) if rank in shares else ([],) for rank in range(self.world_size)}
        replies = self.group.call_each(PolicyRank.generate, per_rank)
        return {rank: replies[rank] for rank in shares}

    def release_rollout_memory(self) -> None:
        self.group.call_all(PolicyRank.release_rollout_memory)

    # --- the step's phases ---

    def score_sequences(self, sequences: list[list[int]]) -> list[float]:
        return self.group.call_all(PolicyRank.score_sequences, sequences)[0].tolist()

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call_all(PolicyRank.compute_values, batch)[0]

    def compute_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call_all(PolicyRank.compute_log_prob, batch)[0]

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call_all(PolicyRank.compute_ref_log_prob, batch)[0]

    def compute_teacher_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call_all(PolicyRank.compute_teacher_log_prob, batch)[0]

    def update_critic(self, batch: RolloutBatch, progress: Progress = None) -> dict[str, float]:
        return self.group.call_all(PolicyRank.update_critic, batch, progress)[0]

    def update_actor(self, batch: RolloutBatch, progress: Progress = None) -> dict[str, float]:
        return self.group.call_all(PolicyRank.update_actor, batch, progress)[0]

    # --- weights to the engines ---

    def connect_engines(self, endpoints: list[tuple[int, str, ServerDevices]]) -> None:
        """Disaggregated: each (engine, url, its TP ranks' devices) server joins a weight-update group with its sending
        trainer rank (rank.weight_push.assign_senders)."""
        self.group.call_all(PolicyRank.connect_engines, endpoints)

    def disconnect_engines(self, engines: list[int]) -> None:
        self.group.call_all(PolicyRank.disconnect_engines, engines)

    def relaunch_engines(self, engines: list[int]) -> None:
        self.group.call_all(PolicyRank.relaunch_engines, engines)

    def sync_weights(self, version: str, engines: Optional[list[int]] = None, fresh: bool = False) -> SyncReport:
        """Rank 0's report: the disaggregated servers that went down during the push (every sender's, gathered on
        every rank: `WeightPush._push`), and the bytes it carried (colocated: to rank 0's engine)."""
        return self.group.call_all(PolicyRank.sync_weights, version, engines, fresh)[0]

    def save_checkpoint(self, path: str) -> None:
        self.group.call_all(PolicyRank.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.group.call_all(PolicyRank.load_checkpoint, path)

    def export_hf(self, path: str) -> Optional[str]:
        return self.group.call_all(PolicyRank.export_hf, path)[0]

    def shutdown(self) -> None:
        self.group.shutdown()
