"""What a trainer rank is built from: the settings of its Megatron roles, its model and its rollout engine, made by the
driver from the job spec (driver.role_settings). A rank reads these, never the spec."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from rlmegatron.models.lora import LoRASettings
from rlmegatron.models.source import ModelSource
from rlmegatron.rank.roles import ActorSettings, CriticSettings
from rlmegatron.rank.roles.reward_model import RewardModelSettings
from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.runtime import ParallelLayout


@dataclass(frozen=True)
class RoleSettings:
    """One Megatron role of a trainer rank."""

    layout: ParallelLayout
    config_options: dict[str, Any]
    """TransformerConfig fields beyond the layout: activation recompute and `megatron.extra`."""
    worker: Union[ActorSettings, CriticSettings, RewardModelSettings]
    """Its worker's batching, loss and optimizer; the actor's and reference's vocab_size is the model's."""
    offload: tuple[str, ...]
    """The parts kept in host memory between the phases that use them."""


@dataclass(frozen=True)
class TrainerRankSettings:
    """Everything a trainer rank (rank.PolicyRank) is built from."""

    seed: int
    model: ModelSource
    roles: dict[str, RoleSettings]
    """The roles this run has, the actor first; the reference when a KL term needs it, the critic when enabled, the
    reward model (`reward`) when `reward.model.path` names one, the teacher when algorithm.distill asks for one."""
    critic_init_from: str
    """`actor`, or the directory of an HF reward/value model."""
    lora: Optional[LoRASettings]
    """The actor's adapters (`actor.lora`); with them the reference is the actor with its adapters off."""
    reward_model_path: Optional[str]
    """The HF reward model the `reward` role loads."""
    init_dir: str
    """Where the actor's initial weights pass to the roles that start from them (a distributed checkpoint)."""
    colocated: bool
    """The engines live in the trainer ranks; otherwise on their own pool."""
    rollout: RolloutSettings
    teacher_path: Optional[str] = None
    """On-policy distillation's teacher checkpoint (HF, or `rlm convert hf-to-mcore`'s) the `teacher` role loads."""
    freeze_vision: bool = True
    """A vision-language model's image encoder keeps its weights (`actor.vision.freeze`)."""
