"""The `rlm` command line: train, validate, plan, convert and prepare."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec

# Exit codes: a rejected spec is the user's to fix; an unbuilt command is ours.
EXIT_OK = 0
EXIT_BAD_SPEC = 2
EXIT_TRAINING_STOPPED = 3
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `rlm` and `python -m rlmegatron`; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return args.command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlm",
        description="RL post-training (GRPO, PPO, DAPO) of LLMs on Megatron-Core.",
        epilog="Overrides are dotted keys with YAML values, applied on top of CONFIG: "
        "actor.optim.lr=1e-6 rollout.n=8 data.train_files=[a.parquet,b.parquet]",
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    for name, summary, command, takes_spec in (
        ("train", "train a policy with the algorithm the job spec names", train, True),
        ("validate", "check a job spec and print it with every default filled in", validate, True),
        ("plan", "show where a job spec puts each role and parallel layout", plan, True),
        ("convert", "convert checkpoints between Hugging Face and Megatron formats", convert, False),
        ("prepare", "turn raw datasets into the parquet files a job spec reads", prepare, False),
    ):
        subparser = subcommands.add_parser(name, help=summary, description=summary)
        subparser.set_defaults(command=command)
        if takes_spec:
            subparser.add_argument("config", metavar="CONFIG", help="job spec YAML file")
            subparser.add_argument(
                "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rollout.n=8"
            )
            if name == "plan":
                from rlmegatron.planner.command import add_plan_options

                add_plan_options(subparser)
        elif name == "prepare":
            from rlmegatron.data.prepare import add_prepare_options

            add_prepare_options(subparser)
        else:  # convert's own arguments arrive with the converter
            subparser.add_argument("convert_args", nargs=argparse.REMAINDER, metavar="ARGS")
    return parser


def validate(args: argparse.Namespace) -> int:
    from rlmegatron.config import dump_spec

    spec = _load_spec_or_report(args)
    if spec is None:
        return EXIT_BAD_SPEC
    sys.stdout.write(dump_spec(spec))
    return EXIT_OK


def train(args: argparse.Namespace) -> int:
    # The spec is checked before anything heavy: a bad config never starts Ray or a worker.
    spec = _load_spec_or_report(args)
    if spec is None:
        return EXIT_BAD_SPEC
    from rlmegatron.checkpoint import CheckpointManager
    from rlmegatron.config import SpecError
    from rlmegatron.controller.job import run_training
    from rlmegatron.controller.trainer import TrainingStopped

    try:
        run_training(spec)
    except SpecError as err:  # a rule only training has, checked as the run starts, before any worker
        for problem in err.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_SPEC
    except TrainingStopped as stopped:
        print(f"training stopped: {stopped}", file=sys.stderr, flush=True)
        return EXIT_TRAINING_STOPPED
    except (KeyboardInterrupt, SystemExit) as stop:
        code = stop.code if isinstance(stop, SystemExit) and isinstance(stop.code, int) else EXIT_INTERRUPTED
        latest = CheckpointManager(spec.trainer.run_dir).latest()
        print(f"interrupted; workers and engines stopped; last complete checkpoint: {latest or 'none'}",
              file=sys.stderr, flush=True)
        return code
    return EXIT_OK


def plan(args: argparse.Namespace) -> int:
    from rlmegatron.planner.command import run_plan

    spec = _load_spec_or_report(args)
    if spec is None:
        return EXIT_BAD_SPEC
    return run_plan(spec, args)


def prepare(args: argparse.Namespace) -> int:
    from rlmegatron.data.prepare import run_prepare

    return run_prepare(args)


def convert(args: argparse.Namespace) -> int:
    from rlmegatron.models.convert_cli import main as convert_main

    return convert_main(args.convert_args)


def _load_spec_or_report(args: argparse.Namespace) -> JobSpec | None:
    """The checked spec, or None after printing every problem to stderr, one per line."""
    from rlmegatron.config import SpecError, load_spec

    try:
        return load_spec(args.config, args.overrides)
    except SpecError as err:
        for problem in err.problems:
            print(problem, file=sys.stderr)
        return None
