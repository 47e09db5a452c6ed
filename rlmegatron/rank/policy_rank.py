"""One trainer rank of the policy: the methods the driver calls on every trainer rank, one per phase of a step, over
the rank's parts: its Megatron roles (role_models), its share of a colocated rollout engine (colocated_engine), the
weight push to the engines (weight_push), and checkpoints and export (checkpoints)."""
from __future__ import annotations

from typing import Optional

import torch

from rlmegatron.rank import checkpoints
from rlmegatron.rank.colocated_engine import ColocatedEngine
from rlmegatron.rank.role_models import RoleModels
from rlmegatron.rank.weight_push import SyncReport, WeightPush
from rlmegatron.rank.settings import TrainerRankSettings
from rlmegatron.rollout.sglang.servers import ServerDevices
from rlmegatron.rollout.engine import INITIAL_VERSION, GenerationRequest, GenerationResult
from rlmegatron.tracking.progress import Progress
from rlmegatron.rank.roles import RolloutBatch


class PolicyRank:
    """Everything one trainer rank holds: a plain class; the process group must already be up.

    Every rank receives the same full batch and returns the same full result (the workers
    gather over data parallelism), except `generate`, which serves only the requests it is given.
    """

    def __init__(self, settings: TrainerRankSettings) -> None:
        """`settings`: made by the driver from the job spec (driver.role_settings.trainer_rank_settings)."""
        self.rank = torch.distributed.get_rank()
        self.models = RoleModels(settings)
        # Colocated: this rank's part of an engine (the hybrid engine); disaggregated: the engines are elsewhere.
        self.engine = ColocatedEngine(settings.rollout, settings.model.hf_config()) if settings.colocated else None
        self.weights = WeightPush(settings.rollout, self.models, self.engine)
        if self.engine is not None:
            self.sync_weights(INITIAL_VERSION, fresh=True)

    # --- the step's phases, in the order the trainer calls them ---

    def serves_rollout(self) -> bool:
        return self.engine is not None and self.engine.leader is not None

    def generate(self, requests: list[GenerationRequest],
                 progress: Progress = None) -> Optional[list[GenerationResult]]:
        """This rank's engine's samples for `requests`; None: it restarted and needs the weights first."""
        return self.engine.generate(requests, progress)

    def release_rollout_memory(self) -> None:
        """Colocated: the engine gives its memory back while the trainer runs; `sync_weights` wakes it."""
        if self.engine is not None:
            self.engine.release_memory()

    def compute_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        """The old log-probs: the actor's before its update (the entropy would cost a pass over the vocabulary that
        nothing reads; the update reports the entropy it trains on)."""
        with self.models.phase("actor"):
            return self.models.actor.compute_log_prob(batch, with_entropy=False)[0].cpu()

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        with self.models.phase("reference"):
            return self.models.reference.compute_log_prob(batch).cpu()

    def compute_teacher_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        """On-policy distillation's teacher: log p_teacher of each sampled token [B, R]."""
        with self.models.phase("teacher"):
            return self.models.teacher.compute_log_prob(batch).cpu()

    def score_sequences(self, sequences: list[list[int]]) -> torch.Tensor:
        """The reward model's score [B] of each token sequence (prompt + response in its own tokenizer)."""
        with self.models.phase("reward"):
            return self.models.reward.score(sequences).cpu()

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        with self.models.phase("critic"):
            return self.models.critic.compute_values(batch).cpu()

    def update_critic(self, batch: RolloutBatch, progress: Progress = None) -> dict[str, float]:
        with self.models.phase("critic"):
            return self.models.critic.update(batch, progress if self.rank == 0 else None)

    def update_actor(self, batch: RolloutBatch, progress: Progress = None) -> dict[str, float]:
        with self.models.phase("actor"):
            return self.models.actor.update(batch, progress if self.rank == 0 else None)

    def connect_engines(self, endpoints: list[tuple[int, str, ServerDevices]]) -> None:
        """Disaggregated: each (engine, url, its TP ranks' devices) server joins a weight-update group with its sending
        rank (weight_push.sending_ranks)."""
        self.weights.connect(endpoints)

    def disconnect_engines(self, engines: list[int]) -> None:
        """Disaggregated: `engines` left the pool; their sending ranks leave their weight-update groups."""
        self.weights.disconnect(engines)

    def relaunch_engines(self, engines: list[int]) -> None:
        """Colocated: the `engines` restarted; this rank's part of one of them starts again."""
        if self.engine is not None:
            self.engine.relaunch(engines)

    def sync_weights(self, version: str, engines: Optional[list[int]] = None, fresh: bool = False) -> SyncReport:
        """Trained weights -> `engines` (None: every engine), as HF-named full tensors, whole when they are `fresh`
        (they hold none) or only what changed (delta sync); reports the disaggregated servers that went down during
        the push and the bytes it carried."""
        return self.weights.sync(version, engines, fresh)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    # --- checkpoints and export ---

    def save_checkpoint(self, path: str) -> None:
        checkpoints.save(self.models, path)

    def load_checkpoint(self, path: str) -> None:
        checkpoints.load(self.models, path)

    def export_hf(self, path: str) -> Optional[str]:
        """The policy as an HF checkpoint, written by rank 0; returns the path there (None on the other ranks)."""
        return checkpoints.export_policy(self.models, path)
