"""Actor, reference and critic workers on Megatron-Core: plain classes, one per rank, usable without Ray."""
from rlmegatron.workers.actor import ActorSettings, ActorWorker, OptimizerSettings
from rlmegatron.workers.batch import RolloutBatch
from rlmegatron.workers.engine import ModelProvider, gpt_model_provider

__all__ = ["ActorSettings", "ActorWorker", "ModelProvider", "OptimizerSettings", "RolloutBatch", "gpt_model_provider"]
