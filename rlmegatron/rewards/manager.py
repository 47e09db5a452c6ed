"""Reward managers: score a batch of responses in the driver (the default) or in worker processes, with per-sample
timeouts, a time budget per batch and error isolation; stop on a NaN or infinite score; and (for `dapo`) add DAPO's
soft overlong penalty.

Where a function runs (`reward.num_workers`):
- 0, a plain function: in the driver's main thread, one sample after another, each stopped by SIGALRM after
  `timeout_s`. No process or pickling per sample, so a cheap rule costs microseconds. The previous SIGALRM handler
  and timer are put back after every batch. SIGALRM only reaches the main thread: called from another thread, the
  manager scores in one worker process instead (and says so once). Once a sample runs into `timeout_s`, the function
  is known to hang: the rest of that batch (when its budget allows) and every later batch score in a bounded pool of
  worker processes, so their timeouts run side by side instead of one after another (said once).
- 0, an `async def` function: concurrently on an event loop in the driver, at most `async_concurrency` at once,
  each cancelled after `timeout_s`.
- N >= 1: a pool of N spawned processes (N samples, and N timeouts, at once), each sample stopped by SIGALRM in
  its worker; a worker that does not answer by the batch's deadline is killed with its pool.
A function stuck in C code that never returns to the interpreter cannot be interrupted in the driver: if it is still
there `_STUCK_GRACE_S` after its deadline, faulthandler prints every thread's stack (the reward function's frame
on top) and ends the driver with exit code 1 rather than let the run hang. Such functions belong in worker
processes (reward.num_workers >= 1), where only their worker is killed.
"""
from __future__ import annotations

import asyncio
import faulthandler
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlmegatron.errors import UserError
from rlmegatron.plugins import PluginError, call_problem, is_async_function, load_plugin
from rlmegatron.rewards.dispatch import default_compute_score

if TYPE_CHECKING:
    from multiprocessing.pool import AsyncResult, Pool

    from rlmegatron.config.spec import RewardConfig

logger = logging.getLogger(__name__)

_STARTUP_SLACK_S = 120.0
# A worker's own alarm ends a sample at the batch deadline; this is the time its answer may take to arrive.
_RETURN_SLACK_S = 5.0
# How long past its deadline a sample in the driver may stay in uninterruptible C code before the driver exits.
_STUCK_GRACE_S = 15.0
_STDERR_FD = 2
# Workers a driver-scored function moves to once it has hung: timeouts side by side, bounded by the machine.
_HUNG_FUNCTION_WORKERS = max(2, min(16, os.cpu_count() or 1))
REWARD_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionError(UserError, ValueError):
    """`reward.function` cannot be used: it does not import, is not defined, or does not take verl's four
    arguments. The user's to fix; the message is one line naming the file and the problem."""


class UnusableRewards(UserError):
    """The reward function raised, or returned something other than a number, for every sample of a batch: training
    on the zeros that stand in for them would teach nothing, so the run stops (one line naming the function and the
    first sample, exit 2)."""


class NonFiniteReward(ArithmeticError):
    """The reward function returned NaN or an infinity; the message names the function, the sample and the value."""


@dataclass(frozen=True)
class RewardInput:
    """One response to score, with what the reward function is given (verl's compute_score arguments)."""

    sample_id: str
    """Names the sample in logs and errors, e.g. `gsm8k#12/3`: the prompt's Sample.sample_id and the response."""
    data_source: str
    solution_str: str
    """The decoded response."""
    ground_truth: Any
    response_length: int
    """Response tokens, for the overlong penalty."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt: Any = None
    """The row's prompt: chat messages or text (a reward model with its own chat template reads it)."""
    token_ids: tuple[int, ...] = ()
    """Prompt + response token ids in the policy's tokenizer (a reward model that shares it reads them)."""


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
    """The batch's: counts of responses (COUNTED_METRICS), and means over its responses (every other name)."""


COUNTED_METRICS = ("reward/errors", "reward/timeouts")


def step_reward_metrics(batches: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One step's reward metrics from the (responses, RewardResult.metrics) of each batch it scored, as if it had
    scored them all at once (dynamic sampling scores several): counts add up, means are weighted by responses."""
    sums: dict[str, float] = {}
    responses: dict[str, int] = {}
    for size, metrics in batches:
        for name, value in metrics.items():
            weight = 1 if name in COUNTED_METRICS else size
            sums[name] = sums.get(name, 0.0) + weight * value
            responses[name] = responses.get(name, 0) + size
    return {name: total if name in COUNTED_METRICS else total / responses[name] for name, total in sums.items()}


@dataclass(frozen=True)
class _Outcome:
    status: str  # "ok", "error" (raised), "invalid" (wrong type), "timeout", "nonfinite" or "broken" (no function)
    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    message: str = ""


class _SampleTimeout(BaseException):
    """BaseException so a user function's `except Exception` cannot swallow the timeout."""


def load_reward_function(function_ref: str | None) -> Callable[..., Any]:
    """The function `reward.function` names (the built-in dispatch when None), checked to take verl's arguments."""
    if function_ref is None:
        return default_compute_score
    file = function_ref.rpartition(":")[0]
    try:
        function = load_plugin(function_ref)
    except PluginError as err:
        raise RewardFunctionError(f"reward.function={function_ref}: {str(err).removeprefix(repr(function_ref) + ': ')}"
                                  ) from None
    except (Exception, SystemExit) as err:  # the user's module failed while importing
        raise RewardFunctionError(f"reward.function={function_ref}: importing {file} raised "
                                  f"{type(err).__name__}: {err}") from None
    problem = call_problem(function, REWARD_ARGUMENTS)
    if problem is not None:
        raise RewardFunctionError(f"reward.function={function_ref}: {problem}")
    return function


def _raise_timeout(signum: int, frame: Any) -> None:
    if _alarm_armed:
        raise _SampleTimeout


_alarm_armed = False


def _score_one(function: Callable[..., Any], item: RewardInput, seconds: float, limit: str) -> _Outcome:
    """One sample, stopped by SIGALRM after `seconds`; needs `_raise_timeout` installed in this (main) thread."""
    global _alarm_armed
    if seconds <= 0:
        return _Outcome("timeout", message=limit)
    _alarm_armed = True
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)  # inside the try: a tiny `seconds` may fire at once
        returned = function(item.data_source, item.solution_str, item.ground_truth, item.extra_info)
        if inspect.isawaitable(returned):  # an async function in a worker process
            returned = asyncio.run(_awaited(returned))
        # From here on a late alarm must not fire outside this try.
        _alarm_armed = False
    except _SampleTimeout:
        return _Outcome("timeout", message=limit)
    except Exception as err:  # a user function may raise anything; the batch goes on
        return _Outcome("error", message=f"{type(err).__name__}: {err}")
    finally:
        _alarm_armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    return _outcome_from_return(returned)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _outcome_from_return(returned: Any) -> _Outcome:
    extra: dict[str, Any] = {}
    if isinstance(returned, dict):
        if "score" not in returned:
            return _Outcome("invalid", message=f"returned a dict without a 'score' key: {sorted(returned)}")
        extra = {key: value for key, value in returned.items() if key != "score"}
        if not isinstance(returned["score"], numbers.Real):
            return _Outcome("invalid", message=f"returned a dict whose 'score' is {type(returned['score']).__name__}; "
                                               "expected a float")
        returned = returned["score"]
    elif not isinstance(returned, numbers.Real):  # bool included: True scores 1.0; numpy scalars too
        return _Outcome("invalid", message=f"returned {type(returned).__name__}; "
                                           "expected a float or a dict with 'score'")
    score = float(returned)
    if not math.isfinite(score):
        return _Outcome("nonfinite", score, extra, message=f"returned {score}")
    return _Outcome("ok", score, extra)


# --- worker processes ---

_worker_function: Any = None
_worker_problem: str | None = None


def _init_worker(function_ref: str | None) -> None:
    global _worker_function, _worker_problem
    try:
        _worker_function = load_reward_function(function_ref)
    except RewardFunctionError as err:
        # A Pool respawns a worker whose initializer raises, forever: keep this one and report with every job.
        _worker_problem = str(err)
    signal.signal(signal.SIGALRM, _raise_timeout)


def _score_in_worker(item: RewardInput, timeout_s: float, deadline: float, limits: tuple[str, str]) -> _Outcome:
    if _worker_problem is not None:
        return _Outcome("broken", message=_worker_problem)
    # The alarm fires in this worker's main thread, so a slow sample is stopped without killing the worker.
    # `deadline` is wall-clock time (time.time), which the driver and its workers share.
    left = deadline - time.time()
    return _score_one(_worker_function, item, min(timeout_s, left), limits[left < timeout_s])


class NaiveRewardManager:
    """Reward = the reward function's score. A sample that raises, returns something other than a number, or runs
    past `timeout_s` (or past the batch's `batch_timeout_s`) scores 0, is counted in reward/errors or
    reward/timeouts, and is logged once per batch with a few sample ids. A NaN or infinite score raises
    NonFiniteReward. See the module docstring for where the function runs."""

    def __init__(self, function_ref: str | None, num_workers: int = 0, timeout_s: float = 30.0, *,
                 batch_timeout_s: float | None = None, async_concurrency: int = 64) -> None:
        self.function_ref = function_ref
        # Loaded here, in the driver, so a broken plug-in fails the run once, before any worker starts.
        self.function = load_reward_function(function_ref)
        self.is_async = is_async_function(self.function)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.async_concurrency = async_concurrency
        self._pool: Pool | None = None
        self._warned_off_main_thread = False
        self._hung_in_driver = False

    def __call__(self, items: list[RewardInput]) -> RewardResult:
        outcomes = self._score_all(items)
        self._raise_on_non_finite(items, outcomes)
        self._raise_if_none_usable(items, outcomes)
        scores = [outcome.score for outcome in outcomes]
        extra_keys = sorted({key for outcome in outcomes for key in outcome.extra})
        extra = {key: [outcome.extra.get(key) for outcome in outcomes] for key in extra_keys}
        metrics = {
            "reward/errors": float(sum(o.status in ("error", "invalid") for o in outcomes)),
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

    # --- scoring ---

    def _score_all(self, items: list[RewardInput]) -> list[_Outcome]:
        if not items:
            return []
        budget = self.batch_timeout_s if self.batch_timeout_s is not None else math.inf
        deadline = time.time() + budget
        if self.num_workers > 0:
            return self._score_in_pool(items, deadline, self.num_workers)
        if self.is_async:
            return self._score_on_event_loop(items, deadline)
        if self._hung_in_driver:
            return self._score_in_pool(items, deadline, _HUNG_FUNCTION_WORKERS)
        if threading.current_thread() is threading.main_thread():
            return self._score_in_driver(items, deadline)
        if not self._warned_off_main_thread:
            self._warned_off_main_thread = True
            logger.warning("reward.num_workers=0 scores in the driver's main thread, where SIGALRM can stop a slow "
                           "sample; this manager runs in another thread, so it scores in one worker process instead")
        return self._score_in_pool(items, deadline, 1)

    def _limits(self) -> tuple[str, str]:
        """What a timed-out sample is told: its own limit, or the batch's (only reached when there is one)."""
        budget = math.inf if self.batch_timeout_s is None else self.batch_timeout_s
        return (f"took longer than reward.timeout_s={self.timeout_s:g}s",
                f"not scored within the batch's reward.batch_timeout_s={budget:g}s")

    def _score_in_driver(self, items: list[RewardInput], deadline: float) -> list[_Outcome]:
        limits = self._limits()
        outcomes: list[_Outcome] = []
        with _alarm_handler(), _stuck_watchdog() as watch:
            for item in items:
                left = deadline - time.time()
                seconds = min(self.timeout_s, left)
                watch(seconds)
                outcomes.append(_score_one(self.function, item, seconds, limits[left < self.timeout_s]))
                if outcomes[-1].status == "timeout" and left >= self.timeout_s:
                    self._hung_in_driver = True
                    break
        rest = items[len(outcomes):]
        if rest:
            # Worth starting workers only when the budget leaves the rest more than one timeout's time.
            if deadline - time.time() > self.timeout_s and len(rest) > 1:
                return outcomes + self._score_in_pool(rest, deadline, _HUNG_FUNCTION_WORKERS)
            with _alarm_handler(), _stuck_watchdog() as watch:
                for item in rest:
                    left = deadline - time.time()
                    watch(min(self.timeout_s, left))
                    outcomes.append(_score_one(self.function, item, min(self.timeout_s, left),
                                               limits[left < self.timeout_s]))
        return outcomes

    def _score_on_event_loop(self, items: list[RewardInput], deadline: float) -> list[_Outcome]:
        limits = self._limits()
        gate_rounds = math.ceil(len(items) / self.async_concurrency)
        with _stuck_watchdog() as watch:
            # A coroutine that blocks the loop (time.sleep inside async def) cannot be cancelled; the watchdog
            # ends the driver once the batch is past any time it could legitimately take.
            watch(min(gate_rounds * self.timeout_s, deadline - time.time()))
            return asyncio.run(self._score_concurrently(items, deadline, limits))

    async def _score_concurrently(self, items: list[RewardInput], deadline: float,
                                  limits: tuple[str, str]) -> list[_Outcome]:
        gate = asyncio.Semaphore(self.async_concurrency)

        async def score(item: RewardInput) -> _Outcome:
            async with gate:
                left = deadline - time.time()
                limit = limits[left < self.timeout_s]
                if left <= 0:
                    return _Outcome("timeout", message=limit)
                try:
                    async with asyncio.timeout(min(self.timeout_s, left)) as scope:
                        returned = await self.function(item.data_source, item.solution_str, item.ground_truth,
                                                       item.extra_info)
                except TimeoutError as err:
                    if scope.expired():
                        return _Outcome("timeout", message=limit)
                    return _Outcome("error", message=f"{type(err).__name__}: {err}")
                except Exception as err:  # a user function may raise anything; the batch goes on
                    return _Outcome("error", message=f"{type(err).__name__}: {err}")
                return _outcome_from_return(returned)

        return list(await asyncio.gather(*(score(item) for item in items)))

    def _score_in_pool(self, items: list[RewardInput], deadline: float, workers: int) -> list[_Outcome]:
        pool = self._worker_pool(workers)
        limits = self._limits()
        pending: list[AsyncResult] = [pool.apply_async(_score_in_worker, (item, self.timeout_s, deadline, limits))
                                      for item in items]
        # Backstop for functions the alarm cannot interrupt (stuck in C code): the whole batch gets the time its
        # slowest worker could need, plus generous slack for worker start-up on a loaded node, or the batch's
        # budget if that ends first.
        rounds = math.ceil(len(items) / workers)
        backstop = time.time() + rounds * (self.timeout_s + 1.0) + _STARTUP_SLACK_S
        wait_until = min(backstop, deadline + _RETURN_SLACK_S)
        outcomes = []
        stuck = False
        for result in pending:
            try:
                outcomes.append(result.get(timeout=max(0.0, wait_until - time.time())))
            except multiprocessing.TimeoutError:
                stuck = True
                message = limits[1] if wait_until < backstop else "did not return; its worker was killed"
                outcomes.append(_Outcome("timeout", message=message))
        broken = next((o for o in outcomes if o.status == "broken"), None)
        if stuck or broken:
            self.close()  # a worker that ignored the alarm cannot be reused; one without a function is no use
        if broken:
            raise RewardFunctionError(f"{broken.message} (in a reward worker process)")
        return outcomes

    def _worker_pool(self, workers: int) -> Pool:
        if self._pool is None:
            # spawn, not fork: the trainer holds threads (torch, Ray) that a forked child would inherit broken.
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(workers, initializer=_init_worker, initargs=(self.function_ref,))
        return self._pool

    # --- reporting ---

    def _raise_on_non_finite(self, items: list[RewardInput], outcomes: list[_Outcome]) -> None:
        bad = [(item, outcome) for item, outcome in zip(items, outcomes) if outcome.status == "nonfinite"]
        if bad:
            item, outcome = bad[0]
            function = self.function_ref or "rlmegatron.rewards.default_compute_score"
            more = f" (and for {len(bad) - 1} more of the batch's {len(items)})" if len(bad) > 1 else ""
            raise NonFiniteReward(f"reward function {function} {outcome.message} for sample {item.sample_id}{more}; "
                                  "a reward must be a finite number")

    def _raise_if_none_usable(self, items: list[RewardInput], outcomes: list[_Outcome]) -> None:
        """Every sample raised or returned the wrong type: a mistake in the function, not in the responses. (Timeouts
        are not counted: a slow machine makes them.)"""
        if items and all(outcome.status in ("error", "invalid") for outcome in outcomes):
            function = self.function_ref or "rlmegatron.rewards.default_compute_score"
            raise UnusableRewards(f"reward.function={function} failed on all {len(items)} samples of the batch "
                                  f"(first: {items[0].sample_id}: {outcomes[0].message}), so every reward would be 0; "
                                  "fix it to return a number, or a dict with a 'score'")

    def _log_failures(self, items: list[RewardInput], outcomes: list[_Outcome]) -> None:
        for status, what in (("error", "raised"), ("invalid", "returned the wrong type"), ("timeout", "timed out")):
            failed = [(item, o) for item, o in zip(items, outcomes) if o.status == status]
            if failed:
                item, outcome = failed[0]
                named = ", ".join(i.sample_id for i, _ in failed[:5]) + (", ..." if len(failed) > 5 else "")
                hint = ""
                if status == "timeout" and self._hung_in_driver and self.num_workers == 0:
                    hint = (f"; it hangs in the driver, so from here on it scores in {_HUNG_FUNCTION_WORKERS} worker "
                            "processes, timeouts side by side (reward.num_workers=N chooses N)")
                logger.warning(
                    "reward function %s on %d of %d samples, scored 0 (first: %s: %s) [%s]%s",
                    what, len(failed), len(items), item.sample_id, outcome.message, named, hint,
                )


@contextmanager
def _alarm_handler() -> Iterator[None]:
    """Our SIGALRM handler for the batch; whatever handler and timer were there before come back afterwards
    (pytest-timeout, for one, uses SIGALRM)."""
    previous_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        if previous_delay > 0:
            left = max(previous_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


@contextmanager
def _stuck_watchdog() -> Iterator[Callable[[float], None]]:
    """`watch(seconds)` before each sample makes sure faulthandler ends the process if that sample is still running
    `_STUCK_GRACE_S` after its `seconds`. Re-armed only when needed (arming starts a thread), so a batch of
    cheap samples arms it once."""
    armed_until = -math.inf

    def watch(seconds: float) -> None:
        nonlocal armed_until
        needed = time.monotonic() + max(seconds, 0.0) + _STUCK_GRACE_S
        if armed_until < needed:
            armed_until = needed + _STUCK_GRACE_S
            # The process's stderr by descriptor: sys.stderr may be a wrapper without one (pytest, notebooks).
            faulthandler.dump_traceback_later(armed_until - time.monotonic(), exit=True, file=_STDERR_FD)

    try:
        yield watch
    finally:
        faulthandler.cancel_dump_traceback_later()


class DAPORewardManager(NaiveRewardManager):
    """Naive scores plus DAPO's soft overlong penalty: a response longer than
    L_max - L_buf tokens loses min(0, (L_max - L_buf - length) / L_buf) * penalty_factor."""

    def __init__(self, function_ref: str | None, num_workers: int, timeout_s: float, *,
                 max_response_length: int, overlong_buffer_length: int, overlong_penalty_factor: float,
                 overlong_buffer_enable: bool = True, batch_timeout_s: float | None = None,
                 async_concurrency: int = 64) -> None:
        super().__init__(function_ref, num_workers, timeout_s, batch_timeout_s=batch_timeout_s,
                         async_concurrency=async_concurrency)
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
    common = {"batch_timeout_s": config.batch_timeout_s, "async_concurrency": config.async_concurrency}
    if config.manager == "naive":
        return NaiveRewardManager(config.function, config.num_workers, config.timeout_s, **common)
    buffer = config.overlong_buffer
    return DAPORewardManager(
        config.function, config.num_workers, config.timeout_s,
        max_response_length=max_response_length, overlong_buffer_length=buffer.length,
        overlong_penalty_factor=buffer.penalty_factor, overlong_buffer_enable=buffer.enable, **common,
    )
