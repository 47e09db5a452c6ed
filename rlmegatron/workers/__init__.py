"""Actor, reference and critic workers on Megatron-Core: plain classes, one per rank, usable without Ray."""
from rlmegatron.workers.actor import ActorSettings, ActorWorker
from rlmegatron.workers.batch import RolloutBatch
from rlmegatron.workers.critic import CriticSettings, CriticWorker
from rlmegatron.workers.megatron_step import ModelProvider, gpt_model_provider
from rlmegatron.workers.reference import ReferenceWorker
from rlmegatron.workers.training import OptimizerSettings

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
