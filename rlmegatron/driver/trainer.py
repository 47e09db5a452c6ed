"""The single-controller fit loop: generate -> reward -> log-probs/values -> advantages -> update -> weight sync."""
from __future__ import annotations

import inspect
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from rlmegatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    RolloutCorrectionConfig,
    apply_kl_penalty,
    compute_advantages,
    distill_advantages,
    policy_mismatch,
    rollout_correction,
)
from rlmegatron.config.spec import SamplingParams
from rlmegatron.driver.rollout_buffer import (
    Produced,
    RolloutSource,
    making_ahead,
    rollout_source,
    staleness_metrics,
    waited,
)
from rlmegatron.transport.local_ranks import RankDied, RankFailure
from rlmegatron.driver.rollout_data import (
    Rollout,
    batch_metrics,
    build_batch,
    with_images,
    reward_inputs,
    sampling_spec,
    scored,
    token_level,
    traced_samples,
)
from rlmegatron.driver.pool_control import PoolControl
from rlmegatron.errors import Divergence, OffPolicy, UserError, WeightSyncMismatch, user_error_in
from rlmegatron.rewards import NonFiniteReward, RewardResult, UnusableRewards, step_reward_metrics
from rlmegatron.rollout.engine import GenerationRequest
from rlmegatron.runtime.distributed import CollectiveTimeout
from rlmegatron.tracking.progress import ProgressBar, progress_sink

if TYPE_CHECKING:
    from rlmegatron.driver.trainer_client import TrainerClient
    from rlmegatron.driver.engine_fleet import EngineFleet

# ReMax's baseline response: the policy's most likely one (temperature 0 is greedy on the local engine and on SGLang).
GREEDY = SamplingParams(n=1, temperature=0.0)


class Timer:
    """Seconds per phase of one step, summed when a phase runs more than once (DAPO's extra rounds)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{phase}": value for phase, value in self.seconds.items()}


class TrainingStopped(RuntimeError):
    """The loop stopped on a step it must not apply or save: a NaN or infinite reward, a Divergence (rollout
    logits, log-probs, values, a loss term, a gradient norm, the weights), a collective that timed out, a trainer
    rank that died (the OOM killer's SIGKILL), or an engine found sampling off the trained policy
    (trainer.on_policy_check)."""


class RankLost(TrainingStopped):
    """A trainer rank died or stopped answering (a collective timed out): what trainer.max_restarts restarts."""


class StoppedByMistake(UserError):
    """The loop stopped on a step because of the user's mistake found only there (a reward function whose every
    answer is unusable): one line naming the step and the last complete checkpoint, exit 2."""


@dataclass
class FitResult:
    steps: int
    """The last step trained."""
    resumed_from: int
    """The checkpoint's step this run started from (0: a fresh start); it trained resumed_from+1 .. steps."""
    last_checkpoint: Optional[str]
    exported_hf: Optional[str]


def check_on_policy(batch, tolerance: float) -> None:
    """OffPolicy naming the response token whose rollout and old log-probs are farthest apart, when over
    `tolerance` (trainer.on_policy_check)."""
    gap = (batch.rollout_log_probs - batch.old_log_probs).abs() * batch.response_mask
    worst = int(gap.argmax())
    row, token = divmod(worst, gap.shape[1])
    if gap.view(-1)[worst] > tolerance:
        raise OffPolicy(
            f"trainer.on_policy_check={tolerance:g}: row {row}, response token {token} has log-prob "
            f"{float(batch.rollout_log_probs[row, token]):.7g} from the engine and "
            f"{float(batch.old_log_probs[row, token]):.7g} from the actor ({float(gap[row, token]):.3g} apart): the "
            f"engine did not sample with the trained weights (a weight-sync or routing bug)")


class Trainer:
    """Drives the policy ranks (actor, reference, critic) and the rollout engines, colocated in those ranks or
    on their own pool, from the driver process."""

    def __init__(self, spec, ranks: TrainerClient, engines: EngineFleet, tokenizer, train_loader, val_dataset,
                 reward_manager, tracker, checkpoints):
        self.spec, self.ranks, self.engines, self.tokenizer = spec, ranks, engines, tokenizer
        bounds = spec.placement.engine_bounds(spec.rollout.tensor_parallel_size, spec.rollout.num_gpus)
        # A rollout pool of its own may grow and shrink between steps (driver/pool_control.py).
        self.pool = None if bounds is None else PoolControl(engines, spec.trainer.run_dir, bounds,
                                                            spec.rollout.autoscale)
        self.last_metrics: Optional[dict[str, float]] = None
        self.train_loader, self.val_dataset = train_loader, val_dataset
        # A vision-language dataset's image processor: the actor's batches carry their prompts' pixels.
        self.image_prompts = getattr(train_loader.dataset, "image_prompts", None)
        self.reward_manager, self.tracker, self.checkpoints = reward_manager, tracker, checkpoints
        kl = spec.algorithm.kl_ctrl
        self.kl_ctrl = (FixedKLController(kl.kl_coef) if kl.type == "fixed"
                        else AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon))
        # An estimator that declares `reward_baselines` (ReMax) compares each sample with the greedy response.
        estimator = inspect.signature(ADVANTAGE_ESTIMATORS.resolve(spec.algorithm.adv_estimator)).parameters
        self.uses_greedy_baseline = "reward_baselines" in estimator
        correction = RolloutCorrectionConfig(**spec.algorithm.rollout_correction.model_dump())
        self.rollout_correction = correction if correction.enabled else None
        self.step = 0
        self.last_checkpoint: Optional[str] = None
        self.resumed_from = 0

    def fit(self) -> FitResult:
        spec, trainer = self.spec, self.spec.trainer
        self.resume()
        self.engines.sync_metrics()  # the pushes before the first step (initial weights, a resume) are no step's
        if trainer.val_before_train and self.step == 0 and self.val_dataset is not None:
            self.tracker.log_metrics(self.validate(), step=0)
        rollouts = rollout_source(trainer.mode, self.produce_rollout, self.step + 1, self.total_steps(),
                                  trainer.staleness_bound, self.ranks.owner)
        while self.step < self.total_steps():
            self.step += 1
            timer, metrics = Timer(), {}
            with timer("step"), self.stop_on_failed_step():
                if self.pool is not None:
                    metrics.update(self.pool.at_step(self.last_metrics))
                produced = self.next_rollout(rollouts, metrics)
                rollout = produced.rollout
                baselines = self.greedy_baselines(rollout, timer, metrics) if self.uses_greedy_baseline else None
                self.engines.release_memory()
                batch = rollout.batch
                if spec.critic.enable:
                    with timer("values"):
                        batch.values = self.ranks.compute_values(batch)
                if spec.needs_old_log_prob_pass:
                    with timer("old_log_prob"):
                        batch.old_log_probs = self.ranks.compute_log_prob(batch)
                    metrics.update(policy_mismatch(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask))
                    if trainer.on_policy_check is not None:
                        check_on_policy(batch, trainer.on_policy_check)
                metrics.update(self.correct_rollout(batch))
                if spec.needs_reference:
                    with timer("ref"):
                        batch.ref_log_probs = self.ranks.compute_ref_log_prob(batch)
                teacher_log_probs = None
                if spec.algorithm.distill is not None:
                    with timer("teacher"):
                        teacher_log_probs = self.ranks.compute_teacher_log_prob(batch)
                with timer("adv"):
                    batch.advantages, batch.returns = self.advantages(rollout, baselines, teacher_log_probs, metrics)
                if spec.critic.enable:
                    with timer("update_critic"):
                        metrics.update(self.update("critic", batch))
                if self.step > trainer.critic_warmup:
                    with timer("update_actor"):
                        metrics.update(self.update("actor", batch))
                with timer("update_weights"):
                    self.engines.sync(f"step_{self.step}")
                    rollouts.weights_updated(self.step)
            metrics.update(self.engines.sync_metrics())
            metrics.update(batch_metrics(rollout, spec.rollout.max_new_tokens), **timer.metrics())
            metrics.update(self.step_counters(batch, timer))
            if _every(trainer.test_freq, self.step) and self.val_dataset is not None:
                metrics.update(self.validate())
            self.tracker.log_metrics(metrics, step=self.step)
            self.last_metrics = metrics
            self.trace(rollout)
            if _every(trainer.save_freq, self.step) or (trainer.save_freq > 0 and self.step == self.total_steps()):
                with self.stop_on_failed_step():  # a rank that dies while it saves
                    self.save(produced.loader_state)
        exported = self.export_policy()
        return FitResult(self.step, self.resumed_from, self.last_checkpoint, exported)

    def update(self, role: str, batch) -> dict[str, float]:
        """One PPO update of the actor or critic, with a bar over its optimizer steps."""
        steps = self.spec.optimizer_steps_per_update(role, len(batch))
        update = self.ranks.update_actor if role == "actor" else self.ranks.update_critic
        with progress_sink(ProgressBar(f"update_{role}", steps)) as progress:
            return update(batch, progress)

    @contextmanager
    def stop_on_failed_step(self):
        """A step that must not be applied or saved (NaN, inf, a collective that timed out, a rank that died) stops the
        run with one line naming the step and the last complete checkpoint; so do rewards that are all unusable, as
        the reward function's mistake (UnusableRewards, exit 2)."""
        try:
            yield
        except Exception as error:
            diverged = isinstance(getattr(error, "cause", error),
                                  (Divergence, NonFiniteReward, OffPolicy, WeightSyncMismatch))
            # With restarts allowed, a rank that raised what is not the user's mistake (a CUDA or NCCL error) is lost
            # too; without, it stays the bug report it is (its traceback, exit 1).
            crashed = self.spec.trainer.max_restarts > 0 and not diverged and _rank_raised(error)
            lost = isinstance(error, CollectiveTimeout) or _rank_died(error) or crashed
            stops = lost or diverged
            if not (stops or isinstance(error, UnusableRewards)):
                raise
            if making_ahead():
                raise  # in a rollout made ahead: the step that would train it stops (rollout_buffer.Ahead)
            cause = getattr(error, "cause", error)  # the rank's own exception, without Ray's wrapping
            line = (f"step {self.step}: {cause}. No checkpoint is written for this step; the last complete one is "
                    f"{self.last_checkpoint or 'none'}")
            raise (RankLost(line) if lost else TrainingStopped(line) if stops else StoppedByMistake(line)) from None

    # --- rollout: generate, score, and (DAPO) keep only groups that teach something ---

    def next_rollout(self, rollouts: RolloutSource, metrics: dict[str, float]) -> Produced:
        """This step's rollout, made now (sync) or ahead (rollout_buffer); its generation metrics, how long the
        trainer waited for it, and how many weight versions its samples lag."""
        with waited(metrics):
            produced = rollouts.next(self.step)
        metrics.update(produced.metrics,
                       **staleness_metrics(produced.rollout, self.step, self.spec.trainer.staleness_bound))
        return produced

    def produce_rollout(self, step: int) -> Produced:
        """Step `step`'s rollout with its generation metrics, wherever it is made (rollout_buffer)."""
        timer, metrics = Timer(), {}
        rollout = self.collect_rollout(step, timer, metrics)
        return Produced(rollout, {**metrics, **timer.metrics()}, self.train_loader.state_dict())

    def collect_rollout(self, step: int, timer: Timer, metrics: dict[str, float]) -> Rollout:
        sampling = self.spec.algorithm.dynamic_sampling
        wanted = self.spec.data.train_batch_size * self.spec.rollout.n
        kept: list[Rollout] = []
        round_metrics: list[tuple[int, dict[str, float]]] = []  # each round's responses and reward manager's metrics
        rounds = 0
        while True:
            rounds += 1
            prompts = self.train_loader.next_batch()
            with timer("gen"):
                results = self.generate(prompts, self.spec.rollout, seed=self.sampling_seed(step, rounds))
            with timer("reward"):
                part, reward_metrics = self.score(prompts, results, first_uid=(step * 1000 + rounds) * len(prompts))
            round_metrics.append((len(part), reward_metrics))
            if not sampling.enable:
                break
            kept.append(part.select(_rows_of_varied_groups(part)))
            total = sum(len(k) for k in kept)
            if total >= wanted or rounds >= sampling.max_num_gen_batches:
                metrics["training/num_gen_batches"] = rounds
                if total > 0:  # else nothing varied: train on the last round, whose advantages are all zero
                    part = Rollout.concat(kept).select(list(range(min(total, wanted))))
                break
        metrics.update(step_reward_metrics(round_metrics))
        return part

    def generate(self, prompts, params, seed: int, label: str = "rollout") -> list:
        """Every prompt sampled `params.n` times, the prompts spread evenly over the engines."""
        # One seed per request, so a request's samples do not depend on which engine serves it.
        # The training rollout's routing, for the actor's routing replay or its agreement (actor.moe).
        routing = label == "rollout" and self.spec.actor.wants_rollout_routing
        requests = [
            GenerationRequest(tuple(p.prompt_ids), sampling_spec(
                params, self.spec.rollout.max_new_tokens, self.spec.rollout.stop_token_ids, seed + i), p.extra_info,
                return_routed_experts=routing, images=p.images)
            for i, p in enumerate(prompts)
        ]
        # Validation's generation too: a Divergence there stops the run as one in the step does.
        with progress_sink(ProgressBar(label, len(requests) * params.n)) as progress, self.stop_on_failed_step():
            results = self.engines.generate(requests, progress)
        if len(results) != len(requests) * params.n:
            raise RuntimeError(f"the engines returned {len(results)} samples for {len(requests)} prompts x n={params.n}")
        return results

    def score(self, prompts, results, first_uid: int) -> tuple[Rollout, dict[str, float]]:
        """The scored rollout, and the reward manager's metrics of its responses."""
        rows = [prompts[r.request_index] for r in results]
        uids = [first_uid + r.request_index for r in results]
        batch = with_images(build_batch([p.prompt_ids for p in rows], results, self.spec.rollout.max_new_tokens),
                            rows, self.image_prompts)
        reward = self.rewards(rows, results)
        return scored(rows, uids, results, batch, reward), reward.metrics

    def rewards(self, rows, results) -> RewardResult:
        """The reward manager's scores; a NaN or infinite one stops the run here, before it reaches any loss."""
        with self.stop_on_failed_step():
            return self.reward_manager(reward_inputs(rows, results, self.tokenizer))

    def greedy_baselines(self, rollout: Rollout, timer: Timer, metrics: dict[str, float]) -> torch.Tensor:
        """ReMax's baseline, one per row: the reward of one greedy response to the row's prompt, generated once per
        prompt after dynamic sampling chose the rows (a dropped prompt costs no pass) and scored by the same reward
        manager. Like the samples' it includes any shaping (DAPO's overlong penalty). The greedy responses are
        never trained on; only their mean reward reaches the metrics."""
        first_row: dict[int, int] = {}
        for row, uid in enumerate(rollout.uids):
            first_row.setdefault(uid, row)
        uids, prompts = list(first_row), [rollout.prompts[row] for row in first_row.values()]
        with timer("gen_baseline"):
            results = self.generate(prompts, GREEDY, seed=self.spec.rollout.seed, label="gen_baseline")
        with timer("reward"):
            rows = [prompts[r.request_index] for r in results]
            reward = self.rewards(rows, results)
        by_uid = {uids[r.request_index]: value for r, value in zip(results, reward.rewards)}
        metrics["critic/reward_baseline/mean"] = sum(by_uid.values()) / len(by_uid)
        return torch.tensor([by_uid[uid] for uid in rollout.uids], dtype=torch.float32)

    def correct_rollout(self, batch) -> dict[str, float]:
        """algorithm.rollout_correction: importance weights for the actor's loss, and rejected tokens out of the
        response mask (so out of the advantages' and every loss's tokens); its rollout_corr/* metrics."""
        if self.rollout_correction is None:
            return {}
        corrected = rollout_correction(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask,
                                       self.rollout_correction)
        batch.rollout_is_weights, batch.response_mask = corrected.weights, corrected.response_mask
        return corrected.metrics

    def advantages(self, rollout: Rollout, baselines, teacher_log_probs, metrics: dict[str, float]):
        """(advantages, returns) of the step: the estimator's from the task reward, plus, with algorithm.distill,
        the teacher's per-token term (alone with distill.only: returns are then the advantages, as GRPO's are)."""
        spec, batch = self.spec, rollout.batch
        distill = spec.algorithm.distill
        if distill is not None:
            # The sampling policy's log-probs: the actor's old ones where the step computed them, else the engine's
            # (on-policy then: the weights that sampled are the ones the update starts from).
            student = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs
            distilled, distill_metrics = distill_advantages(
                student, teacher_log_probs, batch.response_mask, distill.coef, distill.mode,
                group_index=rollout.uids if distill.baseline == "group_mean" else None)
            metrics.update(distill_metrics)
            if distill.only:
                return distilled, distilled
        advantages, returns = compute_advantages(
            spec.algorithm.adv_estimator, self.token_rewards(rollout, metrics), batch.response_mask,
            values=batch.values, group_index=rollout.uids, reward_baselines=baselines, gamma=spec.algorithm.gamma,
            lam=spec.algorithm.lam, norm_adv_by_std=spec.algorithm.norm_adv_by_std_in_grpo)
        return (advantages, returns) if distill is None else (advantages + distilled, returns)

    def token_rewards(self, rollout: Rollout, metrics: dict[str, float]) -> torch.Tensor:
        batch = rollout.batch
        rewards = token_level(rollout.rewards, batch.response_mask)
        if not self.spec.algorithm.use_kl_in_reward:
            return rewards
        rewards, kl_metrics = apply_kl_penalty(rewards, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                                               self.kl_ctrl, self.spec.algorithm.kl_penalty)
        metrics.update({"actor/reward_kl_penalty": float(kl_metrics["kl"]),
                        "actor/reward_kl_penalty_coeff": float(kl_metrics["kl_coef"])})
        return rewards

    def trace(self, rollout: Rollout) -> None:
        """A few of the step's samples as text, for reading what the policy wrote (tracking.rollout_trace)."""
        trace = self.spec.tracking.rollout_trace
        if trace.backend is not None:
            samples = traced_samples(rollout, self.tokenizer, trace.prompts_per_step)
            self.tracker.log_rollout_samples(samples, self.step, trace.backend)

    # --- validation, counters, checkpoints, export ---

    def validate(self) -> dict[str, float]:
        """Each data source's mean score, and the reward manager's metrics over the whole validation set (its errors
        and timeouts above all: a reward function that fails only on held-out answers would otherwise go unseen),
        all under val/."""
        prompts = [self.val_dataset[i] for i in range(len(self.val_dataset))]
        batch_size = self.spec.data.val_batch_size or len(prompts)
        scores: dict[str, list[float]] = defaultdict(list)
        batch_metrics = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            results = self.generate(chunk, self.spec.rollout.val_kwargs, seed=self.spec.rollout.seed, label="validation")
            rows = [chunk[r.request_index] for r in results]
            reward = self.rewards(rows, results)
            batch_metrics.append((len(rows), reward.metrics))
            for prompt, score in zip(rows, reward.scores):
                scores[prompt.data_source].append(score)
        return {**{f"val/{source}/score/mean": sum(v) / len(v) for source, v in scores.items()},
                **{f"val/{name}": value for name, value in step_reward_metrics(batch_metrics).items()}}

    def step_counters(self, batch, timer: Timer) -> dict[str, float]:
        tokens = float(batch.attention_mask.sum())
        return {
            "training/global_step": self.step,
            "training/epoch": self.train_loader.epoch,
            "perf/throughput": tokens / timer.seconds["step"] / self.ranks.world_size,
        }

    def total_steps(self) -> int:
        return self.spec.total_steps(len(self.train_loader))

    def sampling_seed(self, step: int, round_: int) -> int:
        # A function of (seed, step, round) only, so a resumed run samples exactly what the original would have.
        return ((self.spec.rollout.seed * 1_000_003 + step) * 101 + round_) * 100_003

    def save(self, loader_state: dict[str, Any]) -> None:
        """`loader_state`: the data loader's right after this step's prompts were drawn; rollouts generated ahead
        of this step are not saved, and a run resumed here generates them again (rollout_buffer.Produced)."""
        state = {"step": self.step, "dataloader": loader_state, "kl_coef": self.kl_ctrl.value}
        self.last_checkpoint = self.checkpoints.save(self.step, self.ranks, state)

    def resume(self) -> None:
        """The checkpoint CheckpointManager.plan_resume chose (or the one before it, if it does not load) into every
        rank, the engines and the data loader; then the records continue from its step."""
        found = self.checkpoints.load_resume_point(self.ranks)
        if found is not None:
            path, state = found
            self.step = self.resumed_from = int(state["step"])
            self.engines.sync(f"step_{self.step}")
            self.train_loader.load_state_dict(state["dataloader"])
            self.kl_ctrl.value = float(state["kl_coef"])
            self.last_checkpoint = str(path)
            print(f"resumed from {path} at step {self.step}", flush=True)
        self.tracker.start(self.step)

    def export_policy(self) -> Optional[str]:
        path = str(Path(self.spec.trainer.run_dir) / "hf_policy")
        return self.ranks.export_hf(path)


def _rank_died(error: BaseException) -> bool:
    """A trainer rank's process ended under a call: a rank process (RankDied) or a Ray actor (RayActorError; Ray is
    looked up, never imported here)."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    return isinstance(error, RankDied) or (ray_exceptions is not None
                                           and isinstance(error, ray_exceptions.RayActorError))


def _rank_raised(error: BaseException) -> bool:
    """A trainer rank raised `error`, not as the user's mistake: the processes transport re-raises the rank's exception
    with its traceback as the cause (a RankFailure), Ray as a RayTaskError (looked up, never imported here)."""
    if user_error_in(error) is not None:
        return False
    ray_exceptions = sys.modules.get("ray.exceptions")
    return isinstance(error.__cause__, RankFailure) or (ray_exceptions is not None
                                                        and isinstance(error, ray_exceptions.RayTaskError))


def _every(freq: int, step: int) -> bool:
    return freq > 0 and step % freq == 0


def _rows_of_varied_groups(rollout: Rollout) -> list[int]:
    """Rows whose group's scores are not all equal: an all-equal group has zero advantage everywhere."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for row, uid in enumerate(rollout.uids):
        by_group[uid].append(row)
    return [row for rows in by_group.values() if len({float(rollout.scores[r]) for r in rows}) > 1 for row in rows]
