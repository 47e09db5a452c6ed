"""`rlm train`: connect to Ray, place the ranks, build data, reward and tracking, run the fit loop, print a summary."""
from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec


@dataclass
class JobReport:
    steps: int
    seconds: float
    reward_first: Optional[float]
    reward_last: Optional[float]
    tracking: str
    checkpoint: Optional[str]
    exported_hf: Optional[str]
    history: dict[str, list[tuple[int, float]]]
    """Every logged metric as (step, value) pairs."""


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
    python_path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=ranks, num_gpus=gpus, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path}})


def run_training(spec: JobSpec, use_ray: bool = True) -> JobReport:
    from rlmegatron.config import SpecError
    from rlmegatron.config.checks import training_problems

    if problems := training_problems(spec):  # before anything heavy is imported or started
        raise SpecError(problems)
    from transformers import AutoTokenizer

    from rlmegatron.checkpoint import CheckpointManager
    from rlmegatron.controller.engines import ColocatedEngines, DisaggregatedEngines, start_router
    from rlmegatron.controller.placement import create_pools, remove_pools
    from rlmegatron.controller.policy_rank import PolicyRank
    from rlmegatron.controller.trainer import Trainer
    from rlmegatron.controller.worker_group import LocalWorkerGroup, RayWorkerGroup
    from rlmegatron.data import PromptDataLoader, build_dataset
    from rlmegatron.rewards import build_reward_manager
    from rlmegatron.tracking import Tracker
    from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN

    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_path)
    train_set = build_dataset(spec.data.train_files, tokenizer, spec.data)
    val_set = build_dataset(spec.data.val_files, tokenizer, spec.data) if spec.data.val_files else None
    loader = PromptDataLoader(train_set, spec.data.train_batch_size, shuffle=spec.data.shuffle, seed=spec.data.seed)
    tracker = Tracker.from_spec(spec)
    reward_manager = build_reward_manager(spec.reward, spec.data.max_response_length)
    pools = workers = engines = router = None
    status = "FAILED"
    exit_on_sigterm()
    try:
        if spec.rollout.sglang.router and not spec.rollout.sglang.router_url:
            spec, router = start_router(spec)
        if use_ray:
            start_ray(spec)
            exit_on_sigterm()
            pools = create_pools(spec.placement)
            workers = RayWorkerGroup(pools.trainer, PolicyRank, spec)
        else:
            workers = LocalWorkerGroup(spec.placement.device, PolicyRank, spec)
        if spec.placement.mode == "colocate":
            engines = ColocatedEngines(workers)
        else:
            engines = DisaggregatedEngines(spec, workers, pools.rollout if pools else None)
        trainer = Trainer(spec, workers, engines, tokenizer, loader, val_set, reward_manager, tracker,
                          CheckpointManager(spec.trainer.run_dir, spec.trainer.max_ckpt_to_keep))
        result = trainer.fit()
        status = "FINISHED"
    finally:
        tracker.finish(status)
        reward_manager.close()
        for part in (engines, workers):
            if part is not None:
                part.shutdown()
        if router is not None:
            router.stop()
        if pools is not None:
            remove_pools(pools)
    rewards = tracker.series(REWARD_SCORE_MEAN)
    report = JobReport(
        steps=result.steps,
        seconds=result.seconds,
        reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
        tracking=_tracking_location(spec, tracker),
        checkpoint=result.last_checkpoint,
        exported_hf=result.exported_hf,
        history=tracker.history,
    )
    print(tracker.summary(), flush=True)
    print(format_report(report), flush=True)
    return report


def _tracking_location(spec: JobSpec, tracker) -> str:
    from rlmegatron.tracking import resolve_tracking_uri

    if "mlflow" not in spec.tracking.backends:
        return "console only (add mlflow to tracking.backends for a store)"
    return f"mlflow {resolve_tracking_uri(tracker.setup)} (experiment {spec.tracking.project_name}, " \
           f"run {spec.trainer.experiment_name})"


def format_report(report: JobReport) -> str:
    reward = ("n/a" if report.reward_first is None
              else f"{report.reward_first:.3f} (step 1) -> {report.reward_last:.3f} (step {report.steps})")
    return "\n".join([
        f"trained {report.steps} steps in {report.seconds:.1f} s; critic/score/mean {reward}",
        f"tracking:   {report.tracking}",
        f"checkpoint: {report.checkpoint or 'none saved (trainer.save_freq)'}",
        f"hf export:  {report.exported_hf}",
    ])
