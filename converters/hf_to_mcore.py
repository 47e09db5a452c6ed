"""Thin front-end: `rlm convert hf-to-mcore` (logic in rlmegatron.entry.convert_command)."""
import sys

from rlmegatron.entry.convert_command import main

if __name__ == "__main__":  # dist_checkpointing's writer spawns a Manager that re-imports __main__
    sys.exit(main(["hf-to-mcore", *sys.argv[1:]]))
