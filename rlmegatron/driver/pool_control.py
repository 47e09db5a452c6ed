"""A rollout pool that grows and shrinks while the job runs (placement.mode=disaggregate): at the start of each step
the driver takes the requests `rlm pool add|remove` left in the run directory and, with rollout.autoscale, its own
decisions, within placement.rollout_min_engines .. rollout_max_engines (`EngineFleet.grow` / `shrink`).

A request is a file `<run_dir>/pool_requests/<time>-<add|remove>-<count>.json`, written whole (a rename) and taken
once. An engine that joins gets the trained weights whole before its first request; one that leaves finishes what it
runs (no sample is lost). A request past the bounds is cut to them, one that cannot be met (no room on the cluster)
is said in one line, and the run goes on.

Autoscaling adds an engine for each node that joins the Ray cluster (up to the bound), and reads the share of the
last step the trainer spent waiting for its rollout (timing_s/wait_rollout over
timing_s/step: all of generation in trainer.mode=sync, what generation ahead did not hide otherwise): above
GROW_SHARE for GROW_AFTER steps running, one engine more; below SHRINK_SHARE for SHRINK_AFTER steps, one fewer
(the last to join first). Each step logs pool/engines, pool/added, pool/removed and pool/wait_share.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from rlmegatron.errors import EngineCannotJoin, UserError
from rlmegatron.checkpoint.run_dir import in_use

REQUESTS_DIR = "pool_requests"
GROW_SHARE, GROW_AFTER = 0.5, 2
SHRINK_SHARE, SHRINK_AFTER = 0.1, 3


class NoRunThere(UserError):
    """`rlm pool` on a directory no disaggregated run uses."""


def request(run_dir: str, action: str, count: int) -> Path:
    """`rlm pool add|remove COUNT RUN_DIR`: the request for the run that uses `run_dir`, which takes it at its next
    step."""
    directory = Path(run_dir)
    if not in_use(directory):
        raise NoRunThere(f"{run_dir}: no run is training there (no live lock); start it with rlm train, or name its "
                         "trainer.run_dir")
    requests = directory / REQUESTS_DIR
    requests.mkdir(exist_ok=True)
    path = requests / f"{time.time_ns()}-{action}-{count}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"action": action, "count": count}))
    os.replace(partial, path)
    return path


class PoolControl:
    """The driver's side: `at_step` applies what was asked since the last step."""

    def __init__(self, fleet, run_dir: str, bounds: tuple[int, int, int], autoscale: bool,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        self.fleet, self.requests, self.autoscale, self.say = fleet, Path(run_dir) / REQUESTS_DIR, autoscale, say
        self.fewest, _, self.most = bounds
        self.waiting_steps = self.idle_steps = 0

    def at_step(self, last: Optional[dict[str, float]]) -> dict[str, float]:
        """Requests, then (with autoscale) the policy on the last step's metrics; the pool's metrics for this step."""
        added = removed = 0
        for path in sorted(self.requests.glob("*.json")) if self.requests.is_dir() else []:
            asked = json.loads(path.read_text())
            path.unlink()
            change = self._apply(asked["action"], int(asked["count"]), f"rlm pool {asked['action']}")
            added, removed = added + max(change, 0), removed + max(-change, 0)
        if self.autoscale:  # a node that joined the Ray cluster is room for an engine: one joins on it
            for address in self.fleet.joined_nodes():
                if self.fleet.count < self.most:
                    change = self._apply("add", 1, f"rollout.autoscale (node {address} joined the Ray cluster)")
                    added += max(change, 0)
        share = None
        if last and last.get("timing_s/step"):
            share = last.get("timing_s/wait_rollout", 0.0) / last["timing_s/step"]
        if self.autoscale and share is not None:
            self.waiting_steps = self.waiting_steps + 1 if share > GROW_SHARE else 0
            self.idle_steps = self.idle_steps + 1 if share < SHRINK_SHARE else 0
            change = 0
            if self.waiting_steps >= GROW_AFTER and self.fleet.count < self.most:
                change = self._apply("add", 1, f"rollout.autoscale (waited {share:.0%} of the step)")
            elif self.idle_steps >= SHRINK_AFTER and self.fleet.count > self.fewest:
                change = self._apply("remove", 1, f"rollout.autoscale (waited {share:.0%} of the step)")
            if change:
                self.waiting_steps = self.idle_steps = 0
            added, removed = added + max(change, 0), removed + max(-change, 0)
        metrics = {"pool/engines": float(self.fleet.count), "pool/added": float(added), "pool/removed": float(removed)}
        if share is not None:
            metrics["pool/wait_share"] = share
        return metrics

    def _apply(self, action: str, count: int, why: str) -> int:
        """Engines added (> 0) or removed (< 0)."""
        have = self.fleet.count
        if action == "add":
            take = min(count, self.most - have)
            if take < count:
                self.say(f"rollout pool: {why} asked for {count} engine(s) more; {have} run and "
                         f"placement.rollout_max_engines={self.most}, so {take} join")
            if take <= 0:
                return 0
            try:
                added = self.fleet.grow(take)
            except (UserError, EngineCannotJoin) as refused:  # no room, or it did not start: the run goes on
                self.say(f"rollout pool: {why}: no engine could join: {refused}")
                return 0
            self.say(f"rollout pool: {why}: engine(s) {added} joined with the weights of {self.fleet.version}; "
                     f"{self.fleet.count} engines")
            return len(added)
        take = min(count, have - self.fewest)
        if take < count:
            self.say(f"rollout pool: {why} asked for {count} engine(s) fewer; {have} run and "
                     f"placement.rollout_min_engines={self.fewest}, so {max(take, 0)} leave")
        if take <= 0:
            return 0
        leaving = sorted(self.fleet.versions)[-take:]  # the last to join leave first
        self.fleet.shrink(leaving)
        self.say(f"rollout pool: {why}: engine(s) {leaving} left after their samples; {self.fleet.count} engines")
        return -take
