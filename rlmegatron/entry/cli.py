"""The `rlm` command line: train, validate, plan, convert, prepare and report."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlmegatron.entry.one_line_parser import OneLineParser
from rlmegatron.errors import UserError, user_error_in

if TYPE_CHECKING:
    from rlmegatron.prelaunch.spec_pipeline import SpecSource

# Exit codes: a user's mistake (a rejected spec, a bad data file, a broken plug-in: any UserError) is theirs to fix.
EXIT_OK = 0
EXIT_BAD_SPEC = 2
EXIT_TRAINING_STOPPED = 3
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `rlm` and `python -m rlmegatron`; returns the process exit code.

    A user's mistake (a UserError, also one raised in a Ray worker or a rank) is its message alone and exit 2;
    RLM_DEBUG=1 or --debug adds the traceback. Anything else is a bug and keeps its traceback.
    """
    args = None
    try:
        # In the try: building the parser imports the spec's modules (pydantic: most of a second), and so do the
        # commands' own modules, imported where they run; a Ctrl-C then is an interrupt like any other.
        args = _parse(argv)
        return args.command(args)
    except KeyboardInterrupt as interrupt:  # Ctrl-C before a command's own handling (`train`'s) began, or without one
        if _debug(args):
            traceback.print_exception(interrupt)
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as error:
        mistake = user_error_in(error)
        if mistake is None:
            raise
        if _debug(args):
            traceback.print_exception(error)
        print(mistake, file=sys.stderr, flush=True)
        return EXIT_BAD_SPEC


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    # Overrides may come after an option (`rlm train CONFIG --verl KEY=VALUE`), which argparse leaves over.
    args, left_over = parser.parse_known_args(argv)
    if left_over and not (hasattr(args, "overrides") and all(_is_override_form(arg) for arg in left_over)):
        parser.error("unrecognized arguments: " + " ".join(left_over))
    if left_over:
        args.overrides += left_over
    return args


def _debug(args: argparse.Namespace | None) -> bool:
    """--debug or RLM_DEBUG=1: a user's mistake shows its traceback too (only RLM_DEBUG before the parse ended)."""
    return getattr(args, "debug", False) or os.environ.get("RLM_DEBUG") == "1"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="rlm",
        description="RL post-training (GRPO, PPO, DAPO) of LLMs on Megatron-Core.",
        epilog="Overrides are dotted keys with YAML values, applied on top of CONFIG: "
        "actor.optim.lr=1e-6 rollout.n=8 data.train_files=[a.parquet,b.parquet]. With --verl they are verl's "
        "keys (actor_rollout_ref.actor.optim.lr=1e-6 ...), translated onto the spec.",
    )
    debug_help = "show the traceback of a user's mistake too (as RLM_DEBUG=1 does)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    for name, summary, command, takes_spec in (
        ("train", "train a policy with the algorithm the job spec names", train, True),
        ("validate", "check a job spec and print it with every default filled in", validate, True),
        ("plan", "show where a job spec puts each role and parallel layout", plan, True),
        ("convert", "convert checkpoints between Hugging Face and Megatron formats", convert, False),
        ("prepare", "turn raw datasets into the parquet files a job spec reads", prepare, False),
        ("report", "redraw a run's curves.png from its MLflow store", report, False),
        ("pool", "add engines to a running job's rollout pool, or take some away", pool, False),
    ):
        # convert's --help is the converter's own (its directions and their flags), not a usage line of ARGS.
        subparser = subcommands.add_parser(name, help=summary, description=summary, add_help=name != "convert")
        subparser.set_defaults(command=command)
        if name != "convert":  # convert hands every argument to the converter: `rlm --debug convert ...`
            # SUPPRESS: absent here, the top-level --debug (or its default) stands.
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        if takes_spec:
            # Both optional to argparse, so that a missing spec is one line of ours (_spec_source), not a usage block
            # that calls the overrides required.
            subparser.add_argument("config", metavar="CONFIG", nargs="?", help="job spec YAML file")
            subparser.add_argument(
                "overrides", nargs="*", default=[], metavar="KEY=VALUE", help="dotted overrides, e.g. rollout.n=8"
            )
            subparser.add_argument(
                "--verl", action="store_true",
                help="the overrides are verl's keys (actor_rollout_ref.actor.optim.lr=1e-6 ...): each is mapped onto "
                "the spec, accepted with a note, or rejected with rlmegatron's equivalent",
            )
            if name == "train":
                subparser.add_argument("--verbose", action="store_true",
                                       help="print every step's full metric table and, on a log file, the progress "
                                       "of its phases (else one line per step; trainer.log_freq sets a table every "
                                       "N steps)")
            if name == "plan":
                from rlmegatron.planner.command import add_plan_options

                add_plan_options(subparser)
        elif name == "prepare":
            from rlmegatron.data.prepare import add_prepare_options

            add_prepare_options(subparser)
        elif name == "report":
            subparser.add_argument("run_dir", metavar="RUN_DIR", help="the run's trainer.run_dir")
        elif name == "pool":
            subparser.add_argument("action", choices=("add", "remove"),
                                   help="add engines to the rollout pool, or remove some")
            subparser.add_argument("count", type=int, metavar="COUNT", help="engines to add or take away")
            subparser.add_argument("run_dir", metavar="RUN_DIR", help="the running job's trainer.run_dir")
        else:  # convert's own arguments arrive with the converter
            subparser.add_argument("-h", "--help", action=_ConvertHelp)
            subparser.add_argument("convert_args", nargs=argparse.REMAINDER, metavar="ARGS",
                                   help="a direction and its flags (rlm convert --help)")
    return parser


class _ConvertHelp(argparse.Action):
    """`rlm convert --help`: the converter's help, which names its directions and their flags."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the converter's help")

    def __call__(self, parser, namespace, values, option_string=None):
        # lazy: a command's module, imported only once a command is parsed (test_cli's import check)
        from rlmegatron.entry.convert_command import build_parser as converter_parser

        converter_parser().print_help()
        parser.exit()


# Each command runs the spec pipeline (rlmegatron/prelaunch/spec_pipeline.py) once, with its stages: validate every stage but
# data (what is not there yet is only noted), plan the stages of the spec alone, train all of them (in run_training).
def validate(args: argparse.Namespace) -> int:
    from rlmegatron.config import dump_spec
    from rlmegatron.prelaunch.spec_pipeline import VALIDATE_STAGES, check_job

    sys.stdout.write(dump_spec(check_job(_spec_source(args), VALIDATE_STAGES).spec))
    return EXIT_OK


def train(args: argparse.Namespace) -> int:
    source = _spec_source(args)  # before the job runner's imports (torch, ...): a command-line mistake is found at once
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.driver.trainer import TrainingStopped
    from rlmegatron.tracking.progress import ProgressBar  # lazy: in main's try

    # Every stage of the spec pipeline, before Ray or any worker starts.
    job = check_training(source)
    if args.verbose:
        job.spec.trainer.log_freq = 1
        ProgressBar.log_lines = True
    # A user's mistake found on the way (a SpecError, a CheckpointError, a reward plug-in that does not load, a full
    # disk, another run in the run directory, ...) is a UserError, which `main` reports in one line with exit 2.
    try:
        run_training(job)
    except TrainingStopped as stopped:
        _stop_ray_log_forwarding()
        print(f"training stopped: {stopped}", file=sys.stderr, flush=True)
        _quiet_ray_finalizers()
        return EXIT_TRAINING_STOPPED
    except (KeyboardInterrupt, SystemExit) as stop:
        code = stop.code if isinstance(stop, SystemExit) and isinstance(stop.code, int) else EXIT_INTERRUPTED
        from rlmegatron.checkpoint import CheckpointManager  # lazy: in main's try

        latest = CheckpointManager(job.spec.trainer.run_dir).latest()
        _stop_ray_log_forwarding()
        print(f"interrupted; workers and engines stopped; last complete checkpoint: {latest or 'none'}",
              file=sys.stderr, flush=True)
        _quiet_ray_finalizers()
        return code
    return EXIT_OK


def _stop_ray_log_forwarding() -> None:
    """Before a stopped run's last line: Ray's log thread forwards what the cluster's raylets say (a lost node's
    clean-up, its state dump) until the process exits, after the line that says why the run stopped. Not
    ray.shutdown(): with the cluster going away (a cancelled Slurm job stops its Ray beside this driver) it waits for
    it past Slurm's KillWait. The switch is the one Ray's own debugger (ray/util/rpdb.py) turns forwarding off with."""
    worker = sys.modules.get("ray._private.worker")
    if worker is not None and hasattr(worker, "_worker_logs_enabled"):
        worker._worker_logs_enabled = False


def _quiet_ray_finalizers() -> None:
    """Once a stopped run's line is said: Ray's handles finalised as this process exits, with their cluster gone
    (a cancelled Slurm job stops its Ray beside this driver), print tracebacks that only say it again."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not type(unraisable.object).__module__.startswith("ray") and not getattr(
                unraisable.object, "__module__", "").startswith("ray"):
            previous(unraisable)

    sys.unraisablehook = hook


def plan(args: argparse.Namespace) -> int:
    from rlmegatron.config.loader import read_spec_file
    from rlmegatron.planner.command import run_plan
    from rlmegatron.planner.search import freed
    from rlmegatron.prelaunch.spec_pipeline import SPEC_STAGES, check_job

    source = _spec_source(args)
    if args.search and source.config is not None:  # the layout it chooses is checked as chosen, not as the YAML has it
        source = dataclasses.replace(source, overrides=(*source.overrides, *freed(read_spec_file(source.config),
                                                                                  source.overrides)))
    # The spec's own stages: a plan reads the spec and the model's config.json, never the data or the plug-ins.
    return run_plan(check_job(source, SPEC_STAGES).spec, args)


def prepare(args: argparse.Namespace) -> int:
    from rlmegatron.data.prepare import run_prepare

    return run_prepare(args)


def report(args: argparse.Namespace) -> int:
    from rlmegatron.tracking.curves import report as report_curves  # lazy: in main's try

    print(report_curves(args.run_dir)[1], flush=True)
    return EXIT_OK


def pool(args: argparse.Namespace) -> int:
    if args.count < 1:
        print(f"rlm pool {args.action}: COUNT={args.count}: must be at least 1", file=sys.stderr, flush=True)
        return EXIT_BAD_SPEC
    from rlmegatron.driver.pool_control import request as pool_request  # lazy: in main's try

    path = pool_request(args.run_dir, args.action, args.count)
    print(f"asked the run in {args.run_dir} to {args.action} {args.count} rollout engine(s) at its next step "
          f"({path.name})", flush=True)
    return EXIT_OK


def convert(args: argparse.Namespace) -> int:
    from rlmegatron.entry.convert_command import main as convert_main  # lazy: in main's try

    return convert_main(args.convert_args)


def _spec_source(args: argparse.Namespace) -> SpecSource:
    """The spec file and overrides the command was given. With --verl the overrides are verl's keys, and verl's
    command line needs no base spec (verl has none)."""
    from rlmegatron.prelaunch.spec_pipeline import SpecSource

    command = f"rlm {args.command.__name__}"
    config, overrides = args.config, list(args.overrides)
    if config is not None and _is_override(config):
        if not args.verl:
            raise UserError(f"{command}: {config} is an override, and the job spec comes first: {command} CONFIG "
                            f"[KEY=VALUE ...], e.g. {command} configs/quickstart.yaml {config}")
        config, overrides = None, [config, *overrides]
    elif config is None and not args.verl:
        raise UserError(f"{command}: which job? Give its spec: {command} CONFIG [KEY=VALUE ...], e.g. {command} "
                        "configs/quickstart.yaml")
    return SpecSource(config, tuple(overrides), verl=args.verl)


def _is_override(argument: str) -> bool:
    """`key=value` or `~key`, and no file of that name: what argparse took for CONFIG when no spec was given."""
    return _is_override_form(argument) and not os.path.exists(argument)


def _is_override_form(argument: str) -> bool:
    """`key=value` (set a key) or `~key` (delete it)."""
    return "=" in argument or argument.startswith("~")
