"""`rlm prepare DATASET --src --out`: the command-line front of the dataset preparers."""
from __future__ import annotations

import argparse
import sys

from rlmegatron.data.dataset import DatasetError
from rlmegatron.data.gsm8k import prepare_gsm8k

PREPARERS = {"gsm8k": prepare_gsm8k}
EXIT_OK = 0
EXIT_BAD_INPUT = 2


def add_prepare_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=sorted(PREPARERS), help="dataset to prepare")
    parser.add_argument("--src", required=True, metavar="PATH_OR_HUB_ID",
                        help="directory holding the original train.jsonl and test.jsonl")
    parser.add_argument("--out", required=True, metavar="DIR", help="where train.parquet and test.parquet go")


def run_prepare(args: argparse.Namespace) -> int:
    try:
        prepared = PREPARERS[args.dataset](args.src, args.out)
    except DatasetError as err:
        print(f"rlm prepare {args.dataset}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for split in prepared:
        print(f"{split.split}: {split.rows} rows -> {split.path}")
    return EXIT_OK
