"""Where the fit loop's rollouts come from: made on demand (trainer.mode=sync), or made ahead on a thread of their own
into a bounded buffer (one_step_off, async) while the trainer trains, never more weight versions ahead than the
staleness bound allows.

Both hand the loop a `Produced` rollout per step from the same `collect` (Trainer.collect_rollout), so the sync and
the overlapped loop share their steps. The bound is kept at the source: the rollout of step k starts only once the
engines hold the weights of step k - 1 - bound, so none of its tokens is older than that, and the loop trains it
with the weights of step k - 1.
"""
from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from rlmegatron.driver.rollout_data import Rollout
from rlmegatron.rollout.engine import version_step


@dataclass
class Produced:
    rollout: Rollout
    metrics: dict[str, float]
    """The generation's own: timing_s/gen, timing_s/reward, DAPO's rounds."""
    loader_state: dict[str, Any] = field(default_factory=dict)
    """The data loader's state right after this rollout's prompts were drawn: what a checkpoint of this step saves,
    so a resumed run draws the prompts of the steps after it, whatever was buffered ahead of it."""


Collect = Callable[[int], Produced]
"""The rollout of a given trainer step."""


class RolloutSource(Protocol):
    def next(self, step: int) -> Produced:
        """The rollout the loop trains at `step`."""

    def weights_updated(self, step: int) -> None:
        """The engines hold the weights trained at `step`."""


class OnDemand:
    """trainer.mode=sync: the rollout of a step is generated when the step asks for it."""

    def __init__(self, collect: Collect) -> None:
        self.collect = collect

    def next(self, step: int) -> Produced:
        return self.collect(step)

    def weights_updated(self, step: int) -> None:
        pass


AHEAD_THREAD = "rollout-ahead"


def making_ahead() -> bool:
    """Whether this thread makes rollouts ahead of the loop (whose errors the loop raises at the step they are for)."""
    return threading.current_thread().name == AHEAD_THREAD


class Ahead:
    """one_step_off and async: a thread generates the rollouts of steps first_step .. last_step in order, each once
    the engines' weights are at most `bound` versions behind the ones its step trains with, into a queue of at most
    `bound` rollouts (the bound already keeps it from holding more).

    The loop's thread holds `ranks_owner` from the rollout it got to the next one it waits for: what the generating
    thread does with the trainer ranks (push weights to an engine that restarted) waits until the loop waits, so it
    never meets a step's own use of the ranks. The thread is a daemon: after the last step's rollout it ends; if the
    loop stops early, it ends at the bound or with the engines."""

    def __init__(self, collect: Collect, first_step: int, last_step: int, bound: int, weights_at: int,
                 ranks_owner: threading.RLock) -> None:
        self.collect, self.bound, self.ranks_owner = collect, bound, ranks_owner
        self.owning = False
        self.buffer: queue.Queue = queue.Queue(maxsize=bound)
        self.changed = threading.Condition()
        self.weights_at = weights_at
        self.thread = threading.Thread(target=self._produce, args=(first_step, last_step), daemon=True,
                                       name=AHEAD_THREAD)
        self.thread.start()

    def _produce(self, first_step: int, last_step: int) -> None:
        try:
            for step in range(first_step, last_step + 1):
                with self.changed:
                    self.changed.wait_for(lambda: self.weights_at >= step - 1 - self.bound)
                self.buffer.put((step, self.collect(step)))
        except BaseException as error:  # the loop raises it at its next step
            self.buffer.put((None, error))

    def next(self, step: int) -> Produced:
        if self.owning:
            self.ranks_owner.release()
        produced_step, item = self.buffer.get()
        self.ranks_owner.acquire()
        self.owning = True
        if isinstance(item, BaseException):
            raise item
        if produced_step != step:
            raise RuntimeError(f"the rollout buffer holds step {produced_step}'s rollout where step {step} trains")
        return item

    def weights_updated(self, step: int) -> None:
        with self.changed:
            self.weights_at = step
            self.changed.notify_all()



def rollout_source(mode: str, collect: Collect, first_step: int, last_step: int, bound: int,
                   ranks_owner: threading.RLock) -> RolloutSource:
    """The rollouts of steps first_step .. last_step; the engines hold the weights of step first_step - 1."""
    if mode == "sync":
        return OnDemand(collect)
    return Ahead(collect, first_step, last_step, bound, weights_at=first_step - 1, ranks_owner=ranks_owner)


def staleness_metrics(rollout: Rollout, step: int, bound: int) -> dict[str, float]:
    """How many weight versions each sample's oldest token lags behind the policy step `step` trains (that of step
    - 1). A sample past `bound` is a bug in the bound's keeping, never trained."""
    lags = [step - 1 - version_step(result.oldest_weight_version) for result in rollout.results]
    if max(lags) > bound:
        raise RuntimeError(f"step {step} would train a sample {max(lags)} weight versions old; the bound is {bound}")
    return {"training/staleness/mean": sum(lags) / len(lags), "training/staleness/max": float(max(lags))}


@contextmanager
def waited(metrics: dict[str, float]) -> Iterator[None]:
    """How long the trainer waited for its rollout: the time the engines were not hidden behind training."""
    start = time.perf_counter()
    yield
    metrics["timing_s/wait_rollout"] = time.perf_counter() - start
