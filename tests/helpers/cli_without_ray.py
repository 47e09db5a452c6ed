"""`rlm train` as a user runs it (its exit code, its messages), with the one rank in this process instead of on Ray."""
import functools
import sys

from rlmegatron.entry.cli import main
from rlmegatron.driver import job

# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    job.check_training = functools.partial(job.check_training, in_process=True)
    sys.exit(main(sys.argv[1:]))
