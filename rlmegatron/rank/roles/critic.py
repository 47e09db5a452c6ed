"""The critic worker: a GPTModel with a scalar value head, values on response tokens, the clipped value-loss update."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmegatron.algorithms import clipped_value_loss
from rlmegatron.models.convert import HFCheckpoint, load_hf_weights
from rlmegatron.models.weight_map import Source, WeightMap
from rlmegatron.rank.roles import megatron_step
from rlmegatron.rank.roles.batch import MicroBatch, RolloutBatch
from rlmegatron.rank.roles.training import TrainingSettings, TrainingWorker, raise_if_not_finite_tokens

VALUE_HEAD_SEED = 0


@dataclass(frozen=True)
class CriticSettings(TrainingSettings):
    """verl's critic fields, same meanings."""

    cliprange_value: float = 0.5


class ValueHead(torch.nn.Linear):
    """hidden -> 1 in place of GPTModel's output layer, replicated on every TP rank (one output cannot be split).

    Its signature and return value are ColumnParallelLinear's, so GPTModel calls it unchanged.
    """

    def __init__(self, config):
        super().__init__(config.hidden_size, 1, bias=True, dtype=config.params_dtype)
        # Seeded independently of the rank so every TP (and DP) replica starts identical.
        generator = torch.Generator().manual_seed(VALUE_HEAD_SEED)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * config.init_method_std)
            self.bias.zero_()
        self.sequence_parallel = config.sequence_parallel
        for param in self.parameters():
            # finalize_model_grads all-reduces grads of sequence-parallel params over TP.
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        values = super().forward(hidden_states).float()
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def value_model_provider(provider: megatron_step.ModelProvider) -> megatron_step.ModelProvider:
    """`provider`'s GPTModel (built untied) with the last stage's output layer replaced by a ValueHead."""

    def provide(pre_process: bool, post_process: bool, vp_stage):
        model = provider(pre_process, post_process, vp_stage)
        if model.share_embeddings_and_output_weights:
            raise ValueError("a critic needs an untied output layer: build its provider with tie_embeddings=False")
        if post_process:
            model.output_layer = ValueHead(model.config)
        return model

    return provide


class CriticWorker(TrainingWorker):
    """One rank of the critic: every rank of the group gets the same RolloutBatch and returns the same result."""

    metric_prefix = "critic"

    def __init__(self, settings: CriticSettings, model_provider: megatron_step.ModelProvider, layout):
        super().__init__(settings, value_model_provider(model_provider), layout)

    def load_reward_model(self, path: str, facts) -> None:
        """Initialise from an HF reward/value model (`*ForSequenceClassification` or `*ForTokenClassification`
        with one label, same architecture as the policy): its trunk, and its `score` head as the value head.
        A head without bias leaves the value head's bias at 0."""
        load_score_model(self.chunks, path, facts, "critic.init_from")
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def load_actor_weights(self, path: str) -> None:
        """Initialise from a policy checkpoint: every weight but the output layer (the value head keeps its init)."""
        self.load_weights(path, skip_prefixes=("output_layer.",))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(prefix before each response token) [B, R], zero outside response_mask."""

        def per_token(micro_batch, output):
            values = response_values(micro_batch, output)
            return (values * micro_batch.response_fields.response_mask.to(values.device),)

        values = megatron_step.run_forward_only(self.chunks, batch, self._micro_batches(batch), per_token, outputs=1)[0]
        raise_if_not_finite_tokens({"critic/values": values}, batch.response_mask)
        return values

    def update(self, batch: RolloutBatch, progress=None) -> dict[str, float]:
        """Clipped value loss against `batch.returns`, with `batch.values` as the rollout-time values."""
        if batch.values is None or batch.returns is None:
            raise ValueError("critic update needs values and returns")
        return self._run_mini_batches(batch, self._loss_func_factory, summed=("critic/vf_loss",), progress=progress)

    def _loss_func_factory(self, mini_batch: RolloutBatch, scale: int):
        aggregation = self._aggregation(mini_batch)

        def loss_func_for(micro_batch: MicroBatch, output: torch.Tensor):
            fields = micro_batch.response_fields
            device = output.device
            vf_loss, metrics = clipped_value_loss(
                response_values(micro_batch, output),
                fields.returns.to(device),
                fields.values.to(device),
                fields.response_mask.to(device),
                self.settings.cliprange_value,
                aggregation,
            )
            reported = {"critic/vf_loss": vf_loss.detach().clone(), "critic/vf_clipfrac": metrics["vf_clipfrac"]}
            return vf_loss * scale, reported

        return loss_func_for


def load_score_model(chunks: list, path: str, facts, field: str) -> None:
    """`chunks` (a value-head model) from an HF model with one label: its trunk, and its `score` head as the value
    head; a head without bias leaves the value head's bias at 0. `field` names the spec field in errors."""
    checkpoint = HFCheckpoint(path)
    try:
        head = tuple(key for key in ("score.weight", "score.bias") if key in checkpoint.key_files)
        if "score.weight" not in head or checkpoint.shape(Source("score.weight"))[0] != 1:
            raise ValueError(f"{field}={path}: not a reward/value model with one label "
                             "(expected a score.weight of shape [1, hidden_size])")
        weight_map = WeightMap(facts, value_head=head)
        load_hf_weights([megatron_step.unwrap(chunk) for chunk in chunks], weight_map, checkpoint,
                        keep_initialised=("output_layer.bias",))
    finally:
        checkpoint.close()


def response_values(micro_batch: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    # The value at input position p belongs to the next token, as the log-prob there does.
    return micro_batch.to_response_grid(output[..., 0])
