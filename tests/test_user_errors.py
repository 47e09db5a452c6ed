"""The catalogue of a user's mistakes: each is exit 2 and one line per problem naming its file, field or row and the
fix, with no traceback, and all of them are caught before the first worker starts.

Most cases run `rlm validate` in this process; the `train` ones run `rlm train` here up to the point where the run
would start (a case that got past the pre-launch checks fails on the tracker, which is built next); a few run as
processes where the exit path itself is what is checked.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlmegatron.entry.cli import EXIT_BAD_SPEC, EXIT_TRAINING_STOPPED, main
from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "configs/quickstart.yaml"
QUICKSTART_MODEL = REPO_ROOT / "configs" / "quickstart" / "model"
NO_SUCH_HUB_MODEL = "rlmegatron-tests/no-such-model"


def row(index: int, **fields) -> dict:
    """A quickstart-style verl row."""
    char = "abcdefghijklmnopqrstuvwxyz"[index % 26]
    return {"prompt": [{"role": "user", "content": f"echo:{char}"}], "data_source": "echo",
            "reward_model": {"ground_truth": char}, "extra_info": {"index": index}, **fields}


def rows(count: int, **fields) -> list[dict]:
    return [row(index, **fields) for index in range(count)]


class Assets:
    """Files the cases break, written on demand into one directory per module run."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def text(self, name: str, text: str | bytes) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        return str(path)

    def jsonl(self, name: str, records: list) -> str:
        return self.text(name, "".join(json.dumps(record) + "\n" for record in records))

    def parquet(self, name: str, records: list[dict], schema: pa.Schema | None = None) -> str:
        path = self.root / name
        pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
        return str(path)

    def model(self, name: str, config: dict | None = None, files: dict[str, str] | None = None,
              drop: tuple[str, ...] = ()) -> str:
        """A copy of the quickstart's model directory (config.json + tokenizer) with fields and files changed."""
        path = self.root / name
        shutil.copytree(QUICKSTART_MODEL, path)
        if config:
            hf = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**hf, **config}))
        for file, text in (files or {}).items():
            (path / file).write_text(text)
        for file in drop:
            (path / file).unlink()
        return str(path)


@dataclass(frozen=True)
class Case:
    argv: Callable[[Assets], list[str]]
    culprits: tuple[str, ...]
    """What the message must name: the field, file or row, and the fix."""
    problems: int = 1
    """Lines of the report (a mistake in the train and the val file is two)."""


def validate(*overrides: str) -> Callable[[Assets], list[str]]:
    return lambda a: ["validate", QUICKSTART, *overrides]


def _mxfp4_gpt_oss(a: Assets) -> str:
    """A tiny gpt-oss whose experts are MXFP4, as OpenAI releases them."""
    from tests.models.mxfp4_checkpoints import save_mxfp4_model

    with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar, not the command's output
        return save_mxfp4_model(str(a.root / "gpt_oss"))[0]


def validating(build: Callable[[Assets], list[str]]) -> Callable[[Assets], list[str]]:
    return lambda a: ["validate", QUICKSTART, *build(a)]


def training(build: Callable[[Assets], list[str]]) -> Callable[[Assets], list[str]]:
    return lambda a: ["train", QUICKSTART, f"trainer.run_dir={a.root / 'runs'}", *build(a)]


def train_file(path: str) -> list[str]:
    return [f"data.train_files=[{path}]"]


def model_copy(a: Assets, field: str, name: str, **changes) -> list[str]:
    """`field` set to a changed copy of the quickstart's model directory (Assets.model)."""
    return [f"{field}={a.model(name, **changes)}"]


def with_model(field: str, name: str, **changes) -> Callable[[Assets], list[str]]:
    return validating(lambda a: model_copy(a, field, name, **changes))


def plugin(a: Assets, field: str, file: str, source: str, name: str) -> list[str]:
    return [f"{field}={a.text(file, source)}:{name}"]


def reward(a: Assets, file: str, source: str) -> list[str]:
    return plugin(a, "reward.function", file, source, "compute_score")


def dataset_class(a: Assets, file: str, source: str) -> list[str]:
    return plugin(a, "data.dataset_class", file, source, "Prompts")


TOOL_SCHEMA = 'class Tool:\n    schema = {"type": "function", "function": {"name": "t", "parameters": {}}}\n'
TOOL_EXECUTE = "    async def execute(self, args, context): ...\n"


def tools(a: Assets, file: str, source: str, config: str = "{}") -> list[str]:
    return [f"rollout.multi_turn.tools=[{{plugin: '{a.text(file, source)}:Tool', config: {config}}}]"]


def corrupted(a: Assets) -> bytes:
    """A parquet file whose footer is intact and whose first data pages are garbage."""
    data = bytearray(Path(a.parquet("to_corrupt.parquet", rows(64))).read_bytes())
    data[40:400] = b"\xab" * 360
    return bytes(data)


CHAT_TEMPLATE_REFUSING_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{{ message['content'] }}{% endfor %}"
)
ESTIMATOR_SOURCE = "def estimate(token_level_rewards, response_mask, group_index):\n    return None, None\n"

def traced(a: Assets) -> str:
    """The quickstart's spec with console traces of 4 prompts a step, as a user's YAML may hold them."""
    return a.text("traced.yaml", (REPO_ROOT / QUICKSTART).read_text()
                  + "  rollout_trace: {backend: console, prompts_per_step: 4}\n")


MXFP4_REWARD_MODEL = {"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"},
                      "quantization_config": {"quant_method": "mxfp4"}}

CASES = {
    # ---- the command line itself ------------------------------------------------------------------------------
    "train-without-a-spec": Case(lambda a: ["train"], ("rlm train: which job? Give its spec: rlm train CONFIG",
                                                       "rlm train configs/quickstart.yaml")),
    "override-in-place-of-the-spec": Case(lambda a: ["train", "rollout.n=8"],
                                          ("rlm train: rollout.n=8 is an override, and the job spec comes first",
                                           "rlm train configs/quickstart.yaml rollout.n=8")),
    "verl-keys-alone-without-the-model": Case(lambda a: ["validate", "--verl", "algorithm.adv_estimator=grpo"],
                                              ("command line: model: is required but missing",
                                               "command line: data: is required but missing"), problems=2),
    "verl-epochs-under-the-base-specs-total-steps": Case(
        lambda a: ["validate", "--verl", QUICKSTART, "trainer.total_epochs=1"],
        ("command line: trainer.total_epochs=1: trainer.total_steps=150 is set and ends the run instead",
         "(~trainer.total_steps on the command line) to train by epochs")),
    "epochs-under-the-specs-total-steps": Case(validate("trainer.total_epochs=1"),
                                               ("command line: trainer.total_epochs=1: trainer.total_steps=150",)),
    "trace-turned-off-keeps-its-prompts": Case(
        lambda a: ["validate", traced(a), "tracking.rollout_trace.backend=null"],
        ("tracking.rollout_trace.prompts_per_step=4: no samples are traced",
         "remove it (~tracking.rollout_trace.prompts_per_step on the command line)")),
    "log-freq-without-the-console": Case(validate("tracking.backends=[mlflow]", "trainer.log_freq=5"),
                                         ("trainer.log_freq=5: only the console backend prints metric tables",)),

    # ---- the run directory: it can be written to (checked before anything starts) -----------------------------
    "run-dir-is-a-file": Case(validating(lambda a: [f"trainer.run_dir={a.text('run_file', 'x')}"]),
                              ("trainer.run_dir=", "run_file: is a file, not a directory",
                               "give a trainer.run_dir this user can write to")),
    "run-dir-under-a-file": Case(training(lambda a: [f"trainer.run_dir={a.text('parent_file', 'x')}/run"]),
                                 ("trainer.run_dir=", "parent_file/run: cannot be created:", "parent_file is a file")),

    # ---- the spec file and its fields (rlmegatron.config) -----------------------------------------------------
    "spec-file-missing": Case(lambda a: ["validate", "no/such.yaml"], ("no/such.yaml: cannot read the spec",)),
    "spec-not-yaml": Case(lambda a: ["validate", a.text("broken.yaml", "model: [unclosed\n")],
                          ("broken.yaml: not valid YAML: line 2",)),
    "spec-not-a-mapping": Case(lambda a: ["validate", a.text("list.yaml", "- model\n- data\n")],
                               ("list.yaml: must be a YAML mapping of sections",)),
    "spec-missing-required-field": Case(lambda a: ["validate", a.text("nodata.yaml", "model: {path: x}\n")],
                                        ("nodata.yaml: data: is required but missing",)),
    "unknown-key": Case(validate("actor.optim.lrr=1e-6"), ("actor.optim.lrr", "did you mean 'lr'?")),
    "unknown-section": Case(validate("actr.optim.lr=1e-6"), ("actr", "did you mean 'actor'?")),
    "override-without-value": Case(validate("rollout.n"), ("rollout.n", "key=value")),
    "wrong-type": Case(validate("rollout.n=many"), ("rollout.n=many", "valid integer")),
    "bool-for-a-count": Case(validate("placement.gpus_per_node=true"), ("placement.gpus_per_node=true",)),
    "negative-learning-rate": Case(validate("actor.optim.lr=-1"), ("actor.optim.lr=-1", "greater than 0")),
    "learning-rate-beyond-float32": Case(validate("actor.optim.lr=1e39"), ("actor.optim.lr=1.0e+39", "less than")),
    "unknown-choice": Case(validate("model.dtype=fp8"), ("model.dtype=fp8", "'bf16', 'fp16' or 'fp32'")),
    "tp-does-not-divide-heads-or-ranks": Case(validate("actor.megatron.tensor_model_parallel_size=3"),
                                              ("tensor_model_parallel_size=3", "4 attention heads; use 1 or 2"),
                                              problems=2),
    "mini-batch-does-not-divide": Case(validate("actor.ppo_mini_batch_size=5", "actor.ppo_micro_batch_size_per_gpu=1"),
                                       ("actor.ppo_mini_batch_size=5", "does not divide data.train_batch_size=16")),
    "unknown-estimator": Case(validate("algorithm.adv_estimator=grpoo"),
                              ("algorithm.adv_estimator=grpoo", "did you mean 'grpo'?")),
    "data-file-not-parquet-or-jsonl": Case(validate("data.train_files=[train.csv]"),
                                           ("data.train_files[0]=train.csv", "must be a .parquet or .jsonl file")),
    "model-path-neither-dir-nor-configured": Case(validate("model.path=org/model"),
                                                  ("model.path=org/model", "set model.hf_config")),
    "model-config-not-json": Case(lambda a: ["validate", QUICKSTART, "model.path=org/model",
                                             f"model.hf_config={a.text('bad_config.json', '{oops')}"],
                                  ("model.hf_config=", "bad_config.json")),
    "response-cap-over-response-length": Case(validate("rollout.max_new_tokens=8"),
                                              ("rollout.max_new_tokens=8", "exceeds data.max_response_length=1")),
    "resume-path-missing": Case(validate("trainer.resume=/no/such/checkpoint"),
                                ("trainer.resume=/no/such/checkpoint", "existing checkpoint path")),
    "setting-without-its-switch": Case(validate("actor.kl_loss_coef=0.5"),
                                       ("actor.kl_loss_coef=0.5", "actor.use_kl_loss")),

    # ---- plug-ins: reward function, dataset class, estimator, policy loss -------------------------------------
    "reward-file-missing": Case(validate("reward.function=/no/such/reward.py:compute_score"),
                                ("reward.function=/no/such/reward.py:compute_score", "is not a file")),
    "reward-not-a-reference": Case(validate("reward.function=reward.py"),
                                   ("reward.function=reward.py", "must look like path/to/file.py:name")),
    "reward-function-name-missing": Case(validate("reward.function=configs/quickstart/reward.py:score"),
                                         ("reward.function=configs/quickstart/reward.py:score",
                                          "reward.py defines no 'score'")),
    "reward-syntax-error": Case(validating(lambda a: reward(a, "syntax_reward.py", "def compute_score(:\n")),
                                ("reward.function=", "SyntaxError", "syntax_reward.py, line 1")),
    "reward-import-error": Case(validating(lambda a: reward(a, "import_reward.py", "import no_such_module_xyz\n")),
                                ("reward.function=", "ModuleNotFoundError", "no_such_module_xyz")),
    "reward-raises-on-import": Case(validating(lambda a: reward(a, "raising_reward.py", "raise RuntimeError('no')\n")),
                                    ("reward.function=", "raising_reward.py raised RuntimeError: no")),
    "reward-wrong-signature": Case(validating(lambda a: reward(a, "two_reward.py", "def compute_score(solution, "
                                                                                   "truth):\n    return 1.0\n")),
                                   ("reward.function=", "too many positional arguments",
                                    "compute_score(data_source, solution_str, ground_truth, extra_info)")),
    "reward-not-callable": Case(validating(lambda a: reward(a, "const_reward.py", "compute_score = 1.0\n")),
                                ("reward.function=", "is not a function", "it is of type float")),
    "tool-unknown-builtin": Case(validate("rollout.multi_turn.tools=[{plugin: pyhton}]"),
                                 ("rollout.multi_turn.tools[0].plugin=pyhton", "neither a built-in tool (python)")),
    "tool-without-schema": Case(validating(lambda a: tools(a, "no_schema.py", "class Tool:\n"
                                                                 "    async def execute(self, args, context): ...\n")),
                                ("rollout.multi_turn.tools[0].plugin=", "`schema` in the OpenAI function format")),
    "tool-execute-not-async": Case(validating(lambda a: tools(a, "sync_tool.py", TOOL_SCHEMA +
                                                              "    def execute(self, args, context): ...\n")),
                                   ("rollout.multi_turn.tools[0].plugin=", "needs `async def execute(self, args, ")),
    "tool-config-not-accepted": Case(validating(lambda a: tools(a, "tool.py", TOOL_SCHEMA + TOOL_EXECUTE,
                                                                config="{colour: red}")),
                                     ("rollout.multi_turn.tools[0].plugin=", "unexpected keyword argument 'colour'",
                                      "tools[].config holds its keyword arguments")),
    "tool-call-format-unknown": Case(validate("rollout.multi_turn.tools=[{plugin: python}]",
                                              "rollout.multi_turn.tool_call_format=json"),
                                     ("rollout.multi_turn.tool_call_format=json", "known: hermes")),
    "multi-turn-setting-without-tools": Case(validate("rollout.multi_turn.max_turns=3"),
                                             ("rollout.multi_turn.max_turns=3", "rollout.multi_turn.tools is empty")),
    "dataset-class-file-missing": Case(validate("data.dataset_class=/no/such/data.py:Prompts"),
                                       ("data.dataset_class=/no/such/data.py:Prompts", "is not a file")),
    "dataset-class-name-missing": Case(validating(lambda a: dataset_class(a, "empty_data.py", "X = 1\n")),
                                       ("data.dataset_class=", "empty_data.py defines no 'Prompts'")),
    "dataset-class-syntax-error": Case(validating(lambda a: dataset_class(a, "syntax_data.py", "class Prompts(:\n")),
                                       ("data.dataset_class=", "SyntaxError", "syntax_data.py, line 1")),
    "dataset-class-wrong-signature": Case(
        validating(lambda a: dataset_class(a, "one_arg_data.py", "class Prompts:\n    def __init__(self, files):\n"
                                                                 "        pass\n")),
        ("data.dataset_class=", "too many positional arguments", "Class(files, tokenizer, config)")),
    "estimator-plugin-name-missing": Case(
        validating(lambda a: plugin(a, "algorithm.adv_estimator", "estimators.py", ESTIMATOR_SOURCE, "estimat")),
        ("algorithm.adv_estimator=", "estimators.py defines no 'estimat'")),
    "estimator-plugin-syntax-error": Case(
        validating(lambda a: plugin(a, "algorithm.adv_estimator", "bad_estimators.py", "def estimate(:", "estimate")),
        ("algorithm.adv_estimator=", "SyntaxError")),
    "loss-plugin-wrong-signature": Case(
        validating(lambda a: plugin(a, "actor.policy_loss.loss_mode", "losses.py", "def loss(x):\n    return x\n",
                                    "loss")),
        ("actor.policy_loss.loss_mode=", "cannot be called as loss(")),
    "loss-plugin-file-missing": Case(validate("actor.policy_loss.loss_mode=/no/such/losses.py:loss"),
                                     ("actor.policy_loss.loss_mode=/no/such/losses.py:loss", "no such file")),

    # ---- data files: the first rows of each, with the configured keys -----------------------------------------
    "prompt-column-missing-jsonl": Case(validating(lambda a: train_file(a.jsonl("nocol.jsonl", [{"question": "q"}]))),
                                        ("data.train_files[0]", "nocol.jsonl:1: no 'prompt' key",
                                         "set data.prompt_key")),
    "prompt-column-missing-parquet": Case(
        validating(lambda a: train_file(a.parquet("nocol.parquet", [{"question": "q", "answer": "a"}]))),
        ("data.train_files[0]", "nocol.parquet:row 1: no 'prompt' key (it has 'question', 'answer')",
         "set data.prompt_key")),
    "prompt-key-names-no-column": Case(validate("data.prompt_key=question"),
                                       ("train.jsonl:1: no 'question' key", "val.jsonl:1: no 'question' key",
                                        "set data.prompt_key"), problems=2),
    "prompt-is-a-string": Case(validating(lambda a: train_file(a.jsonl("str.jsonl", [row(0, prompt="echo:a")]))),
                               ("str.jsonl:1: 'prompt' must be a non-empty list of chat messages",)),
    "prompt-is-a-list-of-strings": Case(validating(lambda a: train_file(a.jsonl("strs.jsonl", [row(0, prompt=["a"])]))),
                                        ("strs.jsonl:1: 'prompt' must be a non-empty list of chat messages",)),
    "prompt-message-without-content": Case(
        validating(lambda a: train_file(a.jsonl("norole.jsonl", [row(0, prompt=[{"role": "user"}])]))),
        ("norole.jsonl:1: 'prompt' must be a non-empty list of chat messages ({role, content})",)),
    "prompt-empty-list": Case(validating(lambda a: train_file(a.jsonl("emptyprompt.jsonl", [row(0, prompt=[])]))),
                              ("emptyprompt.jsonl:1: 'prompt' must be a non-empty list",)),
    "plain-rows-read-as-chat": Case(
        validating(lambda a: train_file(a.jsonl("plainrows.jsonl", [{"prompt": "next:3", "answer": "4"}]))),
        ("plainrows.jsonl:1: 'prompt' must be a non-empty list of chat messages",
         "a plain text prompt needs data.prompt_format=plain")),
    "chat-rows-read-as-plain": Case(validate("data.prompt_format=plain"),
                                    ("train.jsonl:1: 'prompt' must be a non-empty text with data.prompt_format=plain, "
                                     "got list", "val.jsonl:1:", "chat messages need data.prompt_format=chat"),
                                    problems=2),
    "answer-key-names-no-field": Case(validate("data.answer_key=answer"),
                                      ("train.jsonl:1: no ground truth at data.answer_key=answer (the row has "
                                       "'prompt', 'data_source', 'reward_model', 'extra_info')", "val.jsonl:1:",
                                       "set data.answer_key to the dotted key that holds it"), problems=2),
    "prompt-null": Case(validating(lambda a: train_file(a.jsonl("nullprompt.jsonl", [row(0, prompt=None)]))),
                        ("nullprompt.jsonl:1: 'prompt' must be a non-empty list",)),
    "bad-prompt-in-row-5": Case(validating(lambda a: train_file(a.jsonl("row5.jsonl", [*rows(4), row(4, prompt=3)]))),
                                ("row5.jsonl:5: 'prompt' must be a non-empty list",)),
    "empty-jsonl": Case(validating(lambda a: train_file(a.text("empty.jsonl", ""))),
                        ("data.train_files[0]", "empty.jsonl: has no rows")),
    "blank-lines-only-jsonl": Case(validating(lambda a: train_file(a.text("blank.jsonl", "\n  \n\n"))),
                                   ("blank.jsonl: has no rows",)),
    "empty-parquet": Case(
        validating(lambda a: train_file(a.parquet("empty.parquet", [], pa.schema([("prompt", pa.string())])))),
        ("empty.parquet: has no rows",)),
    "bad-json-on-line-1": Case(validating(lambda a: train_file(a.text("bad1.jsonl", "{not json\n"))),
                               ("bad1.jsonl:1: not valid JSON", "fix or remove that line")),
    "bad-json-on-line-5": Case(
        validating(lambda a: train_file(a.text("bad5.jsonl", "".join(json.dumps(r) + "\n" for r in rows(4))
                                               + '{"prompt": [\n'))),
        ("bad5.jsonl:5: not valid JSON",)),
    "json-line-not-an-object": Case(validating(lambda a: train_file(a.text("array.jsonl", "[1, 2]\n"))),
                                    ("array.jsonl:1: expected a JSON object, got list",)),
    "jsonl-not-utf8": Case(validating(lambda a: train_file(a.text("latin1.jsonl", b'{"a": "caf\xe9"}\n'))),
                           ("latin1.jsonl:1: not UTF-8 text",)),
    "not-a-parquet-file": Case(validating(lambda a: train_file(a.text("notparquet.parquet", b"PAR1 not really" * 9))),
                               ("data.train_files[0]", "notparquet.parquet: not a readable parquet file")),
    "corrupt-parquet-pages": Case(validating(lambda a: train_file(a.text("corrupt.parquet", corrupted(a)))),
                                  ("data.train_files[0]", "corrupt.parquet: not a readable parquet file (at its "
                                                          "start: ",
                                   "write it again (rlm prepare) or replace it")),
    "truncated-parquet": Case(
        validating(lambda a: train_file(a.text("truncated.parquet",
                                               Path(a.parquet("whole.parquet", rows(64))).read_bytes()[:600]))),
        ("truncated.parquet: not a readable parquet file",)),
    "parquet-named-jsonl": Case(
        validating(lambda a: train_file(a.text("parquet.jsonl",
                                               Path(a.parquet("real.parquet", rows(2))).read_bytes()))),
        ("parquet.jsonl:1: not UTF-8 text",)),
    "data-path-is-a-directory": Case(
        validating(lambda a: train_file(str((a.root / "dir.jsonl").mkdir() or a.root / "dir.jsonl"))),
        ("data.train_files[0]=", "dir.jsonl: is a directory")),
    "val-file-bad-json": Case(validating(lambda a: [f"data.val_files=[{a.text('badval.jsonl', '{')}]"]),
                              ("data.val_files[0]", "badval.jsonl:1: not valid JSON")),
    "data-source-without-builtin-reward": Case(
        validating(lambda a: ["reward.function=null", *train_file(a.jsonl("mysource.jsonl", rows(2)))]),
        ("mysource.jsonl:1: data_source 'echo' has no built-in reward",
         "set reward.function=path/to/file.py:compute_score"), problems=2),
    "first-prompt-longer-than-allowed": Case(validate("data.max_prompt_length=4"),
                                             ("train.jsonl:1: the prompt is 6 tokens, over data.max_prompt_length=4",
                                              "data.filter_overlong_prompts=true"), problems=2),
    "chat-template-refuses-the-messages": Case(
        validating(lambda a: [*model_copy(a, "model.tokenizer_path", "system_tok",
                                          files={"chat_template.jinja": CHAT_TEMPLATE_REFUSING_SYSTEM}),
                              *train_file(a.jsonl("system.jsonl", [row(0, prompt=[{"role": "system",
                                                                                   "content": "x"}])]))]),
        ("system.jsonl:1: the tokenizer's chat template fails on this prompt",
         "System role not supported")),

    # ---- the tokenizer ---------------------------------------------------------------------------------------
    "tokenizer-path-missing": Case(validate("model.tokenizer_path=configs/no/tokenizer"),
                                   ("model.tokenizer_path=configs/no/tokenizer", "no such directory")),
    "tokenizer-path-is-a-file": Case(validate("model.tokenizer_path=configs/quickstart/model/tokenizer.json"),
                                     ("model.tokenizer_path=configs/quickstart/model/tokenizer.json", "is a file")),
    "tokenizer-dir-without-tokenizer": Case(validate("model.tokenizer_path=configs/models/tiny-qwen3"),
                                            ("model.tokenizer_path=configs/models/tiny-qwen3", "holds no tokenizer")),
    "tokenizer-corrupt": Case(
        with_model("model.tokenizer_path", "corrupt_tok", files={"tokenizer.json": "{oops"}),
        ("model.tokenizer_path=", "corrupt_tok: cannot load its tokenizer")),
    "tokenizer-without-chat-template": Case(
        with_model("model.tokenizer_path", "plain_tok", drop=("chat_template.jinja",)),
        ("model.tokenizer_path=", "plain_tok: the tokenizer has no chat template", "chat_template.jinja")),
    "tokenizer-larger-than-the-vocabulary": Case(
        with_model("model.path", "small_vocab", config={"vocab_size": 64}),
        ("model.path=", "small_vocab: the tokenizer has 105 tokens, more than the model's vocabulary (vocab_size 64)")),

    # ---- the model -------------------------------------------------------------------------------------------
    "model-without-weights": Case(validate("model.random_init=false"),
                                  ("model.path=configs/quickstart/model: has no model.safetensors",
                                   "model.random_init=true")),
    "model-quantised-in-an-unsupported-format": Case(
        validating(lambda a: ["model.random_init=false", *model_copy(
            a, "model.path", "nvfp4", config={"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})]),
        ("model.path=", "nvfp4/config.json: quantization_config: NVFP4 (quant_method modelopt) weights are not "
         "supported", "dequantise the checkpoint to bf16 first")),
    "reward-model-quantised-in-an-unsupported-format": Case(
        validating(lambda a: [f"reward.model.path={a.model('rm_mxfp4', config=MXFP4_REWARD_MODEL)}",
                              "reward.model.rule_weight=1.0"]),
        ("reward.model.path=", "rm_mxfp4/config.json: quantization_config: MXFP4 (quant_method mxfp4) weights are "
         "not supported", "dequantise the checkpoint to bf16 first")),
    "mxfp4-model-for-sglang-engines": Case(
        validating(lambda a: [f"model.path={_mxfp4_gpt_oss(a)}", "model.tokenizer_path=configs/quickstart/model",
                              "model.random_init=false", "rollout.engine=sglang", "placement.mode=disaggregate",
                              "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1"]),
        ("model.path=", "mxfp4: holds MXFP4 experts, which SGLang serves quantised", "rollout.engine=local")),
    "model-family-unsupported": Case(with_model("model.path", "mistral", config={"model_type": "mistral"}),
                                     ("model.path=", "mistral", "not supported")),
    "model-values-unsupported": Case(
        with_model("model.path", "gelu_window", config={"hidden_act": "gelu", "use_sliding_window": True}),
        ("model.path=", "gelu_window", "hidden_act='gelu' unsupported", "sliding_window attention is unsupported")),
    "model-rope-unsupported": Case(
        with_model("model.path", "yarn", config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        ("model.path=", "yarn", "rope_type='yarn' unsupported")),
    "model-pad-id-outside-vocabulary": Case(
        with_model("model.path", "pad500", config={"pad_token_id": 500}),
        ("model.path=", "pad500: pad_token_id=500 is outside the model's vocabulary (vocab_size 128)")),
    "model-path-missing-beside-hf-config": Case(
        validate("model.path=./no/such/model", "model.hf_config=configs/quickstart/model/config.json",
                 "model.tokenizer_path=configs/quickstart/model"),
        ("model.path=./no/such/model", "no such directory")),

    # ---- rlm train: what `validate` may only note, and the rows beyond the first ones -------------------------
    "train-data-file-missing": Case(training(lambda a: train_file(str(a.root / "not_prepared.parquet"))),
                                    ("data.train_files[0]=", "not_prepared.parquet: no such file",
                                     "rlm prepare")),
    "train-val-file-missing": Case(training(lambda a: ["data.val_files=[no_such_val.jsonl]"]),
                                   ("data.val_files[0]=no_such_val.jsonl: no such file",)),
    "train-tokenizer-hub-id-unreachable": Case(training(lambda a: [f"model.tokenizer_path={NO_SUCH_HUB_MODEL}"]),
                                               (f"model.tokenizer_path={NO_SUCH_HUB_MODEL}: is neither a local "
                                                "directory nor a model the Hugging Face hub provides here",
                                                "huggingface-cli download")),
    "train-model-hub-id-unreachable": Case(
        training(lambda a: [f"model.path={NO_SUCH_HUB_MODEL}", "model.hf_config=configs/quickstart/model/config.json",
                            "model.tokenizer_path=configs/quickstart/model"]),
        (f"model.path={NO_SUCH_HUB_MODEL}: is neither a local directory nor a model", "set model.path to DIR")),
    "train-bad-json-on-line-40": Case(
        training(lambda a: train_file(a.text("bad40.jsonl", "".join(json.dumps(r) + "\n" for r in rows(39)) + "{\n"))),
        ("bad40.jsonl:40: not valid JSON",)),
    "train-prompt-missing-in-row-30": Case(
        training(lambda a: train_file(a.parquet("row30.parquet", [*rows(29), {**row(29), "prompt": None}]))),
        ("row30.parquet:row 30: 'prompt' must be a non-empty list",)),
    "train-fewer-prompts-than-a-batch": Case(training(lambda a: train_file(a.jsonl("three.jsonl", rows(3)))),
                                             ("the dataset has 3 prompts, fewer than one batch of 16",
                                              "lower data.train_batch_size")),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Assets:
    return Assets(tmp_path_factory.mktemp("user_errors"))


@pytest.fixture(scope="module", autouse=True)
def transformers_quiet():
    """transformers' own warnings (a config it finds odd) go to a log handler bound to the stderr of the test that
    first logged, which capsys has closed since; they are not what these tests check."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture
def no_launch(monkeypatch):
    """`rlm train` gets as far as the pre-launch checks and the dataset; the tracker, built next, must not be."""
    from rlmegatron.tracking import Tracker

    def launched(spec):
        raise AssertionError("the run got past the pre-launch checks")

    monkeypatch.setattr(Tracker, "from_spec", staticmethod(launched))


@pytest.mark.parametrize("name", CASES)
def test_a_users_mistake_is_one_line_per_problem_with_exit_2(name, assets, no_launch, monkeypatch, capsys):
    case = CASES[name]
    monkeypatch.chdir(REPO_ROOT)
    argv = case.argv(assets)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == EXIT_BAD_SPEC, err
    assert "Traceback" not in err
    assert out == ""
    problems = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert len(problems) == case.problems, err
    for culprit in case.culprits:
        assert culprit in err, f"{culprit!r} not in {err!r}"


def test_the_reliability_page_says_how_many_cases_each_catalogue_holds():
    """The reliability page's first section: the count of CASES, and one bullet per fault case, each naming test files
    that exist."""
    section = (REPO_ROOT / "docs" / "reliability.md").read_text().split("## Reliability\n", 1)[1].split("\n## ", 1)[0]
    assert f"runs the {len(CASES)} cases of its `CASES` table" in " ".join(section.split())
    faults = section.split("**A fault at run time** (", 1)[1]
    stated = int(faults.split(" cases)", 1)[0])
    bullets = [line for line in faults.splitlines() if line.startswith("- **")]
    assert len(bullets) == stated
    named = re.findall(r"`(tests/[\w/]+\.py)`", faults)
    assert named and all((REPO_ROOT / path).is_file() for path in named), named


# ---- where the exit path itself is the point: processes -------------------------------------------------------
def rlm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlmegatron", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_rlm_train_refuses_a_missing_data_file_in_one_line_before_ray(tmp_path):
    result = rlm("train", QUICKSTART, f"trainer.run_dir={tmp_path}", f"data.train_files=[{tmp_path}/train.parquet]")
    assert result.returncode == EXIT_BAD_SPEC
    assert result.stderr == (f"data.train_files[0]={tmp_path}/train.parquet: no such file (relative paths start at "
                             "the working directory; rlm prepare writes prepared datasets)\n")
    assert not any(tmp_path.iterdir())  # no tracker, no checkpoint, no Ray session was started


@contextlib.contextmanager
def read_only_directory(path: Path):
    """`path`, a directory this process cannot write to: mounted read-only as root (whom permission bits do not
    stop), else stripped of its write bits."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("root here may not mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_run_directory_is_refused_before_anything_starts(tmp_path, no_launch, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    with read_only_directory(tmp_path / "read_only") as run_dir:
        code = main(["train", QUICKSTART, f"trainer.run_dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == EXIT_BAD_SPEC and out == ""
    assert err in (f"trainer.run_dir={run_dir}: cannot be written to ({reason}); give a trainer.run_dir this user can "
                   "write to\n" for reason in ("Read-only file system", "Permission denied"))


def test_the_fixes_a_trace_turned_off_names_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    spec = traced(Assets(tmp_path))
    for fix in (["tracking.rollout_trace.backend=null", "~tracking.rollout_trace.prompts_per_step"],
                ["~tracking.rollout_trace"]):
        assert main(["validate", spec, *fix]) == 0
        resolved = capsys.readouterr().out
        assert "  rollout_trace:\n    backend: null\n    prompts_per_step: 2\n" in resolved, fix


def test_rlm_debug_shows_the_traceback_of_a_users_mistake():
    result = rlm("validate", QUICKSTART, "reward.function=configs/quickstart/reward.py:score", env={"RLM_DEBUG": "1"})
    assert result.returncode == EXIT_BAD_SPEC
    assert "Traceback (most recent call last)" in result.stderr and "SpecError" in result.stderr
    assert result.stderr.endswith("reward.function=configs/quickstart/reward.py:score: reward.py defines no "
                                  "'score'\n")


SUBMIT = REPO_ROOT / "launch" / "submit.sh"


def submit(tmp_path: Path, *args: str, python: str = sys.executable) -> tuple[subprocess.CompletedProcess, list[str]]:
    """submit.sh with a stand-in sbatch on PATH; returns its result and the commands sbatch was given."""
    calls = tmp_path / "sbatch_calls"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": python, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    written_before = set((REPO_ROOT / "runs" / "slurm").glob("*.sbatch"))
    result = subprocess.run(["bash", str(SUBMIT), "--backend", "slurm", "--config", QUICKSTART, *args], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert set((REPO_ROOT / "runs" / "slurm").glob("*.sbatch")) == written_before  # nothing written
    return result, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("args, culprits", [
    pytest.param(["--", "actor.optim.lrr=1e-6"], ["command line: actor.optim.lrr=1.0e-06: unknown key 'lrr'"],
                 id="submit-bad-override"),
    pytest.param(["--nodes", "3", "--gpus-per-node", "1", "--", "actor.megatron.tensor_model_parallel_size=2"],
                 ["command line: actor.megatron.tensor_model_parallel_size=2: does not divide the 3 trainer CPU ranks"],
                 id="submit-layout-does-not-fit-the-node-count"),
])
def test_submit_validates_the_job_as_submitted_before_writing_or_submitting(tmp_path, args, culprits):
    result, sbatch_calls = submit(tmp_path, *args)
    assert result.returncode == EXIT_BAD_SPEC
    assert sbatch_calls == []
    assert "Traceback" not in result.stderr
    for culprit in culprits:
        assert culprit in result.stderr


def test_submit_without_the_projects_environment_says_so_in_one_line(tmp_path):
    """An interpreter without the project's packages (a bare venv's) cannot validate: one line, no traceback,
    nothing written or submitted."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    python = tmp_path / "bare" / "bin" / "python"
    result, sbatch_calls = submit(tmp_path, python=str(python))
    assert result.returncode == EXIT_BAD_SPEC and sbatch_calls == []
    assert result.stderr == (f"submit.sh: cannot validate the spec with {python} (ModuleNotFoundError: No module "
                             "named 'yaml'); activate the project's environment (source .venv/bin/activate, once "
                             "bash launch/install.sh made it), or set RLM_VENV (or PYTHON) to one\n")


# ---- mistakes the converter, the checkpoint manager and the reward manager report ------------------------------
def _tiny_llama(tmp_path: Path) -> Path:
    from tests.models.tiny_hf import save_tiny_model

    return Path(save_tiny_model("llama", str(tmp_path / "llama")))


def test_convert_refuses_a_tp_that_does_not_divide_the_heads_once(tmp_path, capsys):
    hf = _tiny_llama(tmp_path)
    code = main(["convert", "hf-to-mcore", "--hf-path", str(hf), "--out", str(tmp_path / "out"), "--tp", "3"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_SPEC and "Traceback" not in err
    assert err.count("--tp=3") == 1 and "does not divide the model's 4 attention heads" in err


def test_convert_names_a_truncated_safetensors_file(tmp_path, capsys):
    hf = _tiny_llama(tmp_path)
    shard = hf / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code = main(["convert", "hf-to-mcore", "--hf-path", str(hf), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_SPEC and "Traceback" not in err and "model.safetensors" in err


def test_convert_refuses_in_one_line_with_no_library_notice_before_it(tmp_path):
    """A process of its own: Megatron-Core prints its notices (Transformer Engine missing, ...) once, as it is
    imported, which the checks before any rank do."""
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(QUICKSTART_MODEL / "config.json", hf)
    save_file({"lm_head.weight": torch.zeros(1)}, str(hf / "model.safetensors"))
    result = subprocess.run([sys.executable, "-m", "rlmegatron", "convert", "hf-to-mcore", "--hf-path", str(hf),
                             "--out", str(tmp_path / "out"), "--device", "cpu"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == EXIT_BAD_SPEC
    [line] = result.stderr.splitlines()
    assert line.startswith(f"rlm convert hf-to-mcore: {hf}: 24 HF tensors the qwen3 map needs are absent: ")


def _checkpoint_without_manifest(run_dir: Path) -> Path:
    step = run_dir / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 2}')
    return step


def test_train_refuses_when_no_checkpoint_is_usable(tmp_path, no_launch, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    _checkpoint_without_manifest(tmp_path)
    code = main(["train", QUICKSTART, f"trainer.run_dir={tmp_path}", "trainer.resume=auto"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_SPEC and "Traceback" not in err
    assert "step_2" in err and "trainer.resume=disable" in err


def test_train_refuses_to_resume_from_an_incomplete_checkpoint(tmp_path, no_launch, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    step = _checkpoint_without_manifest(tmp_path)
    code = main(["train", QUICKSTART, f"trainer.run_dir={tmp_path}", f"trainer.resume={step}"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_SPEC and "Traceback" not in err
    assert f"trainer.resume={step}: not a complete checkpoint" in err


def test_a_nan_reward_names_the_function_and_the_sample(tmp_path):
    from rlmegatron.rewards import NaiveRewardManager, RewardInput
    from rlmegatron.rewards.manager import NonFiniteReward

    function = f"{tmp_path / 'nan_reward.py'}:compute_score"
    (tmp_path / "nan_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                            "extra_info=None):\n    return float('nan')\n")
    manager = NaiveRewardManager(function)
    try:
        # Not a UserError: it stops the run as TrainingStopped, exit 3 (tests/driver/test_train.py, [reward]).
        with pytest.raises(NonFiniteReward) as raised:
            manager([RewardInput("echo#7", "echo", "a", "a", 1)])
    finally:
        manager.close()
    assert "nan_reward.py:compute_score" in str(raised.value) and "echo#7" in str(raised.value)


# ---- a run that diverges: exit 3 and one line naming the step and the metric; the last complete checkpoint stays --
# `rlm train` with its one rank in-process (no Ray): 4 prompts x 4 samples a step, half of which earn the reward.
DIVERGING_RUN = ["trainer.total_steps=3", "trainer.save_freq=1", "placement.gpus_per_node=1", "trainer.test_freq=-1",
                 "data.val_files=[]", "trainer.val_before_train=false", "tracking.backends=[console]",
                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "actor.ppo_micro_batch_size_per_gpu=16",
                 "reward.function=tests/driver/parity_reward.py:compute_score"]


@pytest.mark.parametrize("overrides, step, found", [
    # Adam moves each weight by about lr: step 1 trains, step 2's gradients overflow.
    pytest.param(["actor.optim.lr=1e10"], 2, "actor/grad_norm=nan: stopped after the optimizer step, so the "
                 "weights in memory are not usable", id="lr-1e10"),
])
def test_a_divergence_stops_the_run_with_exit_3_naming_the_step_and_the_metric(tmp_path, overrides, step, found):
    run_dir = tmp_path / "run"
    env = {key: value for key, value in os.environ.items() if key != "RLM_DEBUG"}
    # Forked warm (tests/helpers/warm_runs.py): its exit code and last line are the subject, not its imports.
    result = warm_runs.run([sys.executable, "-m", "tests.helpers.cli_without_ray", "train", QUICKSTART,
                            *DIVERGING_RUN, f"trainer.run_dir={run_dir}", *overrides],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == EXIT_TRAINING_STOPPED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last_complete = run_dir / "checkpoints" / f"step_{step - 1}"
    assert result.stderr.splitlines()[-1] == (f"training stopped: step {step}: {found}. No checkpoint is written for "
                                              f"this step; the last complete one is {last_complete}")
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["latest", last_complete.name]
