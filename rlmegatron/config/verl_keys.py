"""verl's command-line keys onto the job spec: one table (VERL_KEYS), which the schema stage of `rlm train|validate|plan
--verl` translates with (rlmegatron/prelaunch/spec_pipeline.py).

Every verl key is one of:
- Maps: it sets spec fields of the same meaning, its value converted where verl spells it differently;
- Always: its value is what rlmegatron always does (accepted, with a printed note), any other value is rejected;
- Follows: rlmegatron derives it from another field; accepted when the value equals that field's, else rejected;
- PartOf: half of a `path` + `name` pair that another key turns into one `file.py:name` field;
- NoMeaning: rejected, naming rlmegatron's equivalent or saying why there is none.
A key found nowhere in the table is applied as an rlmegatron key if it is one (`rollout.engine=local`), else
rejected with the nearest verl key. verl's `actor_rollout_ref` is split into rlmegatron's `actor`, `ref` and
`rollout`; keys under a table key that ends in `.` go to the free-form dict it names (megatron.extra, ...).
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmegatron.config.errors import NO_VALUE, SpecProblem, render_value
from rlmegatron.config.fieldpaths import path_problem
from rlmegatron.config.loader import COMMAND_LINE
from rlmegatron.config.overrides import REMOVE, Override, parse_override
from rlmegatron.config.spec import JobSpec


class Rejected(Exception):
    """Raised by a conversion: this value has no meaning here; the message says what to write instead."""


class Unchanged(Exception):
    """Raised by a conversion: this value asks for what rlmegatron does anyway; the message says so."""


@dataclass(frozen=True)
class Noted:
    """A converted value that comes with a note for the user (the meaning shifts a little)."""

    value: Any
    note: str


@dataclass(frozen=True)
class Context:
    """What a conversion may look at besides its own value: the other verl keys given, and the YAML."""

    given: Mapping[str, Any]
    raw: Mapping[str, Any]

    def model_path(self) -> Any:
        model = self.raw.get("model")
        return self.given.get("actor_rollout_ref.model.path", model.get("path") if isinstance(model, dict) else None)


Convert = Callable[[Any, Context], Any]


@dataclass(frozen=True)
class Maps:
    fields: tuple[str, ...]
    convert: Convert | None = None
    note: str = ""
    split: bool = False
    """The converted value is a sequence, one item per field (verl's betas -> adam_beta1, adam_beta2)."""
    weak: bool = False
    """Yields to another key that sets the same field (verl's clip_ratio to clip_ratio_low/high)."""
    dashed: bool = False
    """For a free-form dict entry (`...extra_args.`): keys below it become SGLang's --dashed-flag names."""


@dataclass(frozen=True)
class Always:
    values: tuple[Any, ...]
    note: str
    otherwise: str = ""
    """Why another value is rejected; defaults to the note."""


@dataclass(frozen=True)
class Follows:
    field: str
    """The spec field rlmegatron uses for this; the verl value must equal its resolved value."""


@dataclass(frozen=True)
class PartOf:
    owner: str
    """The verl key whose conversion reads this one."""


@dataclass(frozen=True)
class NoMeaning:
    reason: str


Entry = Maps | Always | Follows | PartOf | NoMeaning


def _to(*fields: str, **options: Any) -> Maps:
    return Maps(fields, **options)


# --- conversions ---

def _recompute(value: Any, _: Context) -> Any:
    # Activation checkpointing of whole layers is Megatron's full recompute.
    if value is True:
        return Noted("full", "Megatron-Core's full activation recompute of every layer")
    return "none"


def _offload(value: Any, _: Context) -> Any:
    if value is True:
        return Noted(True, "kept in host memory between the phases that use it (not streamed per layer as in FSDP)")
    return value


def _recompute_granularity(value: Any, _: Context) -> str:
    return "none" if value is None else value


def _unless_null(value: Any, _: Context) -> Any:
    if value is None:
        raise Unchanged("null keeps rlmegatron's setting")
    return value


def _kl_estimator(value: Any, _: Context) -> Any:
    # verl spells two of the estimators by their older names.
    return {"kl": "k1", "mse": "k2"}.get(value, value)


def _warmup_steps(value: Any, _: Context) -> Any:
    # verl's -1 means "derive the steps from lr_warmup_steps_ratio", whose default is 0.
    return 0 if value == -1 else value


def _min_lr_from_ratio(value: Any, _: Context) -> float:
    if value in (None, 0, 0.0):
        return 0.0
    raise Rejected("set the role's optim.min_lr instead (an absolute learning rate: min_lr_ratio × lr)")


def _betas(value: Any, _: Context) -> Any:
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        raise Rejected("must be a list of two numbers, [beta1, beta2]")
    return tuple(value)


def _dtype(value: Any, _: Context) -> Any:
    names = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}
    if value not in names:
        raise Rejected(f"use one of {', '.join(names)}")
    return Noted(names[value], "one dtype for every role and the engines: model.dtype")


def _engine(value: Any, _: Context) -> Any:
    if value == "sglang":
        return value
    if value == "vllm":
        return Noted("sglang", "vLLM is not used here: rollouts are served by SGLang with the same sampling")
    if value == "hf":
        return Noted("local", "verl's hf rollout is rlmegatron's in-process transformers engine")
    raise Rejected("use sglang (GPU servers) or hf (rlmegatron's local engine)")


def _token_tis(value: Any, _: Context) -> tuple[Any, Any]:
    # verl's older knob is token-level truncated importance sampling; -1 (its default) turns it off.
    if value is None or value == -1:
        raise Unchanged("no truncated importance sampling")
    return Noted(("token", value), "token-level truncated importance sampling "
                                   "(algorithm.rollout_correction.rollout_is=token)")


def _colocate(value: Any, _: Context) -> str:
    if value is True:
        return "colocate"
    raise Rejected("give the engines their own GPUs with placement.mode=disaggregate, "
                   "placement.rollout_nnodes and placement.rollout_gpus_per_node")


def _greedy_unless_sampling(what: str) -> Convert:
    def convert(value: Any, _: Context) -> float:
        if value is True:
            raise Unchanged(f"it samples at {what}")
        return 0.0  # verl's do_sample=False is greedy decoding
    return convert


def _flag_when_true(meaning: str) -> Convert:
    def convert(value: Any, _: Context) -> bool:
        if value is True:
            return True
        raise Unchanged(meaning)
    return convert


def _flag_when_false(meaning: str) -> Convert:
    def convert(value: Any, _: Context) -> bool:
        if value is False:
            return True
        raise Unchanged(meaning)
    return convert


def _sglang_load_format(value: Any, _: Context) -> Any:
    # verl's dummy_* formats all mean random weights until the first sync, which is SGLang's dummy.
    return "dummy" if isinstance(value, str) and value.startswith("dummy") else value


def _quantization(value: Any, _: Context) -> Any:
    if value in (None, False, "none"):
        return "none"
    if value == "fp8":
        return Noted("fp8", "block-wise FP8 weights in the engines, the trainer's bf16 quantised at each sync")
    raise Rejected("engines serve model.dtype weights or block-wise fp8 (rlmegatron's rollout.quantization); "
                   "use fp8 or null")


def _trace_backend(value: Any, _: Context) -> Any:
    if value == "weave":
        raise Rejected("weave is not supported; use mlflow (a table and a text file per step), wandb (a table), "
                       "tensorboard (a text summary) or console")
    return value


def _tracking_backends(value: Any, _: Context) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    unsupported = [name for name in names if name not in ("console", "mlflow", "wandb", "tensorboard")]
    if unsupported:
        raise Rejected(f"rlmegatron tracks to console, mlflow, wandb and tensorboard only; drop "
                       f"{', '.join(map(str, unsupported))}")
    return names


def _resume_mode(value: Any, ctx: Context) -> Any:
    if value in ("auto", "disable"):
        return value
    if value == "resume_path":
        if "trainer.resume_from_path" not in ctx.given:
            raise Rejected("needs trainer.resume_from_path=PATH (rlmegatron's trainer.resume=PATH)")
        return ctx.given["trainer.resume_from_path"]
    raise Rejected("use auto, disable or resume_path")


def _plugin(owner: str, default_name: str | None) -> Convert:
    """verl's `X.path` + `X.name` -> rlmegatron's `path.py:name`."""
    name_key = owner.removesuffix(".path") + ".name"

    def convert(value: Any, ctx: Context) -> Any:
        if value is None:
            return None
        name = ctx.given.get(name_key, default_name)
        if name is None:
            raise Rejected(f"needs {name_key} too (the class or function in the file)")
        return f"{value}:{name}"
    return convert


# verl names the HF modules that get LoRA adapters; Megatron-Core fuses q/k/v into one linear and gate/up into another.
_LORA_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "qkv_proj": "linear_qkv",
                 "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
                 "gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}
_FUSED = {"linear_qkv": {"q_proj", "k_proj", "v_proj"}, "linear_fc1": {"gate_proj", "up_proj"}}


def _lora_targets(value: Any, _: Context) -> Any:
    """verl's target_modules (all-linear, or HF module names) -> actor.lora.target_modules (Megatron's linears)."""
    if value == "all-linear":
        return list(dict.fromkeys(_LORA_TARGETS.values()))
    names = [value] if isinstance(value, str) else value
    unknown = [name for name in names if name not in _LORA_TARGETS] if isinstance(names, list) else [names]
    if unknown:
        raise Rejected(f"adapters go on all-linear or on {', '.join(_LORA_TARGETS)}; not on "
                       f"{', '.join(map(str, unknown))}")
    targets = list(dict.fromkeys(_LORA_TARGETS[name] for name in names))
    widened = [linear for linear in targets if linear in _FUSED and not _FUSED[linear] <= set(names)]
    if widened:
        return Noted(targets, f"Megatron-Core fuses {', '.join(' and '.join(sorted(_FUSED[l])) for l in widened)} "
                              f"into one linear each, so the adapters cover all of them (actor.lora.target_modules="
                              f"{render_value(targets)})")
    return targets


def _reward_model_enable(value: Any, ctx: Context) -> Any:
    """verl's switch; rlmegatron's is whether reward.model.path is set (from reward_model.model.path)."""
    reward = ctx.raw.get("reward")
    in_yaml = isinstance(reward, dict) and isinstance(reward.get("model"), dict) and reward["model"].get("path")
    path = ctx.given.get("reward_model.model.path", in_yaml)
    if value is True and not path:
        raise Rejected("needs reward_model.model.path (rlmegatron's reward.model.path), the model that scores")
    if value is False and path:
        raise Rejected("but a reward model's path is set (reward.model.path); drop one of them")
    raise Unchanged("a reward model scores when reward.model.path is set; its score alone is the reward, as in verl "
                    "(reward.model.weight=1, rule_weight=0)" if value else "rewards come from reward functions")


def _same_tokenizer_or_not(value: Any, _: Context) -> Any:
    raise Unchanged("the reward model re-encodes prompt + response with its own tokenizer where it differs from the "
                    "policy's")


def _critic_init(value: Any, ctx: Context) -> Any:
    if value == ctx.model_path():
        return Noted("actor", "the critic starts from the policy's weights (critic.init_from=actor)")
    return value


# --- the table ---

_FSDP_ONLY = ("an FSDP setting; rlmegatron shards with Megatron-Core, so set the role's megatron section "
              "(e.g. actor.megatron.tensor_model_parallel_size) instead")
# Each micro-batch is laid out as it pays (rank/roles/megatron_step.shard_micro_batches): no switch to set.
_PACKING = Always((True, False), "each micro-batch is THD-packed or right-padded, whichever costs less compute")
_CRITIC_LORA = "LoRA adapters are the actor's (actor.lora); the critic trains every weight"
_CHECKPOINTS = ("checkpoints always hold the model, the optimizer and the trainer state; "
                "trainer.save_freq and trainer.max_ckpt_to_keep set when and how many")
_PROFILER = "profiling is not built in; run under nsys or torch.profiler yourself"
_SINGLE_TURN = ("verl's multi-turn and agent-loop keys do not translate one to one: list the tools (plug-in classes) in "
                "rollout.multi_turn.tools and set rollout.multi_turn.max_turns and max_tool_response_length")
_REWARD_MODEL = ("a reward-model setting without an rlmegatron key; reward.model holds the reward model's: path, "
                 "micro_batch_size_per_gpu, tensor_model_parallel_size, sequence_parallel, offload.params")


def _optim(verl: str, ours: str) -> dict[str, Entry]:
    return {
        f"{verl}.lr": _to(f"{ours}.lr"),
        f"{verl}.weight_decay": _to(f"{ours}.weight_decay"),
        f"{verl}.lr_warmup_steps": _to(f"{ours}.lr_warmup_steps", convert=_warmup_steps),
        f"{verl}.lr_warmup_steps_ratio": Always(
            (0, 0.0), "no warmup ratio: warmup is a number of steps",
            f"set {verl}.lr_warmup_steps (rlmegatron's {ours}.lr_warmup_steps), a number of steps"),
        f"{verl}.warmup_style": _to(f"{ours}.lr_decay_style"),
        f"{verl}.lr_scheduler_type": _to(f"{ours}.lr_decay_style"),
        f"{verl}.lr_decay_style": _to(f"{ours}.lr_decay_style"),
        f"{verl}.min_lr": _to(f"{ours}.min_lr"),
        f"{verl}.min_lr_ratio": _to(f"{ours}.min_lr", convert=_min_lr_from_ratio),
        f"{verl}.clip_grad": _to(f"{ours}.clip_grad"),
        f"{verl}.betas": _to(f"{ours}.adam_beta1", f"{ours}.adam_beta2", convert=_betas, split=True),
        f"{verl}.optimizer": Always(("adam",), "the optimizer is Adam(W)", "only adam is supported"),
        f"{verl}.total_training_steps": Always(
            (-1, None), "the schedule spans the run (trainer.total_steps, else trainer.total_epochs)",
            "the schedule spans the run; set trainer.total_training_steps (rlmegatron's trainer.total_steps)"),
        f"{verl}.lr_decay_steps": Always((None,), "the schedule decays over the whole run",
                                         "the schedule decays over the whole run; set trainer.total_steps"),
    }


def _megatron(verl: str, role: str, offload: tuple[str, ...]) -> dict[str, Entry]:
    """A role's verl `megatron` section; `offload` lists the parts its rlmegatron offload section has."""
    ours = f"{role}.megatron"
    entries: dict[str, Entry] = {
        f"{verl}.{name}": _to(f"{ours}.{name}")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "sequence_parallel", "use_distributed_optimizer")
    }
    parts = {"param_offload": "params", "grad_offload": "grads", "optimizer_offload": "optimizer"}
    for key, part in parts.items():
        entries[f"{verl}.{key}"] = (_to(f"{role}.offload.{part}", convert=_offload) if part in offload else Always(
            (False,), f"the {role} has no {part} to offload", f"the {role} has no {part} to offload; drop the key"))
    otc = f"{verl}.override_transformer_config"
    entries.update({
        f"{verl}.seed": _to("trainer.seed", note="one seed for the whole run: trainer.seed"),
        f"{verl}.dtype": _to("model.dtype", convert=_dtype),
        f"{otc}.recompute_granularity": _to(f"{ours}.recompute_granularity", convert=_recompute_granularity),
        f"{otc}.recompute_method": _to(f"{ours}.recompute_method", convert=_unless_null),
        f"{otc}.recompute_num_layers": _to(f"{ours}.recompute_num_layers", convert=_unless_null),
        f"{otc}.": _to(f"{ours}.extra."),
        f"{verl}.use_mbridge": Always((True, False), "HF weights are converted by rlmegatron's own weight maps"),
        f"{verl}.use_dist_checkpointing": Always(
            (False,), "the model starts from model.path (HF weights)",
            "the model starts from model.path (HF weights); `rlm convert mcore-to-hf` turns a Megatron checkpoint "
            "into one"),
        f"{verl}.dist_checkpointing_path": Always((None,), "the model starts from model.path",
                                                  "the model starts from model.path; `rlm convert mcore-to-hf` "
                                                  "turns a Megatron checkpoint into one"),
        f"{verl}.override_ddp_config": NoMeaning(f"DDP is set up by rlmegatron; the one choice is "
                                                 f"{ours}.use_distributed_optimizer"),
        f"{verl}.override_mcore_model_config": NoMeaning(f"Megatron settings go in {ours}.extra"),
        f"{verl}.forward_only": NoMeaning("rlmegatron knows which roles train"),
    })
    return entries


def _fsdp(verl: str, role: str, offload: tuple[str, ...]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {
        verl: NoMeaning(_FSDP_ONLY),
        f"{verl}.param_offload": _to(f"{role}.offload.params", convert=_offload),
        f"{verl}.offload_policy": Always((False,), "no FSDP CPU offload policy", _FSDP_ONLY),
        f"{verl}.model_dtype": _to("model.dtype", convert=_dtype),
    }
    if "optimizer" in offload:
        entries[f"{verl}.optimizer_offload"] = _to(f"{role}.offload.optimizer", convert=_offload)
    return entries


def _common_role(verl: str) -> dict[str, Entry]:
    """Keys every trained or log-prob role of verl has and rlmegatron answers the same way."""
    return {
        f"{verl}.strategy": Always(("megatron",), "roles always run on Megatron-Core",
                                   "rlmegatron always trains with Megatron-Core; drop the key (the fsdp_config "
                                   "offload keys map onto the role's offload section)"),
        f"{verl}.use_torch_compile": Always((False,), "nothing is torch.compiled", "nothing is torch.compiled here"),
        f"{verl}.ulysses_sequence_parallel_size": Always(
            (1,), "no Ulysses sequence parallelism",
            "use the role's megatron.context_parallel_size: Megatron-Core's context parallelism splits each "
            "sequence over ranks"),
        f"{verl}.entropy_from_logits_with_chunking": Always((False,), "entropy is computed vocab-parallel",
                                                             "entropy is always computed vocab-parallel"),
        f"{verl}.entropy_checkpointing": Always((False,), "entropy is computed vocab-parallel",
                                                "entropy is always computed vocab-parallel"),
        f"{verl}.checkpoint": NoMeaning(_CHECKPOINTS),
        f"{verl}.profiler": NoMeaning(_PROFILER),
    }


def _model(verl: str, lora: bool) -> dict[str, Entry]:
    """A model section of verl's; `lora`: its LoRA keys are the actor's adapters (else refused: only the actor has
    them)."""
    lora_entries: dict[str, Entry] = {
        f"{verl}.lora_rank": _to("actor.lora.rank"),
        f"{verl}.lora_alpha": _to("actor.lora.alpha"),
        f"{verl}.target_modules": _to("actor.lora.target_modules", convert=_lora_targets),
        f"{verl}.exclude_modules": Always((None,), "no module is excluded",
                                          "narrow actor_rollout_ref.model.target_modules (rlmegatron's "
                                          "actor.lora.target_modules) instead"),
    } if lora else {
        f"{verl}.lora_rank": Always((0,), "every weight is trained", _CRITIC_LORA),
        f"{verl}.lora_alpha": NoMeaning(_CRITIC_LORA),
        f"{verl}.target_modules": NoMeaning(_CRITIC_LORA),
        f"{verl}.exclude_modules": NoMeaning(_CRITIC_LORA),
    }
    return {
        **lora_entries,
        f"{verl}.use_remove_padding": _PACKING,
        f"{verl}.external_lib": Always((None,), "no external library",
                                       "import your code through a plug-in (reward.function, data.dataset_class)"),
        f"{verl}.override_config": Always(({},), "the architecture is model.path's config.json",
                                          "the architecture comes from the config.json at model.path (or "
                                          "model.hf_config); Megatron settings go in actor.megatron.extra"),
        f"{verl}.use_shm": Always((False,), "the model is read from model.path", "shared-memory loading is not "
                                  "supported; the model is read from model.path"),
        f"{verl}.enable_activation_offload": Always(
            (False,), "activations stay on the GPU",
            "activation offload is not supported; actor.megatron.recompute_granularity=full saves that memory"),
        f"{verl}.use_liger": Always((False,), "no Liger kernels", "Liger kernels are for HF models; rlmegatron's "
                                    "are Megatron-Core models"),
        f"{verl}.use_fused_kernels": Always(
            (False,), "no fused-kernel switch",
            "log-probs and entropy are always computed vocab-parallel in Megatron-Core; there is no fused-kernel "
            "switch"),
        f"{verl}.fused_kernel_options": NoMeaning("there is no fused-kernel switch"),
    }


VERL_KEYS: dict[str, Entry] = {
    # --- data ---
    **{f"data.{name}": _to(f"data.{name}") for name in (
        "train_files", "val_files", "prompt_key", "max_prompt_length", "max_response_length", "train_batch_size",
        "val_batch_size", "shuffle", "seed", "filter_overlong_prompts")},
    "data.tokenizer": _to("model.tokenizer_path"),
    "data.trust_remote_code": _to("model.trust_remote_code"),
    "data.truncation": Always(("error",), "a prompt longer than data.max_prompt_length is an error, unless "
                              "data.filter_overlong_prompts drops it",
                              "prompts are never truncated; set data.filter_overlong_prompts=true to drop long ones"),
    "data.reward_fn_key": Always(("data_source",), "rewards are chosen by each row's data_source",
                                 "rewards are always chosen by each row's data_source column"),
    "data.custom_cls.path": _to("data.dataset_class", convert=_plugin("data.custom_cls.path", None)),
    "data.custom_cls.name": PartOf("data.custom_cls.path"),
    "data.filter_overlong_prompts_workers": NoMeaning("the filter runs in one process as the dataset loads"),
    "data.dataloader_num_workers": NoMeaning("prompts are read in the driver; there are no loader workers"),
    "data.use_shm": Always((False,), "data files are read directly", "shared-memory loading is not supported"),
    "data.return_raw_input_ids": NoMeaning("rollouts always take the chat-templated token ids from the dataset"),
    "data.return_raw_chat": NoMeaning("rollouts always take the chat-templated token ids from the dataset"),
    "data.return_full_prompt": NoMeaning("rollouts always take the chat-templated token ids from the dataset"),
    "data.validation_shuffle": Always((False,), "validation runs over data.val_files in order",
                                      "validation always runs over data.val_files in order"),
    "data.train_max_samples": Always((-1, None), "every row is used",
                                     "every row is used; write a smaller file to train on fewer"),
    "data.val_max_samples": Always((-1, None), "every row is used",
                                   "every row is used; write a smaller file to validate on fewer"),
    "data.apply_chat_template_kwargs": Always(({},), "the chat template gets no extra arguments",
                                              "the tokenizer's chat template is applied without extra arguments"),
    "data.sampler": NoMeaning("batches come from rlmegatron's resumable sampler (data.shuffle, data.seed)"),
    "data.datagen": NoMeaning("the training set is data.train_files; there is no generator"),
    "data.image_key": _to("data.image_key"),
    "data.video_key": NoMeaning("videos are not read; a row's images are (data.image_key)"),
    "data.return_multi_modal_inputs": Always((True,), "a row's images reach the model through its image processor",
                                             "a row's images always reach the model through its image processor"),

    # --- actor_rollout_ref: the policy model ---
    "actor_rollout_ref.model.path": _to("model.path"),
    "actor_rollout_ref.model.trust_remote_code": _to("model.trust_remote_code"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": _to(
        "actor.megatron.recompute_granularity", convert=_recompute, weak=True),
    "actor_rollout_ref.model.custom_chat_template": Always(
        (None,), "the tokenizer's chat template is applied",
        "the tokenizer's own chat template is applied; put yours in the tokenizer directory (model.tokenizer_path)"),
    **_model("actor_rollout_ref.model", lora=True),
    "actor_rollout_ref.hybrid_engine": _to(
        "placement.mode", convert=_colocate, note="the engines share the trainer GPUs (placement.mode=colocate)"),
    "actor_rollout_ref.nccl_timeout": NoMeaning("collectives use the process group's default timeout"),

    # --- actor_rollout_ref.actor ---
    **{f"actor_rollout_ref.actor.{name}": _to(f"actor.{name}") for name in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff",
        "use_kl_loss", "kl_loss_coef")},
    "actor_rollout_ref.actor.tis_imp_ratio_cap": _to(
        "algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold",
        convert=_token_tis, split=True),
    "actor_rollout_ref.actor.kl_loss_type": _to("actor.kl_loss_type", convert=_kl_estimator),
    "actor_rollout_ref.actor.clip_ratio": _to("actor.clip_ratio_low", "actor.clip_ratio_high", weak=True),
    "actor_rollout_ref.actor.grad_clip": _to("actor.optim.clip_grad"),
    # Policy losses (actor.policy_loss, landing from the policy-loss registry work).
    **{f"actor_rollout_ref.actor.policy_loss.{name}": _to(f"actor.policy_loss.{name}") for name in (
        "loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    "actor_rollout_ref.actor.ppo_micro_batch_size": NoMeaning(
        "verl's global micro-batch size; set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu "
        "(rlmegatron's actor.ppo_micro_batch_size_per_gpu)"),
    "actor_rollout_ref.actor.shuffle": Always((False,), "mini-batches are taken in rollout order",
                                              "mini-batches are always taken in rollout order"),
    "actor_rollout_ref.actor.load_weight": Always((True,), "the actor starts from model.path",
                                                  "set model.random_init=true to start from random weights"),
    "actor_rollout_ref.actor.use_fused_kernels": Always((False,), "no fused-kernel switch",
                                                        "log-probs and entropy are always computed vocab-parallel"),
    **_common_role("actor_rollout_ref.actor"),
    **_optim("actor_rollout_ref.actor.optim", "actor.optim"),
    **_fsdp("actor_rollout_ref.actor.fsdp_config", "actor", ("params", "grads", "optimizer")),
    **_megatron("actor_rollout_ref.actor.megatron", "actor", ("params", "grads", "optimizer")),

    # --- actor_rollout_ref.ref ---
    **{f"actor_rollout_ref.ref.{name}": _to(f"ref.{name}") for name in (
        "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")},
    "actor_rollout_ref.ref.log_prob_micro_batch_size": NoMeaning(
        "verl's global micro-batch size; set actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu "
        "(rlmegatron's ref.log_prob_micro_batch_size_per_gpu)"),
    "actor_rollout_ref.ref.model": Always((None,), "the reference is the initial policy (model.path)",
                                          "the reference is always the initial policy (model.path)"),
    "actor_rollout_ref.ref.load_weight": Always((True,), "the reference starts from model.path",
                                                "the reference always starts from model.path"),
    **_common_role("actor_rollout_ref.ref"),
    **_fsdp("actor_rollout_ref.ref.fsdp_config", "ref", ("params",)),
    **_megatron("actor_rollout_ref.ref.megatron", "ref", ("params",)),

    # --- actor_rollout_ref.rollout ---
    "actor_rollout_ref.rollout.name": _to("rollout.engine", convert=_engine),
    "actor_rollout_ref.rollout.mode": Always(("async", "sync"), "the driver sends the engines every request at once"),
    **{f"actor_rollout_ref.rollout.{name}": _to(f"rollout.{name}") for name in (
        "temperature", "top_k", "top_p", "n", "expert_parallel_size", "log_prob_micro_batch_size_per_gpu")},
    **{f"actor_rollout_ref.rollout.val_kwargs.{name}": _to(f"rollout.val_kwargs.{name}") for name in (
        "temperature", "top_k", "top_p", "n")},
    "actor_rollout_ref.rollout.do_sample": _to(
        "rollout.temperature", convert=_greedy_unless_sampling("rollout.temperature")),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": _to(
        "rollout.val_kwargs.temperature", convert=_greedy_unless_sampling("rollout.val_kwargs.temperature")),
    "actor_rollout_ref.rollout.response_length": _to("rollout.max_new_tokens"),
    "actor_rollout_ref.rollout.prompt_length": Follows("data.max_prompt_length"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": _to("rollout.tensor_parallel_size"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": _to(
        "rollout.mem_fraction_static",
        note="SGLang's mem_fraction_static: the share of GPU memory an engine takes for weights and KV cache"),
    "actor_rollout_ref.rollout.dtype": _to("model.dtype", convert=_dtype),
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": _to("rollout.update_weights_bucket_mb"),
    "actor_rollout_ref.rollout.load_format": _to("rollout.sglang.load_format", convert=_sglang_load_format),
    "actor_rollout_ref.rollout.skip_tokenizer_init": _to("rollout.sglang.skip_tokenizer_init"),
    "actor_rollout_ref.rollout.enforce_eager": _to(
        "rollout.sglang.extra_args.disable-cuda-graph",
        convert=_flag_when_true("SGLang captures CUDA graphs by default")),
    "actor_rollout_ref.rollout.enable_prefix_caching": _to(
        "rollout.sglang.extra_args.disable-radix-cache",
        convert=_flag_when_false("SGLang's radix cache reuses shared prefixes by default")),
    "actor_rollout_ref.rollout.enable_chunked_prefill": Always(
        (True,), "SGLang chunks long prefills by default",
        "set rollout.sglang.extra_args.chunked-prefill-size=-1 to turn SGLang's chunked prefill off"),
    "actor_rollout_ref.rollout.max_num_seqs": _to(
        "rollout.sglang.extra_args.max-running-requests", note="SGLang's name for vLLM's max_num_seqs"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": NoMeaning(
        "a vLLM scheduler setting; SGLang's nearest are rollout.sglang.extra_args.max-prefill-tokens and "
        "chunked-prefill-size"),
    "actor_rollout_ref.rollout.max_model_len": NoMeaning(
        "an engine serves prompts of data.max_prompt_length plus rollout.max_new_tokens; SGLang's context length "
        "is the model's"),
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": Always(
        (None,), "SGLang picks its CUDA-graph batch sizes",
        "set rollout.sglang.extra_args.cuda-graph-bs-decode (a list of batch sizes) instead"),
    # verl passes SGLang's keyword names; rlmegatron's server takes them as --dashed-flags.
    "actor_rollout_ref.rollout.engine_kwargs.sglang.": _to("rollout.sglang.extra_args.", dashed=True),
    "actor_rollout_ref.rollout.engine_kwargs.vllm": NoMeaning(
        "vLLM is not used; SGLang flags go in actor_rollout_ref.rollout.engine_kwargs.sglang.* "
        "(rlmegatron's rollout.sglang.extra_args)"),
    "actor_rollout_ref.rollout.free_cache_engine": Always(
        (True,), "colocated engines release their memory while the trainer runs",
        "colocated engines always release their memory while the trainer runs; use placement.mode=disaggregate "
        "to keep engines resident"),
    "actor_rollout_ref.rollout.multi_stage_wake_up": Always(
        (True,), "colocated engines take their weights back before the update and their KV cache after it",
        "colocated engines always wake in two stages (weights, then KV cache after the update)"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": NoMeaning(
        "verl's global micro-batch size; set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu "
        "(rlmegatron's rollout.log_prob_micro_batch_size_per_gpu)"),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": Follows("actor.use_dynamic_bsz"),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": Follows("actor.ppo_max_token_len_per_gpu"),
    "actor_rollout_ref.rollout.calculate_log_probs": Always(
        (True, False), "the engines always return the sampled tokens' log-probs (algorithm.rollout_correction uses them)"),
    "actor_rollout_ref.rollout.ignore_eos": Always((False,), "generation stops at EOS",
                                                   "generation always stops at EOS or rollout.max_new_tokens"),
    "actor_rollout_ref.rollout.data_parallel_size": Always(
        (1,), "each engine is one tensor-parallel group; the rollout GPUs make several engines",
        "each engine is one tensor-parallel group; set rollout.num_gpus and rollout.tensor_parallel_size"),
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": Always((1,), "engines use tensor parallelism only",
                                                                     "engines use tensor parallelism only"),
    "actor_rollout_ref.rollout.over_sample_rate": Always((0,), "every request is awaited",
                                                         "every request is awaited; there is no over-sampling"),
    "actor_rollout_ref.rollout.skip_rollout": Always((False,), "every step generates",
                                                     "rollouts are never skipped or replayed from disk"),
    "actor_rollout_ref.rollout.quantization": _to("rollout.quantization", convert=_quantization),
    "actor_rollout_ref.rollout.layered_summon": NoMeaning("weights stream to the engines bucket by bucket "
                                                          "(rollout.update_weights_bucket_mb)"),
    "actor_rollout_ref.rollout.disable_log_stats": NoMeaning("engine statistics stay in the engines' own logs"),
    "actor_rollout_ref.rollout.multi_turn": NoMeaning(_SINGLE_TURN),
    "actor_rollout_ref.rollout.agent": NoMeaning(_SINGLE_TURN),
    "actor_rollout_ref.rollout.trace.backend": _to("tracking.rollout_trace.backend", convert=_trace_backend),
    "actor_rollout_ref.rollout.trace.token2text": Always(
        (True,), "traced samples are always decoded to text", "traced samples are always decoded to text"),
    "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker": _to(
        "tracking.rollout_trace.prompts_per_step",
        note="the driver logs this many prompts per step in all (not per worker), each with its rollout.n samples"),
    "actor_rollout_ref.rollout.prometheus": NoMeaning("engine metrics are not exported"),
    "actor_rollout_ref.rollout.profiler": NoMeaning(_PROFILER),

    # --- critic ---
    "critic.enable": _to("critic.enable"),
    **{f"critic.{name}": _to(f"critic.{name}") for name in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "cliprange_value")},
    "critic.grad_clip": _to("critic.optim.clip_grad"),
    "critic.ppo_micro_batch_size": NoMeaning(
        "verl's global micro-batch size; set critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_micro_batch_size": NoMeaning(
        "verl's global micro-batch size; the value pass uses critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_micro_batch_size_per_gpu": Follows("critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_max_token_len_per_gpu": Follows("critic.ppo_max_token_len_per_gpu"),
    "critic.loss_agg_mode": Follows("actor.loss_agg_mode"),
    "critic.rollout_n": Follows("rollout.n"),
    "critic.shuffle": Always((False,), "mini-batches are taken in rollout order",
                             "mini-batches are always taken in rollout order"),
    "critic.load_weight": Always((True,), "the critic starts from critic.init_from",
                                 "the critic always starts from critic.init_from"),
    **_common_role("critic"),
    "critic.model.path": _to("critic.init_from", convert=_critic_init),
    "critic.model.tokenizer_path": Follows("model.tokenizer_path"),
    "critic.model.trust_remote_code": Follows("model.trust_remote_code"),
    "critic.model.enable_gradient_checkpointing": _to(
        "critic.megatron.recompute_granularity", convert=_recompute, weak=True),
    **_model("critic.model", lora=False),
    **_optim("critic.optim", "critic.optim"),
    **_fsdp("critic.model.fsdp_config", "critic", ("params", "grads", "optimizer")),
    **_megatron("critic.megatron", "critic", ("params", "grads", "optimizer")),

    # --- rewards ---
    "custom_reward_function.path": _to("reward.function", convert=_plugin("custom_reward_function.path",
                                                                          "compute_score")),
    "custom_reward_function.name": PartOf("custom_reward_function.path"),
    "reward_model": NoMeaning(_REWARD_MODEL),
    "reward_model.enable": _to("reward.model.path", convert=_reward_model_enable),
    "reward_model.model.path": _to("reward.model.path"),
    "reward_model.model.input_tokenizer": _to("reward.model.path", convert=_same_tokenizer_or_not),
    "reward_model.model.trust_remote_code": Follows("model.trust_remote_code"),
    "reward_model.model.use_remove_padding": _PACKING,
    "reward_model.model.fsdp_config.param_offload": _to("reward.model.offload.params", convert=_offload),
    "reward_model.micro_batch_size_per_gpu": _to("reward.model.micro_batch_size_per_gpu"),
    "reward_model.micro_batch_size": NoMeaning(
        "verl's global micro-batch size; set reward_model.micro_batch_size_per_gpu (rlmegatron's "
        "reward.model.micro_batch_size_per_gpu)"),
    "reward_model.megatron.tensor_model_parallel_size": _to("reward.model.tensor_model_parallel_size"),
    "reward_model.megatron.sequence_parallel": _to("reward.model.sequence_parallel"),
    "reward_model.megatron.param_offload": _to("reward.model.offload.params", convert=_offload),
    "reward_model.reward_manager": _to("reward.manager"),
    "reward_model.launch_reward_fn_async": Always(
        (False,), "responses are scored once generation ends, in the driver or in reward.num_workers processes",
        "responses are scored once generation ends; set reward.num_workers to score in worker processes"),
    **{f"{prefix}.{verl}": _to(f"reward.overlong_buffer.{ours}")
       for prefix in ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg")
       for verl, ours in (("enable", "enable"), ("len", "length"), ("penalty_factor", "penalty_factor"))},
    **{f"{prefix}.log": Always((True, False), "the dapo manager always logs reward/overlong_* metrics")
       for prefix in ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg")},
    "reward_model.reward_kwargs.max_resp_len": Follows("data.max_response_length"),

    # --- algorithm ---
    **{f"algorithm.{name}": _to(f"algorithm.{name}") for name in (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward",
        "kl_ctrl.type", "kl_ctrl.kl_coef", "kl_ctrl.horizon", "kl_ctrl.target_kl")},
    "algorithm.kl_penalty": _to("algorithm.kl_penalty", convert=_kl_estimator),
    "algorithm.filter_groups.enable": _to("algorithm.dynamic_sampling.enable"),
    "algorithm.filter_groups.max_num_gen_batches": _to("algorithm.dynamic_sampling.max_num_gen_batches"),
    "algorithm.filter_groups.metric": Always(
        ("acc",), "groups are kept when their reward-function scores (before any overlong penalty) differ",
        "groups are always compared on their reward-function scores before any penalty (verl's acc)"),
    "algorithm.use_pf_ppo": Always((False,), "every sample is trained on", "PF-PPO reweighting is not supported"),
    "algorithm.pf_ppo": NoMeaning("PF-PPO reweighting is not supported"),
    "algorithm.rollout_correction.bypass_mode": Always(
        (False,), "the trainer recomputes the old log-probs; the rollout's are the behaviour policy's",
        "the old log-probs are always the trainer's own, recomputed; the rollout's only weigh or reject samples"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": Always(
        (False,), "importance weights are not normalised over the batch",
        "importance weights are truncated or masked, never normalised over the batch"),

    # --- trainer ---
    **{f"trainer.{name}": _to(f"trainer.{name}") for name in (
        "total_epochs", "save_freq", "test_freq", "val_before_train", "experiment_name", "critic_warmup")},
    "trainer.total_training_steps": _to("trainer.total_steps"),
    "trainer.project_name": _to("tracking.project_name"),
    "trainer.logger": _to("tracking.backends", convert=_tracking_backends),
    "trainer.nnodes": _to("placement.nnodes"),
    "trainer.n_gpus_per_node": _to("placement.gpus_per_node"),
    "trainer.device": _to("placement.device"),
    "trainer.default_local_dir": _to(
        "trainer.run_dir", note="checkpoints go to its checkpoints/ folder, beside the run's MLflow store"),
    "trainer.resume_mode": _to("trainer.resume", convert=_resume_mode),
    "trainer.resume_from_path": _to("trainer.resume"),
    "trainer.max_actor_ckpt_to_keep": _to(
        "trainer.max_ckpt_to_keep", note="one limit for whole checkpoints (actor and critic together)"),
    "trainer.max_critic_ckpt_to_keep": _to(
        "trainer.max_ckpt_to_keep", note="one limit for whole checkpoints (actor and critic together)"),
    "trainer.balance_batch": Always((True,), "every data-parallel rank gets a token-balanced share",
                                    "data-parallel ranks always get token-balanced shares"),
    "trainer.log_val_generations": Always(
        (0,), "validation generations are not logged",
        "validation generations are not logged; tracking.rollout_trace logs training samples"),
    "trainer.rollout_data_dir": Always(
        (None,), "rollouts are not dumped to files",
        "rollouts are not dumped to files; tracking.rollout_trace logs samples to a tracker (tracking.backends)"),
    "trainer.validation_data_dir": Always((None,), "validation generations are not dumped",
                                          "validation generations are not dumped to files"),
    "trainer.default_hdfs_dir": Always((None,), "checkpoints stay local",
                                       "HDFS is not supported; checkpoints stay in trainer.run_dir/checkpoints"),
    "trainer.del_local_ckpt_after_load": Always(
        (False,), "checkpoints are kept", "a checkpoint is never deleted except by trainer.max_ckpt_to_keep"),
    "trainer.val_only": Always((False,), "training runs", "there is no validation-only run"),
    "trainer.ray_wait_register_center_timeout": NoMeaning("ranks register with the driver directly"),
    "trainer.esi_redundant_time": NoMeaning("checkpoint timing is trainer.save_freq only"),
    "trainer.use_legacy_worker_impl": NoMeaning("rlmegatron has one worker implementation"),
    "trainer.profile_steps": NoMeaning(_PROFILER),
    "global_profiler": NoMeaning(_PROFILER),
    "ray_kwargs": NoMeaning("rlm train starts Ray sized for the placement, or joins the cluster in RAY_ADDRESS"),
    "ray_init": NoMeaning("rlm train starts Ray sized for the placement, or joins the cluster in RAY_ADDRESS"),
}


# --- translation ---

@dataclass
class Translation:
    """verl keys turned into spec overrides, the notes to print, the problems, and the checks that wait for the
    resolved spec (Follows)."""

    overrides: list[Override] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[SpecProblem] = field(default_factory=list)
    follows: list[tuple[str, Any, str]] = field(default_factory=list)


def entry_for(key: str) -> tuple[Entry, str] | None:
    """The table entry that decides `key`, and the rest of the key below a dict entry ("" otherwise). A key below
    a rejected or fixed setting (fsdp_config.wrap_policy.min_num_params) shares its rejection."""
    if key in VERL_KEYS:
        return VERL_KEYS[key], ""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:cut])
        rest = ".".join(parts[cut:])
        if parent + "." in VERL_KEYS:
            return VERL_KEYS[parent + "."], rest
        entry = VERL_KEYS.get(parent)
        if isinstance(entry, NoMeaning):
            return entry, rest
        if isinstance(entry, Always):
            return NoMeaning(entry.otherwise or entry.note), rest
    return None


def equivalent(entry: Entry) -> str:
    """What rlmegatron calls a verl key, for a did-you-mean."""
    if isinstance(entry, Maps):
        return " and ".join(entry.fields)
    if isinstance(entry, Follows):
        return entry.field
    if isinstance(entry, PartOf):
        return f"part of {entry.owner}"
    if isinstance(entry, Always):
        return f"nothing to set: {entry.note}"
    return f"no field: {entry.reason}"


def _problem(key: str, value: Any, reason: str) -> SpecProblem:
    return SpecProblem(key, value, reason, file=COMMAND_LINE)


def _note(key: str, value: Any, note: str) -> str:
    return f"note: {key}={render_value(value)}: {note}"


def _parse(text: str) -> tuple[str, Any] | SpecProblem:
    """(key, value), with Hydra's +/++ prefixes dropped, or why the argument cannot be read. `~key` (value REMOVE)
    deletes what the YAML sets, as without --verl: an rlmegatron field, or the fields a verl key maps to."""
    if text.startswith("~"):
        key = text[1:].strip()
        found = entry_for(key)
        if found is None and path_problem(JobSpec, tuple(key.split("."))) is not None:
            return _problem(text, NO_VALUE, _unknown_reason(key))
        if found is not None and not (isinstance(found[0], Maps) and not found[1]):
            return _problem(text, NO_VALUE, "this verl key sets no field of its own to delete; leave the key out")
    parsed = parse_override(text.lstrip("+"))
    if isinstance(parsed, SpecProblem):
        return _problem(parsed.field, parsed.value, parsed.reason)
    if isinstance(parsed.value, str) and "${" in parsed.value:
        return _problem(parsed.path, parsed.value, "Hydra interpolations are not resolved here; write the value itself")
    return parsed.path, parsed.value


def translate(args: Sequence[str], raw: Mapping[str, Any]) -> Translation:
    """verl's `key=value` arguments -> rlmegatron overrides (weak ones first, so any other key setting the same
    field wins), notes and problems. `raw` is the YAML the overrides go on top of."""
    parsed = [_parse(text) for text in args]
    out = Translation()
    given = dict(item for item in parsed if not isinstance(item, SpecProblem) and item[1] is not REMOVE)
    ctx = Context(given, raw)
    weak: list[tuple[Override, Any]] = []  # with the value as written, for the note if another key wins
    strong: dict[str, Override] = {}
    native: list[Override] = []
    for item in parsed:
        if isinstance(item, SpecProblem):
            out.problems.append(item)
            continue
        key, value = item
        found = entry_for(key)
        if found is None:
            keys = tuple(key.split("."))
            if path_problem(JobSpec, keys) is None:
                native.append(Override(keys, value))
            else:
                out.problems.append(_problem(key, value, _unknown_reason(key)))
            continue
        entry, rest = found
        if isinstance(entry, NoMeaning):
            out.problems.append(_problem(key, value, f"no meaning in rlmegatron: {entry.reason}"))
        elif isinstance(entry, Always):
            if any(_same(value, accepted) for accepted in entry.values):
                out.notes.append(_note(key, value, entry.note))
            else:
                out.problems.append(_problem(key, value, entry.otherwise or entry.note))
        elif isinstance(entry, Follows):
            out.follows.append((key, value, entry.field))
        elif isinstance(entry, PartOf):
            if entry.owner not in given:
                out.problems.append(_problem(key, value, f"is read together with {entry.owner}; set that too"))
        else:
            _map(key, value, entry, rest, ctx, out, weak, strong)
    for override, written in weak:
        if override.path in strong:
            out.notes.append(_note(override.origin, written, f"{override.path} comes from "
                                   f"{strong[override.path].origin} instead"))
    out.overrides = [o for o, _ in weak if o.path not in strong] + list(strong.values()) + native
    return out


def _map(key: str, value: Any, entry: Maps, rest: str, ctx: Context, out: Translation,
         weak: list[tuple[Override, Any]], strong: dict[str, Override]) -> None:
    if value is REMOVE:  # `~key`: the fields it maps to go, and take their defaults
        strong.update({target: Override(tuple(target.split(".")), REMOVE, origin=key) for target in entry.fields})
        return
    try:
        converted = entry.convert(value, ctx) if entry.convert else value
    except Unchanged as unchanged:
        out.notes.append(_note(key, value, str(unchanged)))
        return
    except Rejected as rejected:
        out.problems.append(_problem(key, value, str(rejected)))
        return
    note = entry.note
    if isinstance(converted, Noted):
        converted, note = converted.value, converted.note or note
    if note:
        out.notes.append(_note(key, value, note))
    if rest:  # a key under a free-form dict: megatron.extra, sglang.extra_args
        targets = [entry.fields[0] + (rest.replace("_", "-") if entry.dashed else rest)]
    else:
        targets = list(entry.fields)
    values = list(converted) if entry.split else [converted] * len(targets)
    for target, item in zip(targets, values):
        override = Override(tuple(target.split(".")), item, origin=key)
        if entry.weak:
            weak.append((override, value))
        elif target in strong and not _same(strong[target].value, item):
            other = strong[target]
            setter = "an earlier value" if other.origin == key else other.origin
            out.problems.append(_problem(key, value, f"sets {target}={render_value(item)}, but {setter} sets "
                                         f"it to {render_value(other.value)}; keep one of them"))
        else:
            strong[target] = override


def _same(a: Any, b: Any) -> bool:
    """Equal as the user means it: 0 and 0.0 are, True and 1 are not (True == 1 in Python)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _unknown_reason(key: str) -> str:
    close = difflib.get_close_matches(key, list(VERL_KEYS), n=1, cutoff=0.8)
    if close:
        return f"unknown verl key; did you mean {close[0]} (rlmegatron's {equivalent(VERL_KEYS[close[0]])})?"
    return ("not a verl key rlmegatron knows (rlmegatron/config/verl_keys.py), nor an rlmegatron field; "
            "`rlm validate` prints every rlmegatron field")


def _resolved(spec: JobSpec, path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        value = getattr(value, part)
    return value


def follows_checked(translation: Translation, spec: JobSpec) -> tuple[list[SpecProblem], list[str]]:
    """The Follows keys against the resolved `spec`: a note where verl's value is what the spec has, else a problem
    naming the field to set. Part of the schema stage (spec_pipeline), once the spec has parsed."""
    problems, notes = [], []
    for key, value, ours in translation.follows:
        actual = _resolved(spec, ours)
        if _same(value, actual):
            notes.append(_note(key, value, f"rlmegatron uses {ours} for this, which is the same"))
        else:
            problems.append(_problem(key, value, f"rlmegatron uses {ours} for this, which is "
                                     f"{render_value(actual)}; set that instead"))
    return problems, notes
