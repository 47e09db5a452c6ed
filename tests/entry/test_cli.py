"""The `rlm` command line: validate's exit codes and output, help, and the not-yet-built commands."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlmegatron.entry.cli import EXIT_BAD_SPEC, build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"
SUBCOMMANDS = ("train", "validate", "plan", "convert", "prepare", "report", "pool")


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


def test_validate_names_an_unknown_algorithm_or_plugin_and_exits_2(monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    code = main(["validate", QUICKSTART, "actor.policy_loss.loss_mode=cispoo", "algorithm.adv_estimator=my_est.py:fn"])
    assert code == EXIT_BAD_SPEC
    assert capsys.readouterr().err.splitlines() == [
        f"command line: algorithm.adv_estimator=my_est.py:fn: no such file {REPO_ROOT / 'my_est.py'}",
        "command line: actor.policy_loss.loss_mode=cispoo: is not a registered policy loss (cispo, clip_cov, gpg, "
        "gspo, kl_cov, ppo or vanilla) nor a path/to/file.py:function plug-in; did you mean 'cispo'?",
    ]


def test_help_lists_the_seven_subcommands():
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


def test_every_argument_of_every_command_says_what_it_is():
    commands = next(action for action in build_parser()._actions if isinstance(action.choices, dict)).choices
    unexplained = {name: [action.dest for action in command._actions if not action.help]
                   for name, command in commands.items()}
    assert unexplained == {name: [] for name in SUBCOMMANDS}


def test_convert_help_is_the_converters_with_its_directions_and_every_flag_explained(capsys):
    from rlmegatron.entry.convert_command import build_parser

    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: rlm convert [-h] {hf-to-mcore,mcore-to-hf,lora-to-hf,verify}")
    for direction in build_parser()._subparsers._group_actions[0].choices.values():
        unexplained = [action.option_strings for action in direction._actions if not action.help]
        assert unexplained == [], f"{direction.prog}: flags without help: {unexplained}"


@pytest.mark.parametrize("argv, said", [
    (["plan", QUICKSTART, "--nvlink-gb-per-s", "0"],
     "rlm plan: argument --nvlink-gb-per-s: '0': give a number above 0 (see rlm plan --help)"),
    (["plan", QUICKSTART, "--gpu-tflops", "-3"],
     "rlm plan: argument --gpu-tflops: '-3': give a number above 0 (see rlm plan --help)"),
    (["plan", QUICKSTART, "--nvlink-domain", "0"],
     "rlm plan: argument --nvlink-domain: '0': give a whole number of GPUs above 0 (see rlm plan --help)"),
    (["trian"], "rlm: argument COMMAND: invalid choice: 'trian' (choose from 'train', 'validate', 'plan', 'convert', "
                "'prepare', 'report', 'pool') (see rlm --help)"),
    (["convert", "hf-to-mcore", "--tp", "2"], "rlm convert hf-to-mcore: the following arguments are required: "
                                              "--hf-path, --out (see rlm convert hf-to-mcore --help)"),
])
def test_a_command_line_mistake_is_one_line_naming_the_argument_and_exit_2(argv, said, capsys):
    """argparse's words without its usage block; a hardware figure of 0 or less is refused there, where the
    estimate would divide by it."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == said + "\n"


def test_convert_rejects_an_unknown_direction(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "hf-to-megatron", "ckpt/"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'hf-to-megatron'" in capsys.readouterr().err


def test_cli_module_imports_no_pydantic_nor_a_commands_modules_until_a_command_runs():
    """`rlm` imports rlmegatron.entry.cli before main's try begins, where a Ctrl-C would be a traceback."""
    probe = "import sys, rlmegatron.entry.cli; print(sorted(m for m in sys.modules if m.startswith(('pydantic', 'rlm'))))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["['rlmegatron',", "'rlmegatron.entry',", "'rlmegatron.entry.cli',",
                                     "'rlmegatron.entry.one_line_parser',", "'rlmegatron.errors',",
                                     "'rlmegatron.models',",
                                     "'rlmegatron.models.megatron_fusers']"]


def test_train_with_a_reward_plugin_that_does_not_load_exits_2_with_one_line(tmp_path):
    plugin = tmp_path / "reward.py"
    plugin.write_text("def compute_scor(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    result = rlm("train", QUICKSTART, f"reward.function={plugin}:compute_score", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == EXIT_BAD_SPEC
    [line] = result.stderr.splitlines()
    assert f"reward.function={plugin}:compute_score: " in line and line.endswith("reward.py defines no 'compute_score'")
    assert not (tmp_path / "run").exists()  # failed before anything started


def _raising(error: BaseException):
    def command(args):
        raise error

    return command


def test_a_users_mistake_raised_in_a_ray_worker_is_its_message_alone(monkeypatch, capsys):
    import ray.exceptions

    from rlmegatron.data import DatasetError

    # What ray.get raises for a worker's exception: a RayTaskError that is also a DatasetError, its text Ray's
    # report of the remote traceback.
    mistake = DatasetError("train.jsonl:3: not valid JSON")
    remote = ray.exceptions.RayTaskError("RankHost.build", "Traceback (most recent call last):\n  ...",
                                         mistake).as_instanceof_cause()
    assert isinstance(remote, DatasetError) and str(remote) != str(mistake)
    monkeypatch.setattr("rlmegatron.entry.cli.validate", _raising(remote))
    assert main(["validate", QUICKSTART]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err == "train.jsonl:3: not valid JSON\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setattr("rlmegatron.entry.cli.validate", _raising(KeyError("a bug of ours")))
    with pytest.raises(KeyError, match="a bug of ours"):
        main(["validate", QUICKSTART])


@pytest.mark.parametrize("where", ["before the command", "after it"])
def test_debug_adds_the_traceback_to_a_users_mistake(where, monkeypatch, capsys):
    from rlmegatron.plugins import PluginError

    monkeypatch.setattr("rlmegatron.entry.cli.validate", _raising(PluginError("reward.py defines no 'score'")))
    argv = ["--debug", "validate", QUICKSTART] if where == "before the command" else ["validate", QUICKSTART, "--debug"]
    assert main(argv) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "raise error" in err
    assert err.endswith("PluginError: reward.py defines no 'score'\nreward.py defines no 'score'\n")


def test_validate_notes_data_files_not_written_yet_and_exits_0(monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    assert main(["validate", QUICKSTART, "data.train_files=[runs/not_prepared/train.parquet]"]) == 0
    assert capsys.readouterr().err == ("note: data.train_files[0]=runs/not_prepared/train.parquet: not found (rlm "
                                       "prepare writes it?); rlm train refuses to start without it\n")


def test_validate_notes_a_hub_model_not_in_the_cache_and_a_model_without_eos(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    config = json.loads((REPO_ROOT / "configs/quickstart/model/config.json").read_text())
    del config["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["model.path=rlmegatron-tests/no-such-model", f"model.hf_config={tmp_path / 'config.json'}",
            "model.tokenizer_path=configs/quickstart/model"]
    assert main(["validate", QUICKSTART, *args]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "note: model.path=rlmegatron-tests/no-such-model: not a local directory nor in the local Hugging Face cache; "
        "rlm train fetches it from the hub and refuses to start if it cannot; its config and tokenizer are checked "
        "then",
        f"note: model.hf_config={tmp_path / 'config.json'}: config.json sets no eos_token_id, so every response runs "
        "to data.max_response_length tokens",
    ]


def test_train_runs_a_hub_model_from_its_downloaded_snapshot(monkeypatch, capsys, tmp_path):
    # No hub here: the download is the quickstart's directory. rlm train must fetch the whole model (weights too,
    # unless model.random_init) and hand the workers the snapshot's local path, which is what they read.
    import huggingface_hub

    from rlmegatron.driver import job
    from rlmegatron.prelaunch.preflight import HUB_PATTERNS

    fetched, launched = [], []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        fetched.append((repo_id, allow_patterns, local_files_only))
        return str(REPO_ROOT / "configs" / "quickstart" / "model")

    class NoTracker:
        def finish(self, status):
            pass

    def start_ranks(device, world_size, rank_class, settings, collective_timeout_s):
        launched.append(settings)
        raise SystemExit(0)

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("rlmegatron.tracking.Tracker.from_spec", lambda spec: NoTracker())
    monkeypatch.setattr(job, "RankProcesses", start_ranks)  # placement.transport=auto: the quickstart's ranks
    hub_model = ["model.path=Qwen/Qwen3-0.6B", "model.hf_config=configs/quickstart/model/config.json"]
    # A run directory of its own: a finished quickstart in runs/ would end the command before anything starts.
    assert main(["train", QUICKSTART, *hub_model, f"trainer.run_dir={tmp_path}"]) == 0
    [settings] = launched  # the ranks get their settings, never the spec
    assert settings.model.path == settings.model.tokenizer_path == str(REPO_ROOT / "configs" / "quickstart" / "model")
    # model.random_init: its config and tokenizer are all the run reads of it.
    assert fetched == [("Qwen/Qwen3-0.6B", HUB_PATTERNS, False)]


def test_ctrl_c_before_training_starts_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while the command line is read or the spec is checked (seconds) is reported as an interrupt, not a traceback."""
    import rlmegatron.entry.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_spec_source", interrupted)
    assert main(["train", "configs/quickstart.yaml"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("option", ["--debug", "--verbose"])
def test_a_deleted_key_after_an_option_is_an_override(option, monkeypatch):
    import rlmegatron.entry.cli as cli

    seen = []
    monkeypatch.setattr(cli, "train", lambda args: seen.append(args.overrides) or 0)
    assert main(["train", QUICKSTART, "rollout.n=4", option, "~trainer.total_steps"]) == 0
    assert seen == [["rollout.n=4", "~trainer.total_steps"]]


def test_ctrl_c_while_the_parser_imports_is_one_line_and_exit_130(monkeypatch, capsys):
    import rlmegatron.entry.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    # Building the parser imports the spec's modules: most of a second.
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["validate", QUICKSTART]) == 130
    assert capsys.readouterr().err == "interrupted\n"
