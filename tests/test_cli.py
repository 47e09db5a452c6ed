"""The `rlm` command line: validate's exit codes and output, help, and the not-yet-built commands."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlmegatron.cli import EXIT_BAD_SPEC, main

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "configs/quickstart.yaml"
SUBCOMMANDS = ("train", "validate", "plan", "convert", "prepare")


def rlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmegatron", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_validate_prints_the_resolved_spec_and_exits_0():
    result = rlm("validate", QUICKSTART, "rollout.n=4")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["rollout"]["n"] == 4  # the override
    assert resolved["rollout"]["engine"] == "local"  # the YAML
    assert resolved["actor"]["optim"]["adam_beta2"] == 0.999  # a default
    assert resolved["rollout"]["max_new_tokens"] == resolved["data"]["max_response_length"]


def test_validate_prints_one_problem_per_line_and_exits_2():
    result = rlm("validate", QUICKSTART, "actor.optim.lrr=1e-6", "actor.megatron.tensor_model_parallel_size=3")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "command line: actor.optim.lrr=1.0e-06: unknown key 'lrr' in actor.optim; did you mean 'lr'?",
        "command line: actor.megatron.tensor_model_parallel_size=3: does not divide the 2 trainer CPU ranks "
        "(placement.nnodes × placement.gpus_per_node); use 1 or 2",
        "command line: actor.megatron.tensor_model_parallel_size=3: does not divide the model's 4 attention heads; "
        "use 1 or 2",
    ]


def test_help_lists_the_five_subcommands():
    result = rlm("--help")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ")]
    assert listed == list(SUBCOMMANDS)


def test_type_error_in_a_spec_file_is_formatted_not_a_traceback(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: {path: configs/models/tiny-qwen3}\ndata: {train_files: [a.parquet]}\nrollout: {n: many}\n")
    assert main(["validate", str(spec)]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err == f"{spec}: rollout.n=many: should be a valid integer\n"


def test_missing_config_file_exits_2(capsys):
    assert main(["validate", "no/such.yaml"]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err == "no/such.yaml: cannot read the spec: No such file or directory\n"


def test_convert_rejects_an_unknown_direction(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "hf-to-megatron", "ckpt/"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'hf-to-megatron'" in capsys.readouterr().err


def test_cli_module_imports_no_pydantic_until_a_command_runs():
    probe = "import sys, rlmegatron.cli; print('pydantic' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_train_names_a_model_path_that_is_not_a_local_directory(monkeypatch, capsys):
    # model.hf_config lets validate and plan read a hub model's architecture; training needs the files themselves.
    from rlmegatron.controller import job

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(job, "start_ray", lambda spec: pytest.fail("Ray started"))
    hub_model = ["model.path=Qwen/Qwen3-0.6B", "model.hf_config=configs/quickstart/model/config.json",
                 "model.tokenizer_path=configs/quickstart/model"]
    assert main(["validate", QUICKSTART, *hub_model]) == 0
    capsys.readouterr()
    assert main(["train", QUICKSTART, *hub_model]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err == (
        "model.path=Qwen/Qwen3-0.6B: rlm train reads the model from a local directory and downloads nothing; download "
        "it (huggingface-cli download ID --local-dir DIR) and set model.path=DIR (model.hf_config only serves "
        "rlm validate and rlm plan)\n")
