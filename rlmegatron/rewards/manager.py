"""Reward managers: score a batch of responses in worker processes, with per-sample timeouts and
error isolation, and (for `dapo`) DAPO's soft overlong penalty."""
from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.pool import AsyncResult, Pool

    from rlmegatron.config.spec import RewardConfig

logger = logging.getLogger(__name__)

_STARTUP_SLACK_S = 120.0


@dataclass(frozen=True)
class RewardInput:
    """One response to score, with what the reward function is given (verl's compute_score arguments)."""

    sample_id: str
    """Names the sample in logs, e.g. Sample.sample_id."""
    data_source: str
    solution_str: str
    """The decoded response."""
    ground_truth: Any
    response_length: int
    """Response tokens, for the overlong penalty."""
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    """Per-response rewards of a batch, in input order, and the batch's reward metrics."""

    rewards: list[float]
    """What the advantage estimator sees: score plus any penalty."""
    scores: list[float]
    """What the reward function returned (0 for a failure)."""
    extra: dict[str, list[Any]]
    """Further keys of dict-returning reward functions, one entry per response (None where absent)."""
    metrics: dict[str, float]


@dataclass(frozen=True)
class _Outcome:
    status: str  # "ok", "error" or "timeout"
    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    message: str = ""


class _SampleTimeout(BaseException):
    """BaseException so a user function's `except Exception` cannot swallow the timeout."""


_worker_function: Any = None


def _init_worker(function_ref: str | None) -> None:
    global _worker_function
    if function_ref is None:
        from rlmegatron.rewards.dispatch import default_compute_score

        _worker_function = default_compute_score
    else:
        from rlmegatron.plugins import load_plugin

        _worker_function = load_plugin(function_ref)


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _SampleTimeout


def _score_in_worker(item: RewardInput, timeout_s: float) -> _Outcome:
    # The alarm fires in this worker's main thread, so a slow sample is stopped without killing the worker.
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        returned = _worker_function(item.data_source, item.solution_str, item.ground_truth, item.extra_info)
        signal.setitimer(signal.ITIMER_REAL, 0)
        return _outcome_from_return(returned)
    except _SampleTimeout:
        return _Outcome("timeout", message=f"took longer than reward.timeout_s={timeout_s:g}s")
    except Exception as err:  # a user function may raise anything; the batch goes on
        signal.setitimer(signal.ITIMER_REAL, 0)
        return _Outcome("error", message=f"{type(err).__name__}: {err}")


def _outcome_from_return(returned: Any) -> _Outcome:
    if isinstance(returned, dict):
        if "score" not in returned:
            return _Outcome("error", message=f"returned a dict without a 'score' key: {sorted(returned)}")
        extra = {key: value for key, value in returned.items() if key != "score"}
        return _Outcome("ok", float(returned["score"]), extra)
    if isinstance(returned, (int, float)):  # bool included: True scores 1.0
        return _Outcome("ok", float(returned))
    return _Outcome("error", message=f"returned {type(returned).__name__}; expected a float or a dict with 'score'")


class NaiveRewardManager:
    """Reward = the reward function's score. Functions run in `num_workers` processes; one that raises
    or runs past `timeout_s` scores 0, is counted in reward/errors or reward/timeouts, and is logged
    once per batch with its sample id."""

    def __init__(self, function_ref: str | None, num_workers: int = 1, timeout_s: float = 30.0) -> None:
        self.function_ref = function_ref
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._pool: Pool | None = None

    def __call__(self, items: list[RewardInput]) -> RewardResult:
        outcomes = self._score_all(items)
        scores = [outcome.score for outcome in outcomes]
        extra_keys = sorted({key for outcome in outcomes for key in outcome.extra})
        extra = {key: [outcome.extra.get(key) for outcome in outcomes] for key in extra_keys}
        metrics = {
            "reward/errors": float(sum(o.status == "error" for o in outcomes)),
            "reward/timeouts": float(sum(o.status == "timeout" for o in outcomes)),
        }
        self._log_failures(items, outcomes)
        rewards, penalty_metrics = self.shape(items, scores)
        return RewardResult(rewards, scores, extra, {**metrics, **penalty_metrics})

    def shape(self, items: list[RewardInput], scores: list[float]) -> tuple[list[float], dict[str, float]]:
        """Rewards from scores; the naive manager passes them through."""
        return list(scores), {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> NaiveRewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _score_all(self, items: list[RewardInput]) -> list[_Outcome]:
        if not items:
            return []
        pool = self._worker_pool()
        pending: list[AsyncResult] = [pool.apply_async(_score_in_worker, (item, self.timeout_s)) for item in items]
        # Backstop for functions the alarm cannot interrupt (stuck in C code): the whole batch gets the
        # time its slowest worker could need, plus generous slack for worker start-up on a loaded node.
        rounds = math.ceil(len(items) / self.num_workers)
        deadline = time.monotonic() + rounds * (self.timeout_s + 1.0) + _STARTUP_SLACK_S
        outcomes = []
        stuck = False
        for result in pending:
            try:
                outcomes.append(result.get(timeout=max(0.0, deadline - time.monotonic())))
            except multiprocessing.TimeoutError:
                stuck = True
                outcomes.append(_Outcome("timeout", message="did not return; its worker was killed"))
        if stuck:
            self.close()  # a worker that ignored the alarm cannot be reused
        return outcomes

    def _worker_pool(self) -> Pool:
        if self._pool is None:
            # spawn, not fork: the trainer holds threads (torch, Ray) that a forked child would inherit broken.
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.num_workers, initializer=_init_worker, initargs=(self.function_ref,))
        return self._pool

    def _log_failures(self, items: list[RewardInput], outcomes: list[_Outcome]) -> None:
        for status, what in (("error", "raised"), ("timeout", "timed out")):
            failed = [(item, o) for item, o in zip(items, outcomes) if o.status == status]
            if failed:
                item, outcome = failed[0]
                logger.warning(
                    "reward function %s on %d of %d samples, scored 0 (first: %s: %s)",
                    what, len(failed), len(items), item.sample_id, outcome.message,
                )


class DAPORewardManager(NaiveRewardManager):
    """Naive scores plus DAPO's soft overlong penalty: a response longer than
    L_max - L_buf tokens loses min(0, (L_max - L_buf - length) / L_buf) * penalty_factor."""

    def __init__(self, function_ref: str | None, num_workers: int, timeout_s: float, *,
                 max_response_length: int, overlong_buffer_length: int, overlong_penalty_factor: float,
                 overlong_buffer_enable: bool = True) -> None:
        super().__init__(function_ref, num_workers, timeout_s)
        if overlong_buffer_enable and overlong_buffer_length > max_response_length:
            raise ValueError(
                f"reward.overlong_buffer.length={overlong_buffer_length} exceeds "
                f"data.max_response_length={max_response_length}"
            )
        self.max_response_length = max_response_length
        self.overlong_buffer_length = overlong_buffer_length
        self.overlong_penalty_factor = overlong_penalty_factor
        self.overlong_buffer_enable = overlong_buffer_enable

    def overlong_penalty(self, response_length: int) -> float:
        if not self.overlong_buffer_enable:
            return 0.0
        expected = self.max_response_length - self.overlong_buffer_length
        return min(0.0, (expected - response_length) / self.overlong_buffer_length) * self.overlong_penalty_factor

    def shape(self, items: list[RewardInput], scores: list[float]) -> tuple[list[float], dict[str, float]]:
        penalties = [self.overlong_penalty(item.response_length) for item in items]
        rewards = [score + penalty for score, penalty in zip(scores, penalties)]
        count = max(1, len(items))
        return rewards, {
            "reward/overlong_penalty/mean": sum(penalties) / count,
            "reward/overlong_ratio": sum(p < 0 for p in penalties) / count,
        }


def build_reward_manager(config: RewardConfig, max_response_length: int) -> NaiveRewardManager:
    """The manager `reward.manager` names, configured from the spec's reward section."""
    if config.manager == "naive":
        return NaiveRewardManager(config.function, config.num_workers, config.timeout_s)
    buffer = config.overlong_buffer
    return DAPORewardManager(
        config.function, config.num_workers, config.timeout_s,
        max_response_length=max_response_length, overlong_buffer_length=buffer.length,
        overlong_penalty_factor=buffer.penalty_factor, overlong_buffer_enable=buffer.enable,
    )
