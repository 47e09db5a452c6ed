"""What the actor and critic share: settings, optimizer, weights I/O, offload, and the PPO mini-batch loop."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rlmegatron.algorithms import LossAggregation, local_denominator
from rlmegatron.errors import Divergence
from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.runtime.cpu_compat import plain_torch
from rlmegatron.runtime.distributed import all_reduce_shared
from rlmegatron.tracking.progress import Progress, report
from rlmegatron.rank.roles import megatron_step
from rlmegatron.rank.roles.batch import MicroBatch, RolloutBatch
from rlmegatron.rank.roles.offload import PARTS, Offloader


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam and its learning-rate schedule. The schedule advances once per trainer step (each PPO update, all
    its mini-batches and epochs), as verl's does, and trainer step t (from 1) trains at Megatron's
    OptimizerParamScheduler value at t: lr * t / lr_warmup_steps while t <= lr_warmup_steps, then `lr`
    (constant) or a linear / cosine decay that reaches `min_lr` at t = lr_decay_steps, the run's last step."""

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int = 1
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class TrainingSettings:
    """Batching and optimizer fields of a trained worker (verl's names and meanings)."""

    ppo_mini_batch_size: int = 8  # sequences per optimizer step
    ppo_epochs: int = 1
    micro_batch_size: int = 2  # sequences per micro-batch when max_token_len is None
    max_token_len: Optional[int] = None  # dynamic batch size: tokens per micro-batch
    use_packing: Optional[bool] = None  # THD packing (True), right padding (False); None: megatron_step.packing_pays
    # Shared-prompt micro-batches where the model supports them: None when they pay (megatron_step.prompt_units),
    # True whenever they can, False never (tests compare the layouts).
    share_prompts: Optional[bool] = None
    loss_agg_mode: str = "token-mean"
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    use_distributed_optimizer: bool = True  # Adam state sharded over DP; else every rank keeps all of it


def micro_batches(settings, batch: RolloutBatch, chunks: list) -> list[MicroBatch]:
    """This rank's micro-batches of `batch` under `settings`' batching fields, for the model `chunks`."""
    from rlmegatron.models.shared_prompts import shared_prompts_supported  # lazy: megatron stays out of this module

    share = settings.share_prompts if shared_prompts_supported(chunks) else False
    with plain_torch():  # index arithmetic naming no device (benchmarks/RESULTS.md on the CPU layer's rewrite)
        return megatron_step.shard_micro_batches(batch, settings.use_packing, settings.micro_batch_size,
                                                 settings.max_token_len, share)


class TrainingWorker:
    """One rank of a DDP-wrapped model with Megatron's (distributed) optimizer; subclasses define the loss."""

    metric_prefix: str  # "actor" or "critic"

    def __init__(self, settings: TrainingSettings, model_provider: megatron_step.ModelProvider, layout: ParallelLayout):
        self.settings = settings
        self.model_provider = model_provider
        self.layout = layout
        self.chunks: list = []
        self.optimizer = None
        self.scheduler = None
        self.offloader: Optional[Offloader] = None

    def init(self, parallel_state_ready: bool = False) -> None:
        """Build the parallel groups (unless a colocated worker did), the model chunks, the optimizer and its
        learning-rate schedule."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if not parallel_state_ready:
            init_model_parallel(self.layout)
        # The distributed optimizer shards Adam state over DP, on CPU too via the CPU layer.
        distributed = self.settings.use_distributed_optimizer
        self.chunks = megatron_step.build_model_chunks(self.model_provider, wrap_ddp=True,
                                                use_distributed_optimizer=distributed)
        opt = self.settings.optimizer
        config = megatron_step.unwrap(self.chunks[0]).config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.min_lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                use_distributed_optimizer=distributed,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
            ),
            self.chunks,
        )
        # Adam's update is torch's own code, which names no device: on CPU it runs without the CPU layer's rewrite of
        # every call (Megatron's step around it names CUDA and keeps it).
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if part.optimizer is not None:  # None: a rank whose parameters here are all frozen (Megatron's stub)
                part.optimizer.step = plain_torch()(part.optimizer.step)
        # The spec, not a checkpoint, says what the schedule is (override): a resume restores only its position.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=opt.lr_warmup_steps,
            lr_decay_steps=opt.lr_decay_steps, lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay,
            end_wd=opt.weight_decay, wd_incr_steps=opt.lr_decay_steps, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
        )
        self.offloader = Offloader(self.chunks, self.optimizer)

    def save_weights(self, path: str) -> None:
        megatron_step.save_weights(self.chunks, path)

    def load_weights(self, path: str, skip_prefixes: tuple[str, ...] = ()) -> None:
        megatron_step.load_weights(self.chunks, path, skip_prefixes)
        # The distributed optimizer keeps its own fp32 copy of bf16/fp16 weights.
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def offload(self, parts: Sequence[str] = PARTS) -> None:
        """Weights, grads and/or optimizer state to host memory (frees the GPU for rollout)."""
        self.offloader.offload(parts)

    def onload(self) -> None:
        self.offloader.onload()

    def _micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        return micro_batches(self.settings, batch, self.chunks)

    def _aggregation(self, mini_batch: RolloutBatch) -> LossAggregation:
        # Every rank holds the whole mini-batch, so its mask gives the global denominator directly.
        mode = self.settings.loss_agg_mode
        return LossAggregation(
            mode=mode,
            global_denominator=local_denominator(mini_batch.response_mask, mode),
            max_response_length=mini_batch.response_length,
        )

    def _run_mini_batches(self, batch: RolloutBatch, loss_func_factory: Callable, summed: tuple[str, ...],
                          progress: Progress = None, routing=None, mtp: bool = False) -> dict[str, float]:
        """For each epoch and mini-batch: accumulate gradients over micro-batches, then one optimizer step.

        `loss_func_factory(mini_batch, scale)` returns a Megatron loss function whose loss is
        multiplied by `scale`; `summed` names the reported metrics that add up over micro-batches;
        `progress` hears of each finished optimizer step; `routing`: the model's router taps, and `mtp` whether the
        MTP layers run (forward_backward's).
        """
        for chunk in self.chunks:
            chunk.train()
        self.scheduler.step(1)  # this trainer step's learning rate (see OptimizerSettings)
        s = self.settings
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(s.ppo_epochs):
            for start in range(0, len(batch), s.ppo_mini_batch_size):
                mini_batch = batch.select(list(range(start, min(start + s.ppo_mini_batch_size, len(batch)))))
                for name, value in self._train_mini_batch(mini_batch, loss_func_factory, summed, routing,
                                                          mtp).items():
                    history[name].append(value)
                report(progress)
        metrics = {name: sum(values) / len(values) for name, values in history.items()}
        metrics[f"{self.metric_prefix}/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _train_mini_batch(self, mini_batch: RolloutBatch, loss_func_factory: Callable, summed: tuple[str, ...],
                          routing=None, mtp: bool = False):
        micro_batches = self._micro_batches(mini_batch)
        # Megatron divides each micro-batch loss by their count and DDP averages over DP; the
        # global denominator already makes the sum over both exact, so undo those two factors.
        # (At CP>1 each CP rank's gradient is its tokens' share of the loss: the schedule's factor CP
        # undoes DDP's average over CP.)
        loss_func_for = loss_func_factory(mini_batch, len(micro_batches) * megatron_step.dp_size())
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        collected = megatron_step.forward_backward(self.chunks, micro_batches, loss_func_for, forward_only=False,
                                                   routing=routing, mtp=mtp)
        metrics = _reduce_metrics(collected, summed)  # collective: every rank sees, and stops on, the same values
        terms = {name: value for name, value in metrics.items() if name.endswith(("_loss", "/entropy"))}
        _raise_if_not_finite(terms, "before the optimizer step; the weights are unchanged")
        _, grad_norm, _ = self.optimizer.step()
        metrics[f"{self.metric_prefix}/grad_norm"] = float(grad_norm)
        after_step = "after the optimizer step, so the weights in memory are not usable"
        _raise_if_not_finite({f"{self.metric_prefix}/grad_norm": float(grad_norm)}, after_step)
        # A finite grad norm can still move the weights past what float holds (a huge learning rate).
        if not weights_finite(self.chunks):
            raise Divergence(f"{self.metric_prefix}/weights: NaN or inf in the weights: stopped {after_step}")
        metrics.update(_moe_aux_losses(megatron_step.unwrap(self.chunks[0]).config, self.metric_prefix))
        return metrics


def _raise_if_not_finite(values: dict[str, float], when: str) -> None:
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
        found = ", ".join(f"{name}={value}" for name, value in sorted(bad.items()))
        raise Divergence(f"{found}: stopped {when}")


def weights_finite(chunks: list) -> bool:
    """Whether every rank's parameters are all finite; every rank takes the same way.

    One sum per parameter tensor: a NaN or inf anywhere makes it NaN or inf, and it reads each weight once without
    a temporary the size of the tensor (finite weights so large that their sum overflows count as diverged too).
    Collective over the ranks whose weights differ: the model-parallel group (TP x PP). Data-parallel replicas hold
    the same weights after the step (the optimizer's all-gather), so a replica's answer is its peers'; a collective
    over them was a sync point per step (benchmarks/RESULTS.md, "Measured reasons in the code"). Sharded experts differ across the data-
    parallel ranks too: with MoE every rank is asked."""
    from megatron.core import parallel_state as ps

    sums = [param.detach().sum(dtype=torch.float32) for chunk in chunks for param in chunk.parameters()]
    bad = (~torch.isfinite(torch.stack(sums))).any().to(torch.int32).reshape(1)
    moe = getattr(megatron_step.unwrap(chunks[0]).config, "num_moe_experts", None)
    all_reduce_shared(bad, None if moe else ps.get_model_parallel_group(), torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())


def raise_if_not_finite_tokens(tensors: dict[str, Optional[torch.Tensor]], response_mask: torch.Tensor) -> None:
    """Divergence naming each [B, R] tensor with a NaN or inf on a response token. Every rank holds the same full
    tensors, so every rank raises alike, without a collective."""
    tokens = response_mask.bool()
    bad = {name: int((~torch.isfinite(tensor[tokens.to(tensor.device)])).sum())
           for name, tensor in tensors.items() if tensor is not None}
    if any(bad.values()):
        raise Divergence(", ".join(f"{name}: {count} of {int(tokens.sum())} response tokens are NaN or infinite"
                                   for name, count in bad.items() if count))


@plain_torch()  # this project's torch code, naming no device
def _reduce_metrics(collected: list[dict], summed: tuple[str, ...]) -> dict[str, float]:
    """The loss functions' metric dicts (last stage only) -> one dict every rank agrees on.

    `summed`'s metrics carry the global denominator, so their sums over micro-batches and DP ranks are the
    mini-batch values; every other metric is a per-micro-batch mean, averaged (over the micro-batches with rows:
    fillers report nothing).
    """
    collected = [item for item in collected if item]
    names = _names_from_last_stage(sorted(collected[0]) if collected else [])
    sums = torch.zeros(len(names) + 1)
    if megatron_step.is_last_stage():
        for item in collected:
            for k, name in enumerate(names):
                value = item[name].float().cpu()
                sums[k] += value if name in summed else value / len(collected)
        sums[-1] = 1.0  # counts the DP ranks that contributed
    sums = megatron_step.share_from_last_stage(sums.to("cuda" if torch.cuda.is_available() else "cpu")).cpu()
    return {name: float(sums[k] if name in summed else sums[k] / sums[-1]) for k, name in enumerate(names)}


def _names_from_last_stage(names: list[str]) -> list[str]:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return names  # every rank is the last stage: no broadcast of pickled names, a cost every step
    holder = [names]
    group = ps.get_pipeline_model_parallel_group()
    torch.distributed.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return holder[0]


def _moe_aux_losses(config, prefix: str) -> dict[str, float]:
    """Router auxiliary losses Megatron tracked during this step, averaged over MoE layers, then cleared."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    metrics = {}
    for name, entry in tracker.items():
        values = entry["values"]
        metrics[f"{prefix}/moe_{name}"] = float(values.sum() / max(1, int((values != 0).sum())))
    moe_utils.clear_aux_losses_tracker()
    return metrics
