"""The Megatron roles a trainer rank runs (actor, reference, critic, reward model) and what they share: the Megatron
step, the batch, offload and vocab-parallel log-probs. Plain classes, usable without Ray."""
from rlmegatron.rank.roles.actor import ActorSettings, ActorWorker
from rlmegatron.rank.roles.batch import RolloutBatch
from rlmegatron.rank.roles.critic import CriticSettings, CriticWorker
from rlmegatron.rank.roles.megatron_step import ModelProvider, gpt_model_provider
from rlmegatron.rank.roles.reference import ReferenceWorker
from rlmegatron.rank.roles.training import OptimizerSettings

__all__ = [
    "ActorSettings",
    "ActorWorker",
    "CriticSettings",
    "CriticWorker",
    "ModelProvider",
    "OptimizerSettings",
    "ReferenceWorker",
    "RolloutBatch",
    "gpt_model_provider",
]
