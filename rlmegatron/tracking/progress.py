"""Progress bars for the long phases of a step (rollout samples, update mini-batches), fed from the ranks.

A rank reports through whatever `progress_sink` handed it: in one process a plain callable (the bar's `advance`; a rank
process gets a stand-in for it that sends each report over its pipe, transport/rank_processes.py), under Ray a tiny
counter actor that a driver thread polls, so reporting never blocks a rank on the driver.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, TextIO

Progress = Any
"""What a rank receives: a callable taking a count, or a Ray handle to a `ProgressCounter`; None reports nothing."""


def report(progress: Optional[Progress], count: int = 1) -> None:
    if progress is None:
        return
    if hasattr(progress, "add"):
        progress.add.remote(count)  # fire and forget: the rank does not wait for the driver
    else:
        progress(count)


class ProgressBar:
    """`label [#####.....] done/total elapsed` redrawn in place on a terminal and erased once the phase is done, so a
    step leaves only its one console line; on a log file nothing, unless `log_lines` (`rlm train --verbose`): then one
    line at each quarter."""

    log_lines = False
    """Set for the whole process by `rlm train --verbose`."""

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None, width: int = 30) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream or sys.stderr
        self.done, self.started = 0, time.perf_counter()
        self.interactive = self.stream.isatty()
        self._quarters_shown = 0
        self._lock = threading.Lock()

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self.done = min(self.total, self.done + count)
            self._draw()

    def complete(self) -> None:
        """The phase is over: every unit is in hand, whatever reports are still on their way."""
        self.advance(self.total - self.done)

    def _draw(self) -> None:
        filled = self.width * self.done // self.total
        line = (f"{self.label:<14} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.started:6.1f}s")
        if self.interactive:
            # Done: the line is blanked and the cursor left at its start, for the step's own line.
            self.stream.write("\r" + (line if self.done < self.total else " " * len(line) + "\r"))
            self.stream.flush()
        elif self.log_lines and 4 * self.done // self.total > self._quarters_shown:
            self._quarters_shown = 4 * self.done // self.total
            print(line, file=self.stream, flush=True)


class ProgressCounter:
    """The Ray actor behind a sink: ranks add, the driver takes what accumulated since its last look."""

    def __init__(self) -> None:
        self.pending = 0

    def add(self, count: int) -> None:
        self.pending += count

    def take(self) -> int:
        pending, self.pending = self.pending, 0
        return pending


POLL_TIMEOUT_S = 2.0


@contextmanager
def progress_sink(bar: ProgressBar, poll_s: float = 0.5) -> Iterator[Progress]:
    """What to hand the ranks so that their reports advance `bar`."""
    ray = sys.modules.get("ray")  # a run without Ray never imports it
    if ray is None or not ray.is_initialized():
        yield bar.advance
        bar.complete()
        return
    counter = _run_counter(ray)
    # Late reports of the previous phase are not this bar's. No need to wait for the reply: the counter runs this
    # driver's calls in the order they were sent, so the poller's takes come after this one.
    counter.take.remote()
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(poll_s):
            try:
                bar.advance(ray.get(counter.take.remote(), timeout=POLL_TIMEOUT_S))
            except ray.exceptions.GetTimeoutError:  # a loaded machine, or the stop's below: look again or stop
                continue
            except ray.exceptions.RayError:  # the cluster is going (a job cancelled): the run's own error says why
                return

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield counter
    finally:
        stop.set()
        # Not past a take that hangs (its node going away): the poller is a daemon, and the bar's last reports are
        # fire-and-forget anyway.
        poller.join(POLL_TIMEOUT_S)
    bar.complete()  # reports are fire-and-forget: the last ones may still be on their way


_counters: dict[Any, Any] = {}


def _run_counter(ray) -> Any:
    """One counter actor per Ray job, reused by every bar: starting an actor costs about a second, per phase
    and step that doubled the quickstart's step time."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    job = context.get_job_id()
    if job not in _counters:
        # On the driver's node, whose loss ends the run anyway: not on a node that may leave while the run goes on.
        here = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
        _counters[job] = ray.remote(num_cpus=0)(ProgressCounter).options(scheduling_strategy=here).remote()
    return _counters[job]
