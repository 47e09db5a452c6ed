"""Pre-launch checks of what a valid spec points at: the model, the tokenizer, the data files, the reward and
dataset plug-ins, the run directory (it can be written to) and the packages of the tracking backends it chooses: the
preflight stage of rlmegatron/prelaunch/spec_pipeline.py, which `rlm validate` and `rlm train` (before Ray or any worker) run.

The spec checks (rlmegatron.config) read nothing but the model's config.json. These load the tokenizer
(transformers), read the first rows of each data file (pyarrow) and import the user's plug-ins, so they live here.
`rlm validate` may run before `rlm prepare` has written the data, or before a hub model is in the local cache:
what is not there yet is a note there, and `rlm train` refuses to start without it.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmegatron.agent.tools import tool_problem
from rlmegatron.config.errors import NO_VALUE, SpecProblem
from rlmegatron.models.families import family_for, read_architecture
from rlmegatron.plugins import plugin_problem
from rlmegatron.rewards.dispatch import builtin_rule
from rlmegatron.checkpoint.run_dir import unwritable
from rlmegatron.tracking.tracker import OPTIONAL_PACKAGES

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec

FIRST_ROWS = 8
"""Rows of each data file checked up front; the dataset, built on the driver before any worker, reads the rest."""
REWARD_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's compute_score
DATASET_ARGUMENTS = ("files", "tokenizer", "config")
# A directory holding none of these has no tokenizer: transformers would build an empty one from config.json alone.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tekken.json")
# What is fetched of a hub id to check it: its config and tokenizer. A model that training loads its weights from
# is fetched whole when the run launches.
HUB_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# Hub ids are `name` or `namespace/name`; anything else (./x, /abs, a/b/c) can only be meant as a directory.
_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")


@dataclass
class Preflight:
    problems: list[SpecProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What is worth knowing but stops nothing: what `rlm validate` cannot check yet (data files not written, hub
    ids not in the cache), a model without an EOS id."""
    tokenizer: Any = None
    """The tokenizer the run uses, once it loaded."""
    snapshots: dict[str, Path] = field(default_factory=dict)
    """Hub id -> the local snapshot it was fetched to: the run reads that directory."""


def preflight(spec: JobSpec, launching: bool) -> Preflight:
    """Every problem of what `spec` points at. `launching`: the run starts next, so whatever is missing is a
    problem (and a hub id may be downloaded) rather than a note."""
    checks = _Checks(spec, launching)
    checks.model()
    checks.scoring_models()
    checks.tokenizer()
    checks.teacher()
    checks.data()
    checks.plugins()
    checks.run_dir()
    checks.trackers()
    return checks.result


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class _Checks:
    def __init__(self, spec: JobSpec, launching: bool) -> None:
        self.spec, self.launching = spec, launching
        self.result = Preflight()
        self.vocab_size: int | None = None
        self.local: dict[str, Path | None] = {}

    def problem(self, field_name: str, value: Any, reason: str) -> None:
        self.result.problems.append(SpecProblem(field_name, value, reason))

    def local_dir(self, field_name: str, path: str) -> Path | None:
        """The local directory `path` names: itself, or a hub id's snapshot (fetched only when launching); None,
        after a problem or a note, when there is none. Each path is looked up, and reported, once."""
        if path not in self.local:
            self.local[path] = self._find_local_dir(field_name, path)
        return self.local[path]

    def _find_local_dir(self, field_name: str, path: str) -> Path | None:
        if Path(path).is_dir():
            return Path(path)
        if Path(path).exists():
            self.problem(field_name, path, "is a file; it must be a directory (an HF checkpoint or tokenizer)")
            return None
        if not _HUB_ID.fullmatch(path):
            self.problem(field_name, path, "no such directory (relative paths start at the working directory)")
            return None
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import LocalEntryNotFoundError

        whole = self.launching and (field_name == "model.path" and not self.spec.model.random_init
                                    or field_name == "teacher.path")
        try:
            snapshot = Path(snapshot_download(path, allow_patterns=None if whole else HUB_PATTERNS,
                                              local_files_only=not self.launching))
            self.result.snapshots[path] = snapshot
            return snapshot
        except Exception as err:  # offline, unknown repo, gated repo, ...: all say the same to the user
            why = ("the hub cannot be reached and it is not in the local cache"
                   if isinstance(err, LocalEntryNotFoundError) else _first_line(err))
            if not self.launching:
                self.result.notes.append(
                    f"note: {field_name}={path}: not a local directory nor in the local Hugging Face cache; "
                    "rlm train fetches it from the hub and refuses to start if it cannot; its config and tokenizer "
                    "are checked then"
                )
                return None
            self.problem(
                field_name, path,
                f"is neither a local directory nor a model the Hugging Face hub provides here ({why}); "
                f"download it (huggingface-cli download {path} --local-dir DIR) and set {field_name} to DIR",
            )
            return None

    def model(self) -> None:
        from rlmegatron.models.hf_config import UnsupportedModelError, model_facts, read_hf_config

        model = self.spec.model
        directory = self.local_dir("model.path", model.path)
        if directory is not None and (Path(model.path).is_dir() or self.launching) and not model.random_init:
            from rlmegatron.models.convert import ConversionError, HFCheckpoint

            try:
                checkpoint = HFCheckpoint(str(directory))
                checkpoint.close()
            except (ConversionError, UnsupportedModelError) as err:
                self.problem("model.path", model.path,
                             f"{str(err).removeprefix(f'{directory} ')}; point it at an HF checkpoint, or set "
                             "model.random_init=true to start from random weights")
            else:
                self.mxfp4_engines(checkpoint, directory)
        # The spec checks have read this config.json: it exists and describes a decoder.
        arch_field, arch_path = model.architecture_source()
        self.vocab_size = read_architecture(arch_path).vocab_size
        hf = read_hf_config(arch_path)
        try:
            model_facts(hf, self.spec.actor.megatron.tensor_model_parallel_size)
        except UnsupportedModelError as err:
            self.problem(arch_field, arch_path, f"{err}; this model cannot be trained here")
        # Read as the family reads config.json: a wrapper's (Kimi-K2.5's) language model keys are in text_config.
        hf = family_for(hf.get("model_type")).config(hf)
        pad = hf.get("pad_token_id")
        if isinstance(pad, int) and not 0 <= pad < self.vocab_size:
            self.problem(arch_field, arch_path,
                         f"pad_token_id={pad} is outside the model's vocabulary (vocab_size {self.vocab_size}); "
                         "prompts are padded with it, so set it to an id below that")
        if hf.get("eos_token_id") is None:
            self.result.notes.append(
                f"note: {arch_field}={arch_path}: config.json sets no eos_token_id, so every response runs to "
                "data.max_response_length tokens"
            )

    def mxfp4_engines(self, checkpoint, directory: Path) -> None:
        """SGLang serves gpt-oss's MXFP4 experts quantised (its MXFP4 MoE parameters), and the weight sync sends the
        trained experts in bf16, which such a server has no parameters for: refused before anything starts."""
        if checkpoint.mxfp4 is None or self.spec.rollout.engine != "sglang":
            return
        self.problem("model.path", self.spec.model.path,
                     "holds MXFP4 experts, which SGLang serves quantised, and the weight sync sends the trained experts "
                     "in bf16, which such a server cannot take; write a bf16 copy (rlm convert hf-to-mcore --hf-path "
                     f"{directory} --out MCORE, then rlm convert mcore-to-hf --mcore-path MCORE --out BF16_DIR) and "
                     "set model.path to it, or use rollout.engine=local")

    def scoring_models(self) -> None:
        """The reward model's and a critic's own checkpoints (the spec checks read their config.json) hold weights
        the loader reads: not quantised in a format other than block-wise FP8 or gpt-oss's MXFP4 experts."""
        from rlmegatron.models.fp8 import BlockFP8, UnsupportedQuantization  # lazy: torch, as the model check's
        from rlmegatron.models.mxfp4 import MXFP4

        spec = self.spec
        paths = {"reward.model.path": spec.reward.model.path,
                 "critic.init_from": spec.critic.init_from if spec.critic.enable and spec.critic.init_from != "actor"
                 else None}
        for field_name, path in paths.items():
            config = Path(path or "") / "config.json"
            if path is None or not config.is_file():
                continue  # none, or the spec checks said so
            try:
                hf = json.loads(config.read_text())
                MXFP4.from_hf_config(hf) or BlockFP8.from_hf_config(hf)
            except UnsupportedQuantization as err:
                self.problem(field_name, path, f"{config}: {err}")

    def tokenizer(self) -> None:
        model = self.spec.model
        field_name = "model.path" if model.tokenizer_path == model.path else "model.tokenizer_path"
        path = self.local_dir(field_name, model.tokenizer_path)
        if path is None:
            return
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            self.problem(field_name, model.tokenizer_path,
                         f"holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...); point "
                         "model.tokenizer_path at the model's tokenizer directory")
            return
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=model.trust_remote_code)
        except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a broken tokenizer
            self.problem(field_name, model.tokenizer_path, f"cannot load its tokenizer ({_first_line(err)})")
            return
        if self.vocab_size is not None and len(tokenizer) > self.vocab_size:
            self.problem(field_name, model.tokenizer_path,
                         f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary "
                         f"(vocab_size {self.vocab_size}), so some token ids have no embedding; use the model's "
                         "own tokenizer")
            return
        data = self.spec.data
        if data.dataset_class is None and data.prompt_format == "chat" and not getattr(tokenizer, "chat_template",
                                                                                        None):
            self.problem(field_name, model.tokenizer_path,
                         f"the tokenizer has no chat template, and the prompts (data.prompt_key={data.prompt_key}) "
                         "are chat messages (data.prompt_format=chat); add a chat_template.jinja (or "
                         "tokenizer_config.json's chat_template) to it, use the model's instruct tokenizer, or set "
                         "data.prompt_format=plain for prompts that are plain text")
            return
        self.result.tokenizer = tokenizer

    def teacher(self) -> None:
        """On-policy distillation's teacher: weights the ranks can load (an HF checkpoint's shards, or a converted
        checkpoint), and the student's tokenizer, since its log-probs are compared with the student's token by
        token, which means the same token ids for the same text."""
        from rlmegatron.models.convert import ConversionError, ConvertMeta, HFCheckpoint  # lazy: torch, as model()'s
        from rlmegatron.models.hf_config import UnsupportedModelError

        spec = self.spec
        student = self.result.tokenizer
        if spec.algorithm.distill is None or spec.teacher.path is None or student is None:
            return
        path = self.local_dir("teacher.path", spec.teacher.path)
        if path is None:
            return
        if not ConvertMeta.written_in(path):
            try:
                HFCheckpoint(str(path)).close()
            except (ConversionError, UnsupportedModelError) as err:
                self.problem("teacher.path", spec.teacher.path,
                             f"{str(err).removeprefix(f'{path} ')}; point it at the teacher's HF checkpoint, or a "
                             "checkpoint written by `rlm convert hf-to-mcore`")
                return
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            self.problem("teacher.path", spec.teacher.path,
                         f"holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...) to compare with the student's; "
                         "copy the teacher's tokenizer files into it")
            return
        from transformers import AutoTokenizer

        try:
            teacher = AutoTokenizer.from_pretrained(str(path), trust_remote_code=spec.model.trust_remote_code)
        except Exception as err:  # as the student's: transformers raises many kinds for a broken tokenizer
            self.problem("teacher.path", spec.teacher.path, f"cannot load its tokenizer ({_first_line(err)})")
            return
        difference = tokenizer_difference(student, teacher)
        if difference:
            self.problem("teacher.path", spec.teacher.path,
                         f"its tokenizer is not the student's (model.tokenizer_path={spec.model.tokenizer_path}): "
                         f"{difference}; distillation compares log-probs token by token, so it needs a teacher with "
                         "the student's tokenizer (cross-tokenizer distillation is not supported)")

    def data(self) -> None:
        data = self.spec.data
        for kind, files in (("train_files", data.train_files), ("val_files", data.val_files)):
            for index, file in enumerate(files):
                field_name = f"data.{kind}[{index}]"
                if not Path(file).exists():
                    if self.launching:
                        self.problem(field_name, file, "no such file (relative paths start at the working "
                                                       "directory; rlm prepare writes prepared datasets)")
                    else:
                        self.result.notes.append(f"note: {field_name}={file}: not found (rlm prepare writes it?); "
                                                 "rlm train refuses to start without it")
                elif not Path(file).is_file():
                    self.problem(field_name, file, "is a directory; name a .parquet or .jsonl file")
                elif data.dataset_class is None:
                    reason = self.first_rows_problem(file)
                    if reason:
                        self.problem(field_name, NO_VALUE, reason)

    def first_rows_problem(self, file: str) -> str | None:
        """Why the first rows of `file` cannot be trained on by the built-in dataset; None if they can."""
        from rlmegatron.data.dataset import DatasetError, PromptEncoder, RowReader, iter_rows

        data, tokenizer = self.spec.data, self.result.tokenizer
        read = RowReader(data)
        encode = PromptEncoder(tokenizer, chat=data.prompt_format == "chat") if tokenizer is not None else None
        rows = 0
        try:
            for location, row in islice(iter_rows([file]), FIRST_ROWS):
                rows += 1
                prompt = read.prompt(row, location)
                read.answer(row, location)
                if encode is not None:
                    length = len(encode(prompt, location))
                    if length > data.max_prompt_length and not data.filter_overlong_prompts:
                        return (f"{location}: the prompt is {length} tokens, over data.max_prompt_length="
                                f"{data.max_prompt_length}; raise it, or set data.filter_overlong_prompts=true")
                source = str(row.get("data_source", ""))
                if self.spec.rule_scores and self.spec.reward.function is None and builtin_rule(source) is None:
                    return (f"{location}: data_source {source!r} has no built-in reward (the built-in rules score "
                            "GSM8K and boxed-answer math); set reward.function=path/to/file.py:compute_score")
        except DatasetError as err:
            return str(err)
        if not rows:
            return f"{file}: has no rows; write the data again (rlm prepare) or remove the file from the list"
        return None

    def plugins(self) -> None:
        for field_name, reference, arguments, call in (
            ("reward.function", self.spec.reward.function, REWARD_ARGUMENTS,
             "reward.function is called like verl's compute_score(data_source, solution_str, ground_truth, "
             "extra_info)"),
            ("data.dataset_class", self.spec.data.dataset_class, DATASET_ARGUMENTS,
             "a dataset class is built as Class(files, tokenizer, config), like rlmegatron.data.RLDataset"),
            ("reward.model.combiner", self.spec.reward.model.combiner, ("model_score", "rule_score", "item"),
             "a combiner is called as combiner(model_score, rule_score, item)"),
        ):
            if reference is None:
                continue
            reason = plugin_problem(reference, arguments)
            if reason:
                hint = f"; {call}" if reason.startswith(("cannot be called", "is not a function")) else ""
                self.problem(field_name, reference, reason + hint)
        for index, tool in enumerate(self.spec.rollout.multi_turn.tools):
            reason = tool_problem(tool.plugin, tool.config)
            if reason:
                self.problem(f"rollout.multi_turn.tools[{index}].plugin", tool.plugin, reason)

    def run_dir(self) -> None:
        # Checked before anything starts: else the first checkpoint or the tracker's store finds out, minutes in.
        run_dir = self.spec.trainer.run_dir
        reason = unwritable(run_dir)
        if reason is None:
            return
        if not self.launching and not Path(run_dir).exists():  # validated elsewhere than it runs (submit.sh)?
            self.result.notes.append(f"note: trainer.run_dir={run_dir}: {reason} here; rlm train refuses to start "
                                     "where it cannot make it")
            return
        self.problem("trainer.run_dir", run_dir, f"{reason}; give a trainer.run_dir this user can write to")

    def trackers(self) -> None:
        # Looked up, not imported: wandb alone takes most of a second to import.
        backends = self.spec.tracking.backends
        for backend in backends:
            package = OPTIONAL_PACKAGES.get(backend)
            if package is not None and importlib.util.find_spec(package) is None:
                self.problem("tracking.backends", backends, f"the {backend} backend needs the {package} package, "
                             f"which is not installed: pip install 'rlmegatron[{backend}]', or drop {backend}")


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """What tells the teacher's tokenizer from the student's: their sizes, the first token they map to different ids,
    or a special token (EOS, BOS, pad) they set differently; None when they are the same."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"{len(theirs)} tokens against the student's {len(ours)}"
    for token, index in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != index:
            where = "is missing" if token not in theirs else f"is id {theirs[token]}"
            return f"token {token!r} (the student's id {index}) {where} there"
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"its {name} is {getattr(teacher, name, None)}, the student's {getattr(student, name, None)}"
    return None
