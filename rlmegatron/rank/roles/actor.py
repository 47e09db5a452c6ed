"""The actor worker: log-probs/entropy of responses and the PPO update of a Megatron GPTModel, Ray-free."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from typing import Optional

import torch

from rlmegatron.algorithms import POLICY_LOSSES, PolicyLossConfig, entropy_bonus, kl_loss, policy_mismatch
from rlmegatron.config.spec import optimizer_steps
from rlmegatron.models.routing_replay import RoutingTaps
from rlmegatron.rank.roles import megatron_step
from rlmegatron.rank.roles.batch import MicroBatch, RolloutBatch, share_prompt_routing
from rlmegatron.rank.roles.training import TrainingSettings, TrainingWorker, micro_batches, raise_if_not_finite_tokens
from rlmegatron.rank.roles.vocab_parallel import vocab_parallel_log_probs_and_entropy


@dataclass(frozen=True)
class ActorSettings(TrainingSettings):
    """How the actor batches and what its loss is (verl's actor fields, same meanings)."""

    temperature: float = 1.0  # the rollout temperature; logits are divided by it
    # The tokenizer's vocabulary. Megatron pads the output layer to a TP-divisible size, and the padding
    # rows' logits (0 for weights imported from HF) would otherwise take probability mass.
    vocab_size: Optional[int] = None
    policy_loss: str = "vanilla"  # a registered name or a user's path/to/file.py:function
    policy_loss_config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    log_prob_micro_batch_size: Optional[int] = None  # the old-log-prob pass's; None uses micro_batch_size
    # MoE (models/routing_replay.py): "r3" replays the batch's rollout routing in every pass, "r2" the old-log-prob
    # pass's own in the update; `routing_agreement` compares the model's own routing with the batch's record.
    routing_replay: str = "off"
    routing_agreement: bool = False
    # The MTP layers' loss in the update (mtp_loss): 0 leaves them out of it, not run; `mtp_detach`: it trains them
    # alone (models/mtp.detach_mtp_inputs).
    mtp_loss_weight: float = 0.0
    mtp_detach: bool = False


def response_log_probs(micro_batch: MicroBatch, logits: torch.Tensor, settings: ActorSettings, with_entropy: bool):
    """log p(response token) [n, R] and entropy [n, R] (or None) from one micro-batch's vocab-parallel logits."""
    if micro_batch.context_order is None:
        # Only the logits that predict a response token, each with that token as its label: no softmax over the
        # prompts' positions, and a shared prompt's last position (micro_batch's docstring) once per response.
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, micro_batch.source_index)
        labels, to_grid = micro_batch.target_labels, micro_batch.targets_to_grid
    else:  # each CP rank holds some positions' logits: per position here, gathered as values by to_response_grid
        labels, to_grid = micro_batch.labels, micro_batch.to_response_grid
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        logits, labels, settings.temperature, with_entropy, settings.vocab_size
    )
    return to_grid(log_probs), (to_grid(entropy) if with_entropy else None)


def compute_log_prob(chunks: list, settings: ActorSettings, batch: RolloutBatch, with_entropy: bool,
                     routing: Optional[RoutingTaps] = None):
    """log p(response token) [B, R] (and entropy [B, R]) under `chunks`' weights, zero outside response_mask."""

    def per_token(micro_batch, logits):
        log_probs, entropy = response_log_probs(micro_batch, logits, settings, with_entropy)
        mask = micro_batch.response_fields.response_mask.to(log_probs.device)
        return (log_probs * mask,) + ((entropy * mask,) if with_entropy else ())

    results = megatron_step.run_forward_only(
        chunks, batch, micro_batches(settings, batch, chunks), per_token, outputs=2 if with_entropy else 1,
        routing=routing)
    return (results[0], results[1]) if with_entropy else (results[0], None)


def mtp_loss(micro_batch: MicroBatch, ahead: list, settings: ActorSettings) -> torch.Tensor:
    """The MTP layers' cross-entropy on one micro-batch, summed over the response tokens each predicts and averaged
    over the layers: Megatron-Core's MTP loss (its labels and mask rolled one place further per layer along each
    sequence, roll_tensor) with the micro-batch's next tokens as labels, masked to the positions whose target is a
    response token. The logits are divided by the rollout temperature, as the actor's log-probs are: the sampled
    tokens come from the main model's tempered distribution, so the MTP layers' tempered one learns to match it,
    which is what a draft at that temperature needs."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    params, labels = micro_batch.packed_seq_params, micro_batch.labels
    targets = torch.zeros(labels.numel(), device=labels.device).index_fill_(0, micro_batch.source_index, 1.0)
    targets = targets.view_as(labels)
    total = torch.zeros((), device=labels.device)
    for logits in ahead:
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, packed_seq_params=params)
        targets, _ = roll_tensor(targets, shifts=-1, dims=-1, packed_seq_params=params)
        # Only the positions with a response target go through the softmax.
        where = targets.reshape(-1).nonzero().squeeze(1)
        log_probs, _ = vocab_parallel_log_probs_and_entropy(
            logits.reshape(-1, logits.shape[-1]).index_select(0, where), labels.reshape(-1).index_select(0, where),
            settings.temperature, False, settings.vocab_size)
        total = total - log_probs.sum()
    return total / len(ahead)


# The actor's metrics that carry the mini-batch's denominator: their sums over micro-batches and DP ranks are the
# mini-batch's values (training._reduce_metrics); fillers, which report nothing, change no sum.
SUMMED = ("actor/pg_loss", "actor/mtp_loss")


class ActorWorker(TrainingWorker):
    """One rank of the actor: every rank of the group gets the same RolloutBatch and returns the same result.

    An MoE actor with routing replay or agreement (ActorSettings) taps its routers (models/routing_replay.py): R3
    replays the batch's rollout record in every pass; R2 records the old-log-prob pass's routing and replays it in
    the update of the same batch. `moe/routing_agreement` is measured in the first pass over a step's batch (the
    old-log-prob pass, or else the on-policy update) and reported with the update's metrics."""

    metric_prefix = "actor"

    def init(self, parallel_state_ready: bool = False) -> None:
        super().init(parallel_state_ready)
        s = self.settings
        wanted = s.routing_replay != "off" or s.routing_agreement
        moe = getattr(megatron_step.unwrap(self.chunks[0]).config, "num_moe_experts", None)
        self.routing = RoutingTaps(self.chunks) if wanted and moe else None
        self.recorded_routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # R2: (input_ids, record)
        self.measured: Optional[tuple[torch.Tensor, tuple[int, int]]] = None  # (input_ids, agreement) of a pass
        # (rows, log-probs) of the on-policy update's micro-batches while it runs (update); None otherwise
        self.forward_log_probs: Optional[list[tuple[list[int], torch.Tensor]]] = None

    def compute_log_prob(self, batch: RolloutBatch, with_entropy: bool = True):
        """log p(response token) [B, R] (and entropy [B, R]) under the current weights, zero outside response_mask."""
        settings = self.settings
        if settings.log_prob_micro_batch_size is not None:
            # No backward pass here, so larger micro-batches than the update's fit in the same memory.
            settings = replace(settings, micro_batch_size=settings.log_prob_micro_batch_size)
        if self.routing is None:
            log_probs, entropy = compute_log_prob(self.chunks, settings, batch, with_entropy)
        else:
            mode = {"r3": "replay", "r2": "record", "off": "measure"}[settings.routing_replay]
            with self.routing.passing(mode, batch):
                log_probs, entropy = compute_log_prob(self.chunks, settings, batch, with_entropy, self.routing)
            if mode == "record":
                self.recorded_routing = (batch.input_ids, share_prompt_routing(batch, self.routing.recorded(batch)))
            self.measured = (batch.input_ids, self.routing.agreement())
        raise_if_not_finite_tokens({"actor/old_log_prob": log_probs, "actor/entropy": entropy}, batch.response_mask)
        return log_probs, entropy

    def update(self, batch: RolloutBatch, progress=None) -> dict[str, float]:
        """PPO: for each epoch and mini-batch, accumulate gradients over micro-batches, then one optimizer step."""
        s = self.settings
        if batch.advantages is None:
            raise ValueError("update needs advantages")
        if batch.old_log_probs is None and optimizer_steps(len(batch), s.ppo_mini_batch_size, s.ppo_epochs) > 1:
            raise ValueError("without old_log_probs the update must be on-policy: one epoch of one mini-batch")
        if s.use_kl_loss and batch.ref_log_probs is None:
            raise ValueError("use_kl_loss needs ref_log_probs")
        # On policy without an old-log-prob pass, the update's own forward (before its one optimizer step) gives the
        # log-probs that pass would have: the rollout-vs-trainer mismatch is measured from it, at no extra pass.
        self.forward_log_probs = [] if batch.old_log_probs is None and batch.rollout_log_probs is not None else None
        mtp = s.mtp_loss_weight > 0
        if self.routing is None:
            metrics = self._run_mini_batches(batch, self._loss_func_factory, summed=SUMMED, progress=progress,
                                             mtp=mtp)
        else:
            if s.routing_replay == "r2":
                batch = replace(batch, routed_experts=self._recorded_routing_of(batch))
            measured = self._of(self.measured, batch)
            mode = "replay" if s.routing_replay != "off" else "measure" if measured is None else "free"
            with self.routing.passing(mode):
                metrics = self._run_mini_batches(batch, self._loss_func_factory, summed=SUMMED,
                                                 progress=progress, routing=self.routing, mtp=mtp)
            agreeing, compared = self.routing.agreement() if measured is None else measured
            self.measured = self.recorded_routing = None
            if compared:
                metrics["moe/routing_agreement"] = agreeing / compared
        if self.forward_log_probs is not None:
            metrics.update(self._mismatch_of_the_update_forward(batch))
        return metrics

    def _mismatch_of_the_update_forward(self, batch: RolloutBatch) -> dict[str, float]:
        """policy_mismatch of the log-probs the on-policy update's forward kept (its micro-batches', this DP rank's
        rows, on the last stage), put together for the whole batch on every rank as an old-log-prob pass does."""
        full = torch.zeros(len(batch), batch.response_length, device="cuda" if torch.cuda.is_available() else "cpu")
        if megatron_step.is_last_stage():
            for rows, log_probs in self.forward_log_probs:
                full[torch.as_tensor(rows, device=full.device)] = log_probs
        megatron_step.share_from_last_stage(full)
        self.forward_log_probs = None
        return policy_mismatch(full.cpu(), batch.rollout_log_probs, batch.response_mask)

    def _recorded_routing_of(self, batch: RolloutBatch) -> torch.Tensor:
        recorded = self._of(self.recorded_routing, batch)
        if recorded is None:
            raise RuntimeError("routing replay r2 replays the old-log-prob pass's routing, and no such pass ran over "
                               "this batch")
        return recorded

    @staticmethod
    def _of(kept: Optional[tuple[torch.Tensor, object]], batch: RolloutBatch):
        """What was kept of a pass over `batch`'s rows (None: a pass over other rows, or none)."""
        if kept is None or not torch.equal(kept[0], batch.input_ids):
            return None
        return kept[1]

    def _loss_func_factory(self, mini_batch: RolloutBatch, scale: int):
        s = self.settings
        aggregation = self._aggregation(mini_batch)
        policy_loss_fn = POLICY_LOSSES.resolve(s.policy_loss)
        # The MTP loss is a token mean over the mini-batch's response tokens, whatever loss_agg_mode says.
        response_tokens = mini_batch.response_mask.sum().clamp(min=1)

        def loss_func_for(micro_batch: MicroBatch, logits: torch.Tensor, ahead: Optional[list] = None):
            fields = micro_batch.response_fields
            device = logits.device
            mask = fields.response_mask.to(device)
            log_probs, entropy = response_log_probs(micro_batch, logits, s, with_entropy=True)
            # On-policy without an old-log-prob pass: this forward is the policy that sampled.
            old_log_probs = log_probs.detach() if fields.old_log_probs is None else fields.old_log_probs.to(device)
            if self.forward_log_probs is not None:
                self.forward_log_probs.append((micro_batch.rows, (log_probs.detach() * mask).float()))
            pg_loss, pg_metrics = policy_loss_fn(
                old_log_probs,
                log_probs,
                fields.advantages.to(device),
                mask,
                config=s.policy_loss_config,
                aggregation=aggregation,
                **({} if fields.rollout_is_weights is None
                   else {"rollout_is_weights": fields.rollout_is_weights.to(device)}),
            )
            loss = pg_loss
            entropy_term, entropy_metrics = entropy_bonus(entropy, mask, s.entropy_coeff, aggregation)
            if s.entropy_coeff != 0.0:
                loss = loss + entropy_term
            reported = {
                "actor/pg_loss": pg_loss.detach(),
                **{f"actor/{name}": value for name, value in pg_metrics.items()},
                "actor/entropy": entropy_metrics["entropy"],
            }
            if s.use_kl_loss:
                kl_term, kl_metrics = kl_loss(
                    log_probs, fields.ref_log_probs.to(device), mask, s.kl_loss_coef, s.kl_loss_type, aggregation
                )
                loss = loss + kl_term
                reported["actor/kl_loss"] = kl_metrics["kl_loss"]
            if ahead is not None:
                mtp_term = mtp_loss(micro_batch, ahead, s) / response_tokens.to(device)
                loss = loss + s.mtp_loss_weight * mtp_term
                reported["actor/mtp_loss"] = mtp_term.detach()  # of the mini-batch's denominator: summed (SUMMED)
            return loss * scale, {k: v.detach().clone() for k, v in reported.items()}

        return loss_func_for
