"""GSM8K preparation: answers after ####, the verl instruction, counts, and errors that name file:line."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlmegatron.entry.cli import main
from rlmegatron.data import DatasetError
from rlmegatron.data.gsm8k import INSTRUCTION, extract_final_answer, prepare_gsm8k

# The first 48 train and 16 test rows of the original release, shipped for the README's commands and these tests.
REAL_GSM8K = Path(__file__).resolve().parents[2] / "configs" / "gsm8k_sample"


def write_split(directory, split, records):
    (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def gsm8k_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_split(src, "train", [{"question": "Q1?", "answer": "a\n#### 1,234"}, {"question": "Q2?", "answer": "#### -7"}])
    write_split(src, "test", [{"question": "Q3?", "answer": "b <<2*3=6>>6\n#### 6"}])
    return src


@pytest.mark.parametrize("solution, answer", [
    ("so 9*2=18\n#### 18", "18"), ("#### 1,000", "1000"), ("#### -3.5", "-3.5"), ("no marker 42", None),
])
def test_final_answer_extraction(solution, answer):
    assert extract_final_answer(solution) == answer


def test_prepare_writes_verl_rows(gsm8k_dir, tmp_path):
    prepared = prepare_gsm8k(str(gsm8k_dir), tmp_path / "out")
    assert [(p.split, p.rows) for p in prepared] == [("train", 2), ("test", 1)]
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert rows[0]["prompt"] == [{"role": "user", "content": f"Q1? {INSTRUCTION}"}]
    assert rows[0]["reward_model"]["ground_truth"] == "1234"
    assert rows[1]["extra_info"]["index"] == 1 and rows[0]["data_source"] == "openai/gsm8k"
    assert INSTRUCTION == "Let's think step by step and output the final answer after \"####\"."


def test_malformed_line_and_missing_answer_name_file_and_line(gsm8k_dir, tmp_path):
    with (gsm8k_dir / "test.jsonl").open("a") as f:
        f.write('{"question": "Q4?", "answer": "no final number"}\n')
    with pytest.raises(DatasetError, match=r"test.jsonl:2: the answer has no final '#### <number>'"):
        prepare_gsm8k(str(gsm8k_dir), tmp_path / "out")
    (gsm8k_dir / "test.jsonl").write_text('{"question": "Q"}\n')
    with pytest.raises(DatasetError, match=r"test.jsonl:1: expected an object with string 'question' and 'answer'"):
        prepare_gsm8k(str(gsm8k_dir), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_missing_files_and_hub_ids_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="train.jsonl, .*test.jsonl: missing"):
        prepare_gsm8k(str(tmp_path), tmp_path / "out")
    with pytest.raises(DatasetError, match="hub is not reachable from here.*pass --src DIR"):
        prepare_gsm8k("openai/gsm8k", tmp_path / "out")


def test_rlm_prepare_gsm8k_on_the_real_files(tmp_path, capsys):
    assert main(["prepare", "gsm8k", "--src", str(REAL_GSM8K), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"train: 48 rows -> {tmp_path / 'train.parquet'}" in out
    assert "test: 16 rows" in out
    assert pq.read_table(tmp_path / "test.parquet").to_pylist()[0]["reward_model"]["ground_truth"] == "18"


def test_rlm_prepare_reports_errors_on_stderr(tmp_path, capsys):
    assert main(["prepare", "gsm8k", "--src", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "rlm prepare gsm8k: " in capsys.readouterr().err
