"""The actor worker: log-probs/entropy of responses and the PPO update of a Megatron GPTModel, Ray-free."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from rlmegatron.algorithms import (
    POLICY_LOSSES,
    LossAggregation,
    PolicyLossConfig,
    entropy_bonus,
    kl_loss,
    local_denominator,
)
from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.workers import engine
from rlmegatron.workers.batch import MicroBatch, RolloutBatch
from rlmegatron.workers.offload import Offloader
from rlmegatron.workers.vocab_parallel import vocab_parallel_log_probs_and_entropy


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class ActorSettings:
    """How the actor batches and what its loss is (verl's actor fields, same meanings)."""

    ppo_mini_batch_size: int = 8  # sequences per optimizer step
    ppo_epochs: int = 1
    micro_batch_size: int = 2  # sequences per micro-batch when max_token_len is None
    max_token_len: Optional[int] = None  # dynamic batch size: tokens per micro-batch
    use_packing: bool = True  # THD packing: padding costs no compute
    temperature: float = 1.0  # the rollout temperature; logits are divided by it
    policy_loss: str = "vanilla"
    policy_loss_config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)


class ActorWorker:
    """One rank of the actor: every rank of the group gets the same RolloutBatch and returns the same result."""

    def __init__(self, settings: ActorSettings, model_provider: engine.ModelProvider, layout: ParallelLayout):
        self.settings = settings
        self.model_provider = model_provider
        self.layout = layout
        self.chunks: list = []
        self.optimizer = None
        self.offloader: Optional[Offloader] = None

    def init(self, parallel_state_ready: bool = False) -> None:
        """Build the parallel groups (unless a colocated worker did), the model chunks and the optimizer."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if not parallel_state_ready:
            init_model_parallel(self.layout)
        # Adam state is sharded over DP (Megatron's DistributedOptimizer), on CPU too via the CPU layer.
        self.chunks = engine.build_model_chunks(self.model_provider, wrap_ddp=True, use_distributed_optimizer=True)
        opt = self.settings.optimizer
        config = engine.unwrap(self.chunks[0]).config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                use_distributed_optimizer=True,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
            ),
            self.chunks,
        )
        self.offloader = Offloader(self.chunks, self.optimizer)

    def save_weights(self, path: str) -> None:
        engine.save_weights(self.chunks, path)

    def load_weights(self, path: str) -> None:
        engine.load_weights(self.chunks, path)
        # The distributed optimizer keeps its own fp32 copy of bf16/fp16 weights.
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def offload(self) -> None:
        self.offloader.offload()

    def onload(self) -> None:
        self.offloader.onload()

    def _micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        s = self.settings
        return engine.shard_micro_batches(batch, s.use_packing, s.micro_batch_size, s.max_token_len)

    def _log_probs_and_entropy(self, micro_batch: MicroBatch, logits: torch.Tensor, with_entropy: bool):
        labels = micro_batch.labels.to(logits.device)
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, labels, self.settings.temperature, with_entropy
        )
        grid_log_probs = micro_batch.to_response_grid(log_probs)
        return grid_log_probs, (micro_batch.to_response_grid(entropy) if with_entropy else None)

    def compute_log_prob(self, batch: RolloutBatch, with_entropy: bool = True):
        """log p(response token) [B, R] (and entropy [B, R]) under the current weights, zero outside response_mask."""

        def per_token(micro_batch, logits):
            log_probs, entropy = self._log_probs_and_entropy(micro_batch, logits, with_entropy)
            mask = micro_batch.response_fields.response_mask.to(log_probs.device)
            return (log_probs * mask,) + ((entropy * mask,) if with_entropy else ())

        results = engine.run_forward_only(
            self.chunks, batch, self._micro_batches(batch), per_token, outputs=2 if with_entropy else 1
        )
        return (results[0], results[1]) if with_entropy else (results[0], None)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO: for each epoch and mini-batch, accumulate gradients over micro-batches, then one optimizer step."""
        from megatron.core import parallel_state as ps

        s = self.settings
        if batch.old_log_probs is None or batch.advantages is None:
            raise ValueError("update needs old_log_probs and advantages")
        if s.use_kl_loss and batch.ref_log_probs is None:
            raise ValueError("use_kl_loss needs ref_log_probs")
        for chunk in self.chunks:
            chunk.train()
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(s.ppo_epochs):
            for start in range(0, len(batch), s.ppo_mini_batch_size):
                mini_batch = batch.select(list(range(start, min(start + s.ppo_mini_batch_size, len(batch)))))
                for name, value in self._train_mini_batch(mini_batch).items():
                    history[name].append(value)
        metrics = {name: sum(values) / len(values) for name, values in history.items()}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _train_mini_batch(self, mini_batch: RolloutBatch) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        s = self.settings
        micro_batches = self._micro_batches(mini_batch)
        # Megatron divides each micro-batch loss by their count and DDP averages over DP; the
        # global denominator already makes the sum over both exact, so undo those two factors.
        megatron_scale = len(micro_batches) * engine.dp_size()
        aggregation = LossAggregation(
            mode=s.loss_agg_mode,
            global_denominator=local_denominator(mini_batch.response_mask, s.loss_agg_mode),
            max_response_length=mini_batch.response_length,
        )
        policy_loss_fn = POLICY_LOSSES.get(s.policy_loss)

        def loss_func_for(micro_batch: MicroBatch, logits: torch.Tensor):
            fields = micro_batch.response_fields
            device = logits.device
            mask = fields.response_mask.to(device)
            log_probs, entropy = self._log_probs_and_entropy(micro_batch, logits, with_entropy=True)
            pg_loss, pg_metrics = policy_loss_fn(
                fields.old_log_probs.to(device),
                log_probs,
                fields.advantages.to(device),
                mask,
                config=s.policy_loss_config,
                aggregation=aggregation,
                rollout_log_prob=None if fields.rollout_log_probs is None else fields.rollout_log_probs.to(device),
            )
            loss = pg_loss
            entropy_term, entropy_metrics = entropy_bonus(entropy, mask, s.entropy_coeff, aggregation)
            if s.entropy_coeff != 0.0:
                loss = loss + entropy_term
            reported = {
                "actor/pg_loss": pg_loss.detach(),
                "actor/pg_clipfrac": pg_metrics["pg_clipfrac"],
                "actor/pg_clipfrac_lower": pg_metrics["pg_clipfrac_lower"],
                "actor/ppo_kl": pg_metrics["ppo_kl"],
                "actor/entropy": entropy_metrics["entropy"],
            }
            if s.use_kl_loss:
                kl_term, kl_metrics = kl_loss(
                    log_probs, fields.ref_log_probs.to(device), mask, s.kl_loss_coef, s.kl_loss_type, aggregation
                )
                loss = loss + kl_term
                reported["actor/kl_loss"] = kl_metrics["kl_loss"]
            return loss * megatron_scale, {k: v.detach().clone() for k, v in reported.items()}

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        collected = engine.forward_backward(self.chunks, micro_batches, loss_func_for, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()

        names = sorted(collected[0]) if collected else []
        # Every rank needs the same names; the last stage's list decides, so agree on it first.
        names = _names_from_last_stage(names)
        sums = torch.zeros(len(names) + 1)
        if engine.is_last_stage():
            for item in collected:
                for k, name in enumerate(names):
                    # pg_loss carries the global denominator: its micro-batch sum is the mini-batch loss.
                    sums[k] += item[name].float().cpu() if name == "actor/pg_loss" else item[name].float().cpu() / len(collected)
            sums[-1] = 1.0
        share_device = "cuda" if torch.cuda.is_available() else "cpu"
        sums = engine.share_from_last_stage(sums.to(share_device)).cpu()
        dp_ranks = sums[-1]
        metrics = {}
        for k, name in enumerate(names):
            # pg_loss sums over DP ranks (each holds a share); the means average over them.
            metrics[name] = float(sums[k]) if name == "actor/pg_loss" else float(sums[k] / dp_ranks)
        metrics["actor/grad_norm"] = float(grad_norm)
        metrics.update(_moe_aux_losses(engine.unwrap(self.chunks[0]).config))
        return metrics


def _names_from_last_stage(names: list[str]) -> list[str]:
    from megatron.core import parallel_state as ps

    holder = [names]
    group = ps.get_pipeline_model_parallel_group()
    torch.distributed.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return holder[0]


def _moe_aux_losses(config) -> dict[str, float]:
    """Router auxiliary losses Megatron tracked during this step, averaged over MoE layers, then cleared."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    metrics = {}
    for name, entry in tracker.items():
        values = entry["values"]
        metrics[f"actor/moe_{name}"] = float(values.sum() / max(1, int((values != 0).sum())))
    moe_utils.clear_aux_losses_tracker()
    return metrics
