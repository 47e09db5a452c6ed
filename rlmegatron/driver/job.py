"""`rlm train`: start the ranks (local processes, or Ray actors), build data, reward and tracking, run the fit loop,
print a summary."""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlmegatron.supervision import reaper
from rlmegatron.agent.tools import declaring_tools
from rlmegatron.checkpoint import CheckpointManager
from rlmegatron.config import JobSpec
from rlmegatron.transport.placement import (PlacementUnsatisfiable, create_pools, device_resource, remove_pools,
                                            replace_lost_nodes)
from rlmegatron.transport.shared_files import SharedFiles
from rlmegatron.driver.trainer_client import TrainerClient
from rlmegatron.transport.rank_processes import RankProcesses
from rlmegatron.rank.policy_rank import PolicyRank
from rlmegatron.driver.role_settings import rollout_settings, trainer_rank_settings
from rlmegatron.rollout.engine import INITIAL_VERSION
from rlmegatron.driver.engine_fleet import EngineFleet, InTrainerRanks, OnRolloutPool
from rlmegatron.driver.router import start_router
from rlmegatron.driver.trainer import RankLost, Trainer
from rlmegatron.transport.worker_group import LocalWorkerGroup, RayWorkerGroup
from rlmegatron.errors import DiskFull, disk_full_in
from rlmegatron.rewards import build_reward_manager
from rlmegatron.rewards.model import model_reward_manager
from rlmegatron.checkpoint.run_dir import no_space_left, refuse_if_busy, run_dir_lock
from rlmegatron.prelaunch.spec_pipeline import TRAIN_STAGES, CheckedJob, SpecSource, check_job
from rlmegatron.transport.fork_server import environment, fork_server, fork_server_ended_on_failure
from rlmegatron.tracking import Tracker, resolve_tracking_uri
from rlmegatron.tracking.curves import CURVES_FILE, draw_curves
from rlmegatron.tracking.curves import report as report_curves
from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN
from rlmegatron.tracking.tensorboard_events import LOG_DIR as TENSORBOARD_DIR


@dataclass
class JobReport:
    steps: int
    """The last step trained (a job found already complete: its checkpoint's step)."""
    resumed_from: int
    """The checkpoint's step the run started from (0: a fresh start): it trained resumed_from+1 .. steps."""
    seconds: float
    """From the first step's start to the export's end, restarts of the ranks included."""
    reward_first: Optional[float]
    reward_last: Optional[float]
    tracking: str
    checkpoint: Optional[str]
    exported_hf: Optional[str]
    history: dict[str, list[tuple[int, float]]]
    """Every logged metric as (step, value) pairs."""
    curves: Optional[str] = None
    """The run's curves.png (tracking/curves.py); None when the run trained nothing."""
    restarts: int = 0
    """How many times the trainer ranks were restarted within the run (trainer.max_restarts)."""


def exit_on_sigterm() -> None:
    """SIGTERM (scancel, kill) takes Ctrl-C's way out, through run_training's cleanup of the rank processes,
    engine servers and Ray. Called again after ray.init, whose core worker installs a handler that aborts."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def start_ray(spec: JobSpec) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local one just big enough for the placement."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    placement = spec.placement
    ranks = placement.trainer_world_size + (
        0 if placement.mode == "colocate" else placement.rollout_pool_size or 0)
    gpus = ranks if placement.device == "cuda" else 0
    # A CPU rank is one CPU bundle: ask for exactly that many, whatever the machine has.
    # The ranks import what the driver can: this directory (plug-ins named by relative path) and its PYTHONPATH.
    # They get it by inheritance (the local cluster's processes, and their workers, start with this environment), not
    # as a job runtime_env: with one, Ray leaves the workers it prestarts idle and starts new ones for the ranks, which
    # then wait for them and share the cores with their start (benchmarks/RESULTS.md, "Start-up").
    python_path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    # This session ends with this process, even one killed outright: Ray's agents would outlive it by minutes.
    mark = reaper.mark_started_processes()
    with environment(PYTHONPATH=python_path):
        context = ray.init(num_cpus=ranks, num_gpus=gpus, include_dashboard=False, logging_level="WARNING")
    reaper.start(mark, context.address_info["session_dir"])


def check_training(source: SpecSource, in_process: bool = False) -> CheckedJob:
    """The job `source` names, through every stage of the spec pipeline (`rlm train`'s one call of it). Its ranks
    start as placement.transport says, or (`in_process`: tests, the GPU harness; the job's transport is None) as one
    rank in this process."""

    def get_ready(job: CheckedJob) -> None:
        # Once the spec itself is right, before preflight reads its files: a busy run directory is found at once, and
        # the ranks' imports (torch, Megatron-Core, transformers, the rank's modules: seconds of CPU) start in the
        # fork server beside preflight and the data; it runs nothing of the job, and no rank starts before they pass.
        refuse_if_busy(job.spec.trainer.run_dir)
        if not in_process and job.transport == "processes":
            fork_server([PolicyRank.__module__], job.spec.placement.device)

    with fork_server_ended_on_failure():  # a job its checks refuse leaves nothing running
        job = check_job(source, TRAIN_STAGES, before_preflight=get_ready)
    if in_process:
        job.transport = None
    return job


def run_training(job: CheckedJob) -> JobReport:
    """The checked job (check_training): start its parts, run the fit loop, stop every part however it ends."""
    spec = job.spec
    tokenizer = declaring_tools(job.tokenizer, [(t.plugin, t.config) for t in spec.rollout.multi_turn.tools])
    # Before anything in run_dir is read or written: a second run there would resume from this one's checkpoints and
    # take over its MLflow run.
    with run_dir_lock(spec.trainer.run_dir), disk_full_stops_the_run(spec.trainer.run_dir):
        return _run_locked(job, job.transport, tokenizer)


def _run_locked(job: CheckedJob, launch: Optional[str], tokenizer) -> JobReport:
    spec, loader, val_set, total_steps = job.spec, job.loader, job.val_set, job.total_steps
    reward_manager = build_reward_manager(spec.reward, spec.data.max_response_length)
    checkpoints = CheckpointManager(spec.trainer.run_dir, spec.trainer.max_ckpt_to_keep)
    newest = checkpoints.plan_resume(spec.trainer.resume)  # before anything starts: it may refuse the run
    if newest is not None and newest.step >= total_steps:
        return _already_complete(newest, total_steps)
    # MLflow's import and store take seconds: the tracker opens in a thread while Ray and the ranks start.
    opener = ThreadPoolExecutor(1, thread_name_prefix="tracking")
    opening = opener.submit(Tracker.from_spec, spec)
    opener.shutdown(wait=False)  # its thread ends once the tracker is open
    pools = ranks = engines = router = None
    status = "FAILED"
    exit_on_sigterm()
    try:
        if launch == "ray":
            start_ray(spec)
            exit_on_sigterm()
            # Ray's nodes may run in other directories, on other machines: the members move into the driver's files.
            pools = create_pools(spec.placement, SharedFiles.write(spec.trainer.run_dir))
        # After Ray: the router listens on the driver's node address, which Ray knows.
        if spec.rollout.sglang.router and not spec.rollout.sglang.router_url:
            spec, router = start_router(spec)
        restarts = 0
        while True:
            ranks = _start_ranks(spec, launch, pools, total_steps)
            scoring = reward_manager
            if spec.reward.model.path is not None:  # the ranks hold the reward model
                scoring = model_reward_manager(spec.reward, reward_manager, ranks.score_sequences, tokenizer)
            if spec.placement.mode == "colocate":
                sleeps = not (spec.rollout.engine == "local" and spec.placement.device == "cpu")
                # The ranks pushed the initial weights into their engines as they built them.
                engines = EngineFleet(InTrainerRanks(ranks, sleeps), held=INITIAL_VERSION)
            else:
                engines = EngineFleet(OnRolloutPool(rollout_settings(spec), ranks, pools.rollout if pools else None))
            trainer = Trainer(spec, ranks, engines, tokenizer, loader, val_set, scoring, opening.result(),
                              checkpoints)
            if not restarts:  # the report is the run's, not its last attempt's: a restart resumes the run
                first_attempt, fitting_since = trainer, time.perf_counter()
            try:
                result = trainer.fit()
                seconds = time.perf_counter() - fitting_since
                break
            except RankLost as lost:
                if restarts == spec.trainer.max_restarts:
                    if restarts:
                        raise RankLost(f"{lost} (the ranks were restarted {restarts} time(s) already: "
                                       f"trainer.max_restarts={restarts})") from None
                    raise
                restarts += 1
                # The survivors stop cleanly and everything the ranks held goes with them; the tracker, the router,
                # Ray's pools and the data stay. The run resumes as trainer.resume=auto would.
                _stop_each([engines.shutdown, ranks.shutdown])
                engines = ranks = None
                if pools is not None:  # a node that left: its bundles placed again, on a spare node or itself back
                    try:
                        pools = replace_lost_nodes(pools, lambda line: print(line, file=sys.stderr, flush=True))
                    except PlacementUnsatisfiable as unplaced:  # a fault of the cluster's, not the user's mistake
                        raise RankLost(f"{lost}; the ranks cannot start again: {unplaced}") from None
                newest = checkpoints.plan_resume("auto")
                print(f"{lost}. Restarting the trainer ranks ({restarts} of trainer.max_restarts="
                      f"{spec.trainer.max_restarts}) from {newest.path if newest else 'the start (no checkpoint yet)'}",
                      file=sys.stderr, flush=True)
        status = "FINISHED"
    except BaseException:
        # What stopped the run is what gets reported: a part that fails to stop too (the tracker on a full disk) is
        # passed over, and every other part still stops.
        _stop(engines, ranks, router, pools, reward_manager, opening, status)
        raise
    _stop(engines, ranks, router, pools, reward_manager, opening, status, reraise=True)
    tracker = opening.result()
    rewards = tracker.series(REWARD_SCORE_MEAN)
    report = JobReport(
        steps=result.steps,
        resumed_from=first_attempt.resumed_from,
        seconds=seconds,
        reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
        tracking=_tracking_location(spec, tracker),
        checkpoint=result.last_checkpoint,
        exported_hf=result.exported_hf,
        history=tracker.history,
        curves=str(_draw_curves(spec, tracker)),
        restarts=restarts,
    )
    print(tracker.summary(), flush=True)
    print(format_report(report), flush=True)
    return report


def _start_ranks(spec: JobSpec, launch: Optional[str], pools, total_steps: int) -> TrainerClient:
    settings = trainer_rank_settings(spec, total_steps)
    if launch == "ray":
        group = RayWorkerGroup(pools.trainer, PolicyRank, settings,
                               collective_timeout_s=spec.trainer.collective_timeout_s)
        rollout = "" if pools.colocated else \
            f"; rollout pool: {pools.rollout.describe(device_resource(spec.placement.device))}"
        print(f"trainer: {pools.trainer.describe()}; rendezvous {group.rendezvous}{rollout}", flush=True)
        return TrainerClient(group)
    if launch == "processes":
        # Returns once the fork server (started by run_training) has forked them: they build while the driver goes
        # on, up to its first call to them.
        return TrainerClient(RankProcesses(spec.placement.device, spec.placement.trainer_world_size, PolicyRank, settings,
                                         collective_timeout_s=spec.trainer.collective_timeout_s))
    return TrainerClient(LocalWorkerGroup(spec.placement.device, PolicyRank, settings))


def _stop_each(steps) -> list[Exception]:
    """Runs every step whatever the others do; returns their failures."""
    failures = []
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - the next part stops all the same
            failures.append(error)
    return failures


def _draw_curves(spec: JobSpec, tracker) -> Path:
    """curves.png beside the checkpoints: from the MLflow store, which also holds the steps of the attempts before a
    resume, as `rlm report` draws it; without a store, from what this run logged."""
    run_dir = Path(spec.trainer.run_dir)
    if "mlflow" in spec.tracking.backends:
        return report_curves(run_dir)[0]
    path = run_dir / CURVES_FILE
    draw_curves(tracker.history, path, f"{spec.trainer.experiment_name} (the steps this run trained)")
    return path


def _stop(engines, ranks, router, pools, reward_manager, opening: Future, status: str,
          reraise: bool = False) -> None:
    """Every part of the run stops, each whatever the others do: the ranks and servers above all, whose processes
    would otherwise outlive the driver or keep it from exiting. The first failure is raised after all of them if
    `reraise` (the run itself went well), else dropped.

    A run that failed or was stopped (SIGTERM, Ctrl-C) gives the parts that talk to the ranks, the servers and Ray
    INTERRUPTED_STOP_S in all: a cancelled Slurm job stops its nodes' Ray as it stops this driver, whose calls to
    them can then wait a minute each, past the moment Slurm kills what is left (Slurm's KillWait), and its
    last line would never be said. What has not stopped by then ends with this process (the rank processes'
    lifelines, Ray's actors with their driver)."""
    deadline = time.monotonic() + INTERRUPTED_STOP_S

    def bounded(step):
        return step if reraise else lambda: _within(max(0.1, deadline - time.monotonic()), step)

    steps = [bounded(part.shutdown) for part in (engines, ranks) if part is not None]
    steps += [bounded(router.stop)] if router is not None else []
    steps += [bounded(lambda: _within(POOL_REMOVAL_S, lambda: remove_pools(pools)))] if pools is not None else []
    steps += [reward_manager.close, lambda: _finish_tracking(opening, status)]
    failures = _stop_each(steps)
    if failures and reraise:
        raise failures[0]


POOL_REMOVAL_S = 5.0
"""The placement groups' removal, however the run ended: a GCS that is gone makes the call wait a minute, and Ray
removes a job's groups itself when its driver exits."""
INTERRUPTED_STOP_S = 6.0


def _within(seconds: float, step) -> None:
    """`step` on a daemon thread, waited for `seconds` at most (what is still running then goes with the process)."""
    done, failures = threading.Event(), []

    def run() -> None:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - raised in the caller's thread
            failures.append(error)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="remove-pools").start()
    if done.wait(seconds) and failures:
        raise failures[0]


def _finish_tracking(opening: Future, status: str) -> None:
    try:
        tracker = opening.result()
    except Exception:  # noqa: BLE001 - raised where the loop took the tracker, or the run failed before that
        return
    tracker.finish(status)


@contextmanager
def disk_full_stops_the_run(run_dir: str) -> Iterator[None]:
    """A full disk, wherever the run found it (a checkpoint, the tracker's store, the export), is one line naming the
    run directory and the last complete checkpoint, exit 2: the user's to fix (free space, move the run)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch's CheckpointException, raised by a save on a full disk, is one
        reason = disk_full_in(error) or (os.strerror(errno.ENOSPC) if no_space_left(run_dir) else None)
        if reason is None:
            raise
        latest = CheckpointManager(run_dir).latest()
        raise DiskFull(f"trainer.run_dir={run_dir}: the disk is full ({reason}); the run stopped and its ranks with "
                       f"it. The last complete checkpoint is {latest or 'none'}: free space and run again to resume "
                       "from it, or move the run directory to a disk with room") from error


def _already_complete(checkpoint, planned: int) -> JobReport:
    """Rerunning a finished job trains nothing: say so, and how to train on or start over."""
    print(f"already complete: {checkpoint.path} is at step {checkpoint.step}, and this job trains {planned} steps; "
          f"nothing to do. To train on, raise trainer.total_steps above {checkpoint.step}; to start over, give a new "
          f"trainer.run_dir", flush=True)
    return JobReport(steps=checkpoint.step, resumed_from=checkpoint.step, seconds=0.0, reward_first=None,
                     reward_last=None, tracking="not opened", checkpoint=str(checkpoint.path), exported_hf=None,
                     history={})


def _tracking_location(spec: JobSpec, tracker) -> str:
    """Where each backend that keeps the run put it."""
    backends, run_dir = spec.tracking.backends, Path(spec.trainer.run_dir)
    places = []
    if "mlflow" in backends:
        places.append(f"mlflow {resolve_tracking_uri(tracker.setup)} (experiment {spec.tracking.project_name}, "
                      f"run {spec.trainer.experiment_name})")
    if "wandb" in backends:
        places.append(f"wandb {run_dir / 'wandb'} (project {spec.tracking.project_name})")
    if "tensorboard" in backends:
        places.append(f"tensorboard --logdir {run_dir / TENSORBOARD_DIR}")
    return "; ".join(places) or "console only (add mlflow to tracking.backends for a store)"


def format_report(report: JobReport) -> str:
    first, count = report.resumed_from + 1, report.steps - report.resumed_from
    steps = f"step {first}" if count == 1 else f"steps {first}-{report.steps}"
    resumed = f", resumed from step {report.resumed_from}" if report.resumed_from else ""
    resumed += f", the ranks restarted {report.restarts} time(s)" if report.restarts else ""
    rewards = report.history.get(REWARD_SCORE_MEAN)
    reward = ("n/a" if not rewards
              else f"{rewards[0][1]:.3f} (step {rewards[0][0]}) -> {rewards[-1][1]:.3f} (step {rewards[-1][0]})")
    # The held-out score before training (step 0, trainer.val_before_train) and after: what the run taught.
    validation = [f"validation: {key} " + " -> ".join(map(_score_at, points[:1] if len(points) == 1
                                                          else [points[0], points[-1]]))
                  for key, points in sorted(report.history.items())
                  if key.startswith("val/") and key.endswith("/score/mean") and points]
    return "\n".join([
        f"trained {steps} ({count} step{'s' * (count != 1)}{resumed}) in {report.seconds:.1f} s; "
        f"critic/score/mean {reward}",
        *validation,
        f"tracking:   {report.tracking}",
        f"checkpoint: {report.checkpoint or 'none saved (trainer.save_freq)'}",
        f"hf export:  {report.exported_hf}",
        *([f"curves:     {report.curves}"] if report.curves else []),
    ])


def _score_at(point: tuple[int, float]) -> str:
    step, value = point
    return f"{value:.3f} (step {step}{', before training' if step == 0 else ''})"
