"""GSM8K preparation: the original train/test jsonl files into verl-format parquet files."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmegatron.data.dataset import DatasetError, jsonl_rows

DATA_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")
# The same instruction verl appends, so prompts and the strict reward (#### answer) agree with it.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


@dataclass(frozen=True)
class PreparedSplit:
    split: str
    rows: int
    path: Path


def extract_final_answer(solution: str) -> str | None:
    """The number after `####` in a GSM8K solution, commas stripped; None when there is none."""
    match = _FINAL_ANSWER.search(solution)
    return None if match is None else match.group(1).replace(",", "")


def gsm8k_row(question: str, solution: str, split: str, index: int, location: str) -> dict[str, Any]:
    """One verl-format row of GSM8K."""
    answer = extract_final_answer(solution)
    if answer is None:
        raise DatasetError(f"{location}: the answer has no final '#### <number>'")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": question, "answer": solution},
    }


def read_gsm8k_jsonl(path: Path, split: str) -> list[dict[str, Any]]:
    rows = []
    for location, record in jsonl_rows(path):
        if not all(isinstance(record.get(key), str) for key in ("question", "answer")):
            raise DatasetError(f"{location}: expected an object with string 'question' and 'answer'")
        rows.append(gsm8k_row(record["question"], record["answer"], split, len(rows), location))
    return rows


def prepare_gsm8k(src: str, out: str | Path) -> list[PreparedSplit]:
    """Write out/{train,test}.parquet from src/{train,test}.jsonl (the original GSM8K release)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = Path(src)
    if not source.exists():
        if not src.startswith((".", "/", "~")) and not src.endswith(".jsonl"):
            raise DatasetError(
                f"{src}: not a local directory, and the Hugging Face hub is not reachable from here; "
                "download GSM8K's train.jsonl and test.jsonl and pass --src DIR holding them"
            )
        raise DatasetError(f"{src}: no such directory")
    if not source.is_dir():
        raise DatasetError(f"{src}: expected a directory holding train.jsonl and test.jsonl")
    missing = [f"{source / f'{split}.jsonl'}" for split in SPLITS if not (source / f"{split}.jsonl").is_file()]
    if missing:
        raise DatasetError(f"{', '.join(missing)}: missing; --src must hold train.jsonl and test.jsonl")
    # Read both splits before writing either, so a malformed file leaves no half-prepared output.
    rows_by_split = {split: read_gsm8k_jsonl(source / f"{split}.jsonl", split) for split in SPLITS}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prepared = []
    for split, rows in rows_by_split.items():
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        prepared.append(PreparedSplit(split, len(rows), path))
    return prepared
