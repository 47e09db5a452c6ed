"""`python -m rlmegatron`: the same entry point as the `rlm` command."""
import sys

from rlmegatron.entry.cli import main

# Guarded: spawn-started helpers (e.g. dist_checkpointing's async writer) re-import __main__.
if __name__ == "__main__":
    sys.exit(main())
