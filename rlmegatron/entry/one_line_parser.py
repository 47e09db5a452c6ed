"""The parser of every `rlm` command line (cli.py's and convert_command.py's)."""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one line naming the argument (argparse's own words), not a usage block; its
    subcommands' parsers are of this class too (add_subparsers makes them so)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
