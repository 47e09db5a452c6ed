"""`rlm train ARGS` as the CLI runs it (its exit codes and its last words), with the trainer ranks and the engine hosts
in this process instead of Ray actors: for tests whose subject is the CLI's stop, not Ray's start-up (seconds)."""
import functools
import sys

from rlmegatron.entry import cli
from rlmegatron.driver import job

# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    job.check_training = functools.partial(job.check_training, in_process=True)  # cli.train imports it when it runs
    sys.exit(cli.main(["train", *sys.argv[1:]]))
