"""Reward managers: score a batch of responses in worker processes (a reward function) or in the driver (the
built-in rules), with per-sample timeouts, a time budget per batch and error isolation; stop on a NaN or infinite
score, and when too many samples time out; and (for `dapo`) add DAPO's soft overlong penalty.

Where a function runs:
- `reward.function` set: never in the driver, which a function stuck in C code (holding the interpreter lock, deaf
  to signals) would freeze. It runs in worker processes of our own (`_RewardWorkers`, rewards/worker.py), each
  scoring one sample at a time under its own SIGALRM; a worker whose answer is `_KILL_GRACE_S` overdue is killed
  with SIGKILL and replaced. `reward.num_workers` N >= 1: exactly N workers. 0 (the default): `_DEFAULT_WORKERS`,
  and once a sample of the batch has timed out, up to `_HUNG_WORKERS` for the rest of it, so that hanging samples
  time out side by side; an `async def` function runs in one worker's event loop, `async_concurrency` at once.
- `reward.function` unset (the built-in rules, our own bounded Python): in the driver's main thread, one sample after
  another under SIGALRM, with no process or pickling per sample; called from another thread, in one worker process
  (SIGALRM only reaches the main thread). With reward.num_workers N >= 1, in N workers.
Timeouts count: once more than `max_timeout_fraction` of a batch's samples have timed out, scoring stops at once (the
rest cannot bring the fraction back under it) and TimedOutRewards stops the run, so a step never waits samples x
timeout_s for rewards that would all be zero.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from rlmegatron.errors import UserError
from rlmegatron.plugins import PluginError, call_problem, is_async_function, load_plugin
from rlmegatron.rewards.dispatch import default_compute_score

if TYPE_CHECKING:
    from rlmegatron.config.spec import RewardConfig

logger = logging.getLogger(__name__)

# A worker's own alarm ends a Python sample at its `seconds` and it answers within milliseconds; an answer this late
# means the function is stuck in C code, and its worker is killed. Small, since the step waits for it.
_KILL_GRACE_S = 0.5
# A worker that has not loaded the function by then (its module's imports hang) fails the run.
_STARTUP_S = 120.0
_CORES = os.cpu_count() or 1
# Workers of a reward function when reward.num_workers=0: its samples side by side, bounded by the machine.
_DEFAULT_WORKERS = max(2, min(16, _CORES))
# Once a sample of a batch has timed out, hanging samples are likely: more workers, so that enough timeouts to stop
# the run (or the rest of the batch) run side by side, a few timeout_s in all instead of samples x timeout_s.
_HUNG_WORKERS = max(_DEFAULT_WORKERS, min(64, 8 * _CORES))
REWARD_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionError(UserError, ValueError):
    """`reward.function` cannot be used: it does not import, is not defined, or does not take verl's four
    arguments. The user's to fix; the message is one line naming the file and the problem."""


class UnusableRewards(UserError):
    """The reward function raised, or returned something other than a number, for every sample of a batch: training
    on the zeros that stand in for them would teach nothing, so the run stops (one line naming the function and the
    first sample, exit 2)."""


class TimedOutRewards(UnusableRewards):
    """More than reward.max_timeout_fraction of a batch's samples timed out: training on the zeros that stand in for
    them would teach little, and waiting for the rest of the batch would cost a timeout each, so the run stops (one
    line naming the function, the counts and what to change, exit 2)."""


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

@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    capacity: int
    """Samples it scores at once: 1, or async_concurrency for an async function on its event loop."""
    started: float
    ready: bool = False
    running: dict[int, tuple[float, str]] = field(default_factory=dict)
    """Each sample it was sent: when its answer is overdue (time.time), and what a timeout is told."""


class _RewardWorkers:
    """Reward worker processes (rewards/worker.py), started as samples need them, each sent samples one at a time (or
    `capacity` at once): up to `size` of them, or `grow_to` once a sample of the batch has timed out. A worker whose
    answer is overdue is killed (SIGKILL) at once and its samples time out; a new one replaces it when there is work.
    multiprocessing.Pool could do neither: it cannot kill one worker, nor stop waiting for a task it was given."""

    def __init__(self, function_ref: str | None, size: int, grow_to: int, capacity: int = 1) -> None:
        self.function_ref, self.size, self.grow_to, self.capacity = function_ref, size, grow_to, capacity
        self.workers: list[_Worker] = []

    def score(self, items: list[RewardInput], timeout_s: float, deadline: float, limits: tuple[str, str],
              allowed_timeouts: int) -> list[_Outcome | None]:
        """Each item's outcome; None for those left unscored because more than `allowed_timeouts` timed out."""
        outcomes: list[_Outcome | None] = [None] * len(items)
        waiting = deque(range(len(items)))
        timeouts = 0

        def settle(index: int, outcome: _Outcome) -> None:
            nonlocal timeouts
            outcomes[index] = outcome
            timeouts += outcome.status == "timeout"

        try:
            while timeouts <= allowed_timeouts and (waiting or any(w.running for w in self.workers)):
                now = time.time()
                if now >= deadline:  # the batch's budget is spent: what has not started is not scored
                    while waiting:
                        settle(waiting.popleft(), _Outcome("timeout", message=limits[1]))
                    if not any(w.running for w in self.workers):
                        break
                self._start_for(len(waiting), self.size if timeouts == 0 else self.grow_to)
                for worker in self.workers:
                    while worker.ready and waiting and len(worker.running) < worker.capacity:
                        index, left = waiting.popleft(), deadline - now
                        seconds, limit = min(timeout_s, left), limits[left < timeout_s]
                        worker.conn.send((index, items[index], seconds, limit))
                        worker.running[index] = (now + seconds + _KILL_GRACE_S, limit)
                self._receive(settle, until=min([deadline] if waiting else [], default=math.inf))
                now = time.time()
                for worker in [w for w in self.workers if any(due <= now for due, _ in w.running.values())]:
                    # Stuck where its alarm cannot reach (C code, or an event loop something blocks).
                    self._kill(worker)
                    for index, (_, limit) in worker.running.items():
                        settle(index, _Outcome("timeout", message=limit))
        finally:
            # Workers still busy (scoring stopped, or the driver is interrupted) would be waited for next time.
            for worker in [w for w in self.workers if w.running]:
                self._kill(worker)
        for worker in self.workers[self.size:]:  # the extra workers of a batch that hung
            self._kill(worker)
        return outcomes

    def _start_for(self, waiting: int, most: int) -> None:
        free = sum(w.capacity - len(w.running) for w in self.workers)
        while free < waiting and len(self.workers) < most:
            self.workers.append(self._start())
            free += self.capacity

    def _start(self) -> _Worker:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", "rlmegatron.rewards.worker", str(theirs.fileno()), self.function_ref or "",
                 "async" if self.capacity > 1 else "one"],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        return _Worker(process, Connection(ours.detach()), self.capacity, time.time())

    def _receive(self, settle: Callable[[int, _Outcome], None], until: float) -> None:
        """Waits until a worker answers, or an answer or a start is overdue, or `until`, and takes the answers."""
        dues = [until] + [due for w in self.workers for due, _ in w.running.values()]
        dues += [w.started + _STARTUP_S for w in self.workers if not w.ready]
        by_conn = {w.conn: w for w in self.workers}
        for conn in wait(list(by_conn), timeout=max(0.0, min(dues) - time.time())):
            worker = by_conn[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._kill(worker)
                if not worker.ready:
                    raise RewardFunctionError(
                        f"reward.function={self.function_ref}: its worker process exited with code "
                        f"{worker.process.returncode} while loading it") from None
                for index in worker.running:
                    settle(index, _Outcome("error", message=f"its worker process died (exit code "
                                                            f"{worker.process.returncode}); a new one goes on"))
                continue
            if message[0] == "broken":
                raise RewardFunctionError(f"{message[1]} (in a reward worker process)")
            if message[0] == "ready":
                worker.ready = True
                continue
            index, outcome = message
            if worker.running.pop(index, None) is not None:
                settle(index, outcome)
        now = time.time()
        if any(not w.ready and now > w.started + _STARTUP_S for w in self.workers):
            raise RewardFunctionError(f"reward.function={self.function_ref}: a reward worker process did not load it "
                                      f"within {_STARTUP_S:g}s (does importing its module hang?)")

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.conn.close()
        self.workers.remove(worker)

    def close(self) -> None:
        for worker in list(self.workers):
            self._kill(worker)


class NaiveRewardManager:
    """Reward = the reward function's score. A sample that raises, returns something other than a number, or runs
    past `timeout_s` (or past the batch's `batch_timeout_s`) scores 0, is counted in reward/errors or
    reward/timeouts, and is logged once per batch with a few sample ids. A NaN or infinite score raises
    NonFiniteReward; more than `max_timeout_fraction` of a batch timing out raises TimedOutRewards. See the module
    docstring for where the function runs."""

    def __init__(self, function_ref: str | None, num_workers: int = 0, timeout_s: float = 30.0, *,
                 batch_timeout_s: float | None = None, async_concurrency: int = 64,
                 max_timeout_fraction: float = 0.5) -> None:
        self.function_ref = function_ref
        # Loaded here, in the driver, so a broken plug-in fails the run once, before any worker starts. It is only
        # called here when it is the built-in rules.
        self.function = load_reward_function(function_ref)
        self.is_async = is_async_function(self.function)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.async_concurrency = async_concurrency
        self.max_timeout_fraction = max_timeout_fraction
        self._pool: _RewardWorkers | None = None
        self._warned_off_main_thread = False

    def __call__(self, items: list[RewardInput]) -> RewardResult:
        outcomes = self._score_all(items)
        self._raise_on_non_finite(items, outcomes)
        self._raise_on_timeouts(items, outcomes)
        scored: list[_Outcome] = outcomes  # type: ignore[assignment]  # every one, unless the line above raised
        self._raise_if_none_usable(items, scored)
        scores = [outcome.score for outcome in scored]
        extra_keys = sorted({key for outcome in scored for key in outcome.extra})
        extra = {key: [outcome.extra.get(key) for outcome in scored] for key in extra_keys}
        metrics = {
            "reward/errors": float(sum(o.status in ("error", "invalid") for o in scored)),
            "reward/timeouts": float(sum(o.status == "timeout" for o in scored)),
        }
        self._log_failures(items, scored)
        rewards, penalty_metrics = self.shape(items, scores)
        return RewardResult(rewards, scores, extra, {**metrics, **penalty_metrics})

    def shape(self, items: list[RewardInput], scores: list[float]) -> tuple[list[float], dict[str, float]]:
        """Rewards from scores; the naive manager passes them through."""
        return list(scores), {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> NaiveRewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- scoring ---

    def _score_all(self, items: list[RewardInput]) -> list[_Outcome | None]:
        if not items:
            return []
        budget = self.batch_timeout_s if self.batch_timeout_s is not None else math.inf
        deadline = time.time() + budget
        # Stop once more samples than this have timed out: the batch is lost whatever the rest score.
        allowed_timeouts = math.floor(self.max_timeout_fraction * len(items) + 1e-9)
        if self.function_ref is None and self.num_workers == 0:
            if threading.current_thread() is threading.main_thread():
                return self._score_in_driver(items, deadline, allowed_timeouts)
            if not self._warned_off_main_thread:
                self._warned_off_main_thread = True
                logger.warning("reward.num_workers=0 scores the built-in rules in the driver's main thread, where "
                               "SIGALRM can stop a slow sample; this manager runs in another thread, so it scores "
                               "in one worker process instead")
        try:
            return self._workers().score(items, self.timeout_s, deadline, self._limits(), allowed_timeouts)
        except RewardFunctionError:
            self.close()  # a worker without the function is no use, nor are the others
            raise

    def _workers(self) -> _RewardWorkers:
        if self._pool is None:
            if self.num_workers > 0:
                self._pool = _RewardWorkers(self.function_ref, self.num_workers, self.num_workers)
            elif self.function_ref is None:  # the built-in rules, called off the main thread
                self._pool = _RewardWorkers(None, 1, 1)
            elif self.is_async:
                self._pool = _RewardWorkers(self.function_ref, 1, 1, capacity=self.async_concurrency)
            else:
                self._pool = _RewardWorkers(self.function_ref, _DEFAULT_WORKERS, _HUNG_WORKERS)
        return self._pool

    def _limits(self) -> tuple[str, str]:
        """What a timed-out sample is told: its own limit, or the batch's (only reached when there is one)."""
        budget = math.inf if self.batch_timeout_s is None else self.batch_timeout_s
        return (f"took longer than reward.timeout_s={self.timeout_s:g}s",
                f"not scored within the batch's reward.batch_timeout_s={budget:g}s")

    def _score_in_driver(self, items: list[RewardInput], deadline: float,
                         allowed_timeouts: int) -> list[_Outcome | None]:
        limits = self._limits()
        outcomes: list[_Outcome | None] = [None] * len(items)
        timeouts = 0
        with _alarm_handler():
            for index, item in enumerate(items):
                left = deadline - time.time()
                outcomes[index] = _score_one(self.function, item, min(self.timeout_s, left),
                                             limits[left < self.timeout_s])
                timeouts += outcomes[index].status == "timeout"
                if timeouts > allowed_timeouts:
                    break
        return outcomes

    # --- reporting ---

    def _name(self) -> str:
        return self.function_ref or "rlmegatron.rewards.default_compute_score"

    def _raise_on_non_finite(self, items: list[RewardInput], outcomes: list[_Outcome | None]) -> None:
        bad = [(item, outcome) for item, outcome in zip(items, outcomes)
               if outcome is not None and outcome.status == "nonfinite"]
        if bad:
            item, outcome = bad[0]
            more = f" (and for {len(bad) - 1} more of the batch's {len(items)})" if len(bad) > 1 else ""
            raise NonFiniteReward(f"reward function {self._name()} {outcome.message} for sample {item.sample_id}"
                                  f"{more}; a reward must be a finite number")

    def _raise_on_timeouts(self, items: list[RewardInput], outcomes: list[_Outcome | None]) -> None:
        timed_out = sum(outcome is not None and outcome.status == "timeout" for outcome in outcomes)
        if timed_out > math.floor(self.max_timeout_fraction * len(items) + 1e-9):
            stopped = " (scoring stopped there)" if None in outcomes else ""
            raise TimedOutRewards(
                f"reward.function={self._name()} timed out on {timed_out} of the batch's {len(items)} samples"
                f"{stopped}, more than reward.max_timeout_fraction={self.max_timeout_fraction:g} of them at "
                f"reward.timeout_s={self.timeout_s:g}s; make the function faster, raise reward.timeout_s, or raise "
                "reward.max_timeout_fraction (1 never stops)")

    def _raise_if_none_usable(self, items: list[RewardInput], outcomes: list[_Outcome]) -> None:
        """Every sample raised or returned the wrong type: a mistake in the function, not in the responses."""
        if items and all(outcome.status in ("error", "invalid") for outcome in outcomes):
            raise UnusableRewards(f"reward.function={self._name()} failed on all {len(items)} samples of the batch "
                                  f"(first: {items[0].sample_id}: {outcomes[0].message}), so every reward would be 0; "
                                  "fix it to return a number, or a dict with a 'score'")

    def _log_failures(self, items: list[RewardInput], outcomes: list[_Outcome]) -> None:
        for status, what in (("error", "raised"), ("invalid", "returned the wrong type"), ("timeout", "timed out")):
            failed = [(item, o) for item, o in zip(items, outcomes) if o.status == status]
            if failed:
                item, outcome = failed[0]
                named = ", ".join(i.sample_id for i, _ in failed[:5]) + (", ..." if len(failed) > 5 else "")
                logger.warning("reward function %s on %d of %d samples, scored 0 (first: %s: %s) [%s]",
                               what, len(failed), len(items), item.sample_id, outcome.message, named)


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


class DAPORewardManager(NaiveRewardManager):
    """Naive scores plus DAPO's soft overlong penalty: a response longer than
    L_max - L_buf tokens loses min(0, (L_max - L_buf - length) / L_buf) * penalty_factor."""

    def __init__(self, function_ref: str | None, num_workers: int, timeout_s: float, *,
                 max_response_length: int, overlong_buffer_length: int, overlong_penalty_factor: float,
                 overlong_buffer_enable: bool = True, batch_timeout_s: float | None = None,
                 async_concurrency: int = 64, max_timeout_fraction: float = 0.5) -> None:
        super().__init__(function_ref, num_workers, timeout_s, batch_timeout_s=batch_timeout_s,
                         async_concurrency=async_concurrency, max_timeout_fraction=max_timeout_fraction)
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
    common = {"batch_timeout_s": config.batch_timeout_s, "async_concurrency": config.async_concurrency,
              "max_timeout_fraction": config.max_timeout_fraction}
    if config.manager == "naive":
        return NaiveRewardManager(config.function, config.num_workers, config.timeout_s, **common)
    buffer = config.overlong_buffer
    return DAPORewardManager(
        config.function, config.num_workers, config.timeout_s,
        max_response_length=max_response_length, overlong_buffer_length=buffer.length,
        overlong_penalty_factor=buffer.penalty_factor, overlong_buffer_enable=buffer.enable, **common,
    )
