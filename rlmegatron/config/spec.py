"""The job spec: one pydantic model per YAML section, and the only place defaults live.

Names follow verl where verl has the knob (actor.ppo_mini_batch_size, rollout.n,
algorithm.adv_estimator, ...) so a verl job translates key by key; verl's
`actor_rollout_ref` is split into the top-level `actor`, `ref` and `rollout` sections.

Relative paths anywhere in the spec (model.path, data files, trainer.run_dir, plug-in
files) are resolved against the current working directory of the process that uses
them, not against the YAML file's directory.

Some defaults derive from other fields and are filled in when the spec is validated:
`ref.megatron` and `critic.megatron` take every field they do not set from
`actor.megatron`; an unset `expert_tensor_parallel_size` follows that role's
`tensor_model_parallel_size` (as in Megatron); `rollout.max_new_tokens` follows
`data.max_response_length`; `rollout.log_prob_micro_batch_size_per_gpu` follows
`actor.ppo_micro_batch_size_per_gpu`, and `teacher.log_prob_micro_batch_size_per_gpu` follows it; `model.tokenizer_path` follows `model.path`;
`critic.enable` follows whether `algorithm.adv_estimator` is `gae`;
`actor.policy_loss.loss_mode` follows `algorithm.adv_estimator`: `gspo` for `gspo` (GRPO's
advantage with the sequence-ratio loss), `vanilla` otherwise; `trainer.run_dir` is
`runs/<trainer.experiment_name>`. Cross-field rules live in `checks.py`.

Algorithm names are checked against the registries of `rlmegatron.algorithms`, not retyped here:
`algorithm.adv_estimator`, `actor.policy_loss.loss_mode`, `actor.loss_agg_mode`,
`actor.kl_loss_type` and `algorithm.kl_penalty` take a registered name, and the first two also a
user's `path/to/file.py:function` plug-in.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rlmegatron.agent.parsers import PARSERS
from rlmegatron.plugins import is_plugin_reference

PositiveInt = Annotated[int, Field(ge=1)]
FLOAT32_MAX = 3.4028234663852886e38
Probability = Annotated[float, Field(ge=0, le=1)]


def _require_plugin_ref(value: str) -> str:
    if not is_plugin_reference(value):
        raise ValueError("must look like path/to/file.py:name")
    return value


def _require_data_file(value: str) -> str:
    if not value.endswith((".parquet", ".jsonl")):
        raise ValueError("must be a .parquet or .jsonl file")
    return value


def _require_frequency(value: int) -> int:
    if value != -1 and value < 1:
        raise ValueError("must be a number of steps >= 1, or -1 for never")
    return value


def _require_generation_rounds(value: int) -> int:
    if value < 1:
        # verl reads 0 as "no limit", which never ends a step whose groups all keep scoring the same.
        raise ValueError("must be a number of generation rounds >= 1 (0, verl's 'no limit', could generate "
                         "forever when every group scores the same); e.g. 10")
    return value


def _require_tool_call_format(value: str) -> str:
    if value not in PARSERS:
        raise ValueError(f"unknown tool-call format; known: {', '.join(sorted(PARSERS))}")
    return value


def _wrap_single_item(value: Any) -> Any:
    # verl users pass one file as a bare string (data.train_files=train.parquet).
    return [value] if isinstance(value, str) else value


# Free text stays lax so an unquoted number (experiment_name: 2024) is read as text.
Text = Annotated[str, Field(strict=False)]
PluginRef = Annotated[str, AfterValidator(_require_plugin_ref)]
DataFile = Annotated[str, AfterValidator(_require_data_file)]
StepFrequency = Annotated[int, AfterValidator(_require_frequency)]


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, attribute docstrings become descriptions."""

    # Strict: YAML already types its values, so `gpus_per_node: true` must not become 1.
    model_config = ConfigDict(
        extra="forbid", strict=True, use_attribute_docstrings=True, coerce_numbers_to_str=True
    )

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, value: Any) -> Any:
        # `critic:` with nothing under it is YAML for None.
        return {} if value is None else value


class ModelConfig(Section):
    path: Text
    """HF checkpoint directory, or a hub id such as Qwen/Qwen3-1.7B."""
    hf_config: Text | None = None
    """config.json (or its directory) to read the architecture from when `path` is not a local directory."""
    tokenizer_path: Text | None = None
    """Tokenizer directory or hub id; defaults to `path`."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    trust_remote_code: bool = False
    """Let transformers (the tokenizer, the config, the local engine's model) and SGLang run the code a model
    directory names in its config.json or tokenizer_config.json (`auto_map`); `rlm validate` says when it must."""
    random_init: bool = False
    """Start from randomly initialised weights (seeded by trainer.seed); `path` then needs only a config.json."""

    def architecture_source(self) -> tuple[str, str] | None:
        """(spec field, path) of the config.json that describes the model, or None if there is none."""
        return _architecture_source("model", self.path, self.hf_config)


def _architecture_source(section: str, path: str | None, hf_config: str | None) -> tuple[str, str] | None:
    """(spec field, path) of the config.json a model section (`path`, `hf_config`) is described by: the local
    directory `path`, else `hf_config`; None when neither is there."""
    if path is not None and Path(path).is_dir():
        return f"{section}.path", path
    if hf_config is not None:
        return f"{section}.hf_config", hf_config
    return None


class DataConfig(Section):
    train_files: Annotated[list[DataFile], BeforeValidator(_wrap_single_item), Field(min_length=1)]
    val_files: Annotated[list[DataFile], BeforeValidator(_wrap_single_item)] = []
    prompt_key: Text = "prompt"
    prompt_format: Literal["chat", "plain"] = "chat"
    """chat: each row's data.prompt_key holds chat messages, rendered with the tokenizer's chat template (verl's
    rows); plain: it holds the prompt's text, tokenized as it is, with no template (a BOS the tokenizer puts before
    every text still leads it)."""
    answer_key: Text = "reward_model.ground_truth"
    """Dotted path of each row's ground truth, the reward function's `ground_truth` argument: verl's rows keep it at
    reward_model.ground_truth; a prompt/answer JSONL such as {"prompt": "2+2=", "answer": "4"} at answer."""
    max_prompt_length: PositiveInt = 512
    max_response_length: PositiveInt = 512
    train_batch_size: PositiveInt = 1024
    """Prompts per step; each is sampled rollout.n times."""
    val_batch_size: PositiveInt | None = None
    """Prompts per validation batch; null validates the whole set as one batch."""
    shuffle: bool = True
    seed: int = 1
    dataset_class: PluginRef | None = None
    """Custom dataset as path/to/file.py:ClassName; null uses the built-in parquet/jsonl dataset."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length instead of rejecting the dataset."""
    image_key: Text = "images"
    """The column of a row's images (verl's multimodal rows: bytes, paths, or {bytes, path} records), each placed
    where the prompt says `<image>`; a vision-language model (Qwen2.5-VL) reads them through its image processor."""
    max_image_pixels: PositiveInt = 4096 * 4096
    """An image with more pixels is refused, read from its header before decoding: the processor would shrink it to
    its own max_pixels anyway, so a larger one is a mistake (or a decompression bomb)."""


class OptimConfig(Section):
    # Bounded by float32: the optimizer turns learning rates into float32 tensors, where a larger one overflows.
    lr: float = Field(1e-6, gt=0, lt=FLOAT32_MAX)
    min_lr: float = Field(0.0, ge=0, lt=FLOAT32_MAX)
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, gt=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"


class CriticOptimConfig(OptimConfig):
    lr: float = Field(1e-5, gt=0, lt=FLOAT32_MAX)
    """A freshly initialised value head needs a larger step than the policy (verl's default too)."""


class MegatronConfig(Section):
    tensor_model_parallel_size: PositiveInt = 1
    pipeline_model_parallel_size: PositiveInt = 1
    virtual_pipeline_model_parallel_size: PositiveInt | None = None
    context_parallel_size: PositiveInt = 1
    expert_model_parallel_size: PositiveInt = 1
    expert_tensor_parallel_size: PositiveInt | None = None
    """Tensor parallelism inside each expert; null follows tensor_model_parallel_size."""
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"
    """How full recompute picks layers (Megatron's recompute_method)."""
    recompute_num_layers: PositiveInt = 1
    extra: dict[str, Any] = {}
    """Passed verbatim to Megatron-Core's TransformerConfig."""


class ParamOffloadConfig(Section):
    params: bool = False
    """Keep parameters in host memory while the role is idle."""


class OffloadConfig(ParamOffloadConfig):
    grads: bool = False
    optimizer: bool = False


class PPOUpdateConfig(Section):
    """Batch shape of a PPO-style update, shared by the actor and the critic."""

    ppo_mini_batch_size: PositiveInt = 256
    """Prompts per optimizer step; a step of data.train_batch_size prompts makes several."""
    ppo_micro_batch_size_per_gpu: PositiveInt = 1
    """Sequences per forward/backward pass on each data-parallel rank (ignored with use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by token count (ppo_max_token_len_per_gpu) instead of sequence count."""
    ppo_max_token_len_per_gpu: PositiveInt = 16384
    ppo_epochs: PositiveInt = 1


class PolicyLossConfig(Section):
    """Which policy loss the actor minimises, and the knobs of the covariance losses (verl's actor.policy_loss)."""

    loss_mode: Text | None = None
    """A policy loss registered in rlmegatron.algorithms (vanilla, gspo, ...) or path/to/file.py:function;
    null follows algorithm.adv_estimator (gspo for gspo, else vanilla)."""
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """clip_cov: share of the valid tokens whose gradient is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens are dropped only if their advantage/log-prob covariance exceeds this..."""
    clip_cov_ub: float = 5.0
    """...and stays below this."""
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """kl_cov: share of the valid tokens (those of largest covariance) that get the KL penalty."""
    ppo_kl_coef: float = Field(0.1, ge=0)
    """kl_cov: weight of that penalty, |log(pi / pi_old)| per token."""


LoRATarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


class LoRAConfig(Section):
    """LoRA adapters on the actor: only they train, and the reference is the actor with its adapters off (no second
    model). Checkpoints hold the adapters only; the HF export is merged."""

    rank: int = Field(0, ge=0)
    """The adapters' rank; 0 trains the whole model."""
    alpha: float = Field(16.0, gt=0)
    """The update of a weight is (alpha / rank) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: list[LoRATarget] = Field(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], min_length=1)
    """Megatron's linears that get adapters (the experts' too): attention's QKV and output projections, the MLP's
    first and second linears."""
    modules_to_save: list[Literal["embedding", "output_layer"]] = []
    """Whole modules that train beside the adapters (PEFT's modules_to_save): `embedding` (with tied embeddings, the
    output layer too), `output_layer` (untied models). Their gradients and Adam state are full-size; checkpoints hold
    them with the adapters, and the reference uses their base values. A random-init model's frozen embedding caps
    every token's probability (benchmarks/RESULTS.md, LoRA quickstart): train it there."""
    weight_sync: Literal["merge", "adapter"] = "merge"
    """How the engines get the trained policy: `merge` sends base + (alpha / rank) * B @ A as full weights (any
    engine); `adapter` sends the base weights once and then only the adapters, which SGLang loads as a LoRA adapter
    (PEFT format, under trainer.run_dir/lora_adapters, a path the servers must see) and samples with."""


class MoEConfig(Section):
    """What an MoE actor does about its routers (rlmegatron/models/routing_replay.py)."""

    # YAML 1.1 reads a bare `off` as false.
    routing_replay: Annotated[Literal["off", "r2", "r3"], BeforeValidator(lambda v: "off" if v is False else v)] = "off"
    """Replay recorded expert choices instead of the router's own top-k in the actor's Megatron passes, the routing
    weights recomputed from the trained router's scores over them: `r3` the rollout engine's routing of each token
    (the engines return it) in every pass; `r2` the old-log-prob pass's own routing in the update (needs that pass:
    several mini-batches or epochs). The reference's pass routes freely."""
    routing_agreement: bool = False
    """Have the engines return their routing and log moe/routing_agreement, the fraction of (token, MoE layer) pairs
    whose top-k the actor's router chooses as the rollout did (r3 logs it anyway)."""


class VisionConfig(Section):
    """The image encoder of a vision-language actor (rlmegatron/models/vision.py)."""

    freeze: bool = True
    """Keep the vision tower at its initial weights (peers' default: RL signal is sparse, and the tower was trained
    on far more images than a run sees); false trains it with the language model, and the critic's too."""


class MTPConfig(Section):
    """The actor's multi-token-prediction (MTP) layers, in models whose checkpoint holds them (DeepSeek-V3, GLM-4.5;
    rlmegatron/models/mtp.py)."""

    loss_weight: float = Field(0.0, ge=0, lt=FLOAT32_MAX)
    """Train the MTP layers with the policy: each update adds this times Megatron-Core's MTP loss to the actor's loss
    (per MTP layer k, the cross-entropy of its prediction of the sampled token k+1 places past the next one, over the
    response tokens, averaged over the mini-batch's response tokens; the layers' mean), and logs actor/mtp_loss. Its
    gradient reaches the shared embedding and the trunk, as in Megatron's pretraining, unless `detach`. 0: the MTP
    layers are frozen and not run in the update (no gradient or Adam state; a drafting engine gets the first with its
    first push only), which is exactly the one without them."""
    detach: bool = False
    """true: the MTP loss trains the MTP layers alone; the hidden states, embeddings and output head they take from
    the main model are detached, so the policy's gradient is the RL loss's (verl's detach_encoder, which it recommends
    for RL: the MTP loss through the trunk moved the policy in its runs and in benchmarks/RESULTS.md's count-up
    task). false: Megatron's (and slime's) MTP training, the gradient reaching the trunk and the shared embedding."""


class ActorConfig(PPOUpdateConfig):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: Annotated[float, Field(gt=1)] | None = 3.0
    """Dual-clip bound on the loss of negative-advantage tokens; null turns the dual clip off."""
    loss_agg_mode: Text = "token-mean"
    """How per-token losses become one scalar: a mode registered in rlmegatron.algorithms (verl's names and
    meanings: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, ...)."""
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: Text = "low_var_kl"
    """KL estimator of the KL loss (use_kl_loss), registered in rlmegatron.algorithms (k1, low_var_kl, ...)."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    vision: VisionConfig = Field(default_factory=VisionConfig)
    mtp: MTPConfig = Field(default_factory=MTPConfig)

    @property
    def wants_rollout_routing(self) -> bool:
        """Whether the engines return each token's experts (rollout routing replay, or its agreement measured)."""
        return self.moe.routing_replay == "r3" or self.moe.routing_agreement

    def policy_loss_settings(self) -> dict[str, tuple[str, Any]]:
        """Each field of the policy losses' config (rlmegatron.algorithms.PolicyLossConfig) -> (spec field, value)."""
        knobs = self.policy_loss
        return {
            "clip_ratio_low": ("actor.clip_ratio_low", self.clip_ratio_low),
            "clip_ratio_high": ("actor.clip_ratio_high", self.clip_ratio_high),
            "clip_ratio_c": ("actor.clip_ratio_c", self.clip_ratio_c),
            **{name: (f"actor.policy_loss.{name}", getattr(knobs, name))
               for name in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
        }


class RefConfig(Section):
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """The reference's own layout (it may differ from the actor's); fields left unset are taken from actor.megatron."""
    offload: ParamOffloadConfig = Field(default_factory=ParamOffloadConfig)
    log_prob_micro_batch_size_per_gpu: PositiveInt = 1
    """Sequences per forward pass of the reference on each data-parallel rank (unless log_prob_use_dynamic_bsz)."""
    log_prob_use_dynamic_bsz: bool = False
    """Pack the reference's micro-batches by token count (log_prob_max_token_len_per_gpu) instead of sequence count."""
    log_prob_max_token_len_per_gpu: PositiveInt = 16384


class TeacherConfig(RefConfig):
    """On-policy distillation's teacher (algorithm.distill): a frozen model of its own that scores every token the
    student samples, batched and offloaded as the reference is. Its layout (`megatron`) is its own, Megatron's
    defaults where unset: it is another model, which the actor's layout (its pipeline split, virtual stages) need not
    fit. Its tokenizer must be the student's: the log-probs are compared token by token."""

    log_prob_micro_batch_size_per_gpu: PositiveInt | None = None
    """Sequences per forward pass of the teacher on each data-parallel rank (unless log_prob_use_dynamic_bsz); null
    follows rollout.log_prob_micro_batch_size_per_gpu, the student's own log-prob batching."""
    path: Text | None = None
    """An HF checkpoint directory (or hub id, with hf_config), or a Megatron checkpoint written by `rlm convert
    hf-to-mcore` (its rlm_convert.json says the architecture); null: no teacher."""
    hf_config: Text | None = None
    """config.json (or its directory) to read the architecture from when `path` is not a local directory."""

    def architecture_source(self) -> tuple[str, str] | None:
        """(spec field, path) of the config.json that describes the teacher, or None if there is none."""
        return _architecture_source("teacher", self.path, self.hf_config)


class CriticConfig(PPOUpdateConfig):
    """The value model. Its value loss is aggregated with actor.loss_agg_mode: one mode for both roles, as in verl,
    whose critic.loss_agg_mode defaults to the actor's."""

    enable: bool | None = None
    """null enables the critic exactly when algorithm.adv_estimator is gae."""
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """The critic's own layout (it may differ from the actor's); fields left unset are taken from actor.megatron."""
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    init_from: Text = "actor"
    """`actor` starts the value model from the actor's weights; otherwise the directory of an HF reward/value model
    of the same architecture with one label (`*ForSequenceClassification`, `*ForTokenClassification`)."""
    cliprange_value: float = Field(0.5, gt=0)


class SamplingParams(Section):
    n: PositiveInt = 1
    """Responses sampled per prompt."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """-1 disables top-k."""


class ValSamplingParams(SamplingParams):
    temperature: float = Field(0.0, ge=0)
    """Greedy by default so validation scores are comparable from step to step."""


class SGLangConfig(Section):
    python: Text = "python"
    """Interpreter that runs the SGLang server; SGLang pins its own torch, so it often has its own venv."""
    enable_memory_saver: bool = True
    """Lets colocated engines release GPU memory while the trainer runs."""
    load_format: Text = "auto"
    skip_tokenizer_init: bool = True
    """The trainer sends token ids, so the server needs no tokenizer."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """A server not healthy this long after launch fails the job, with its log tail."""
    extra_args: dict[str, Any] = {}
    """Extra server flags, passed verbatim: {key: value} becomes --key value; true becomes a bare --key."""
    router: bool = False
    """Put sglang_router in front of the servers: it spreads every engine's requests over all of them (cache-aware
    by default), while weights still go straight to each server. rlm train starts it on the driver's node."""
    router_url: Text | None = None
    """An sglang_router that is already running, for the servers to join instead of starting one."""
    router_args: dict[str, Any] = {}
    """Extra router flags, passed verbatim like extra_args (e.g. policy: round_robin)."""


class ToolConfig(Section):
    plugin: Text
    """A built-in tool (`python`: sandboxed Python snippets) or a plug-in class path/to/tools.py:ClassName with an
    OpenAI function `schema` and `async def execute(self, args, context) -> (text, reward_delta, metrics)`."""
    config: dict[str, Any] = {}
    """Keyword arguments of the class (python: cpu_s, memory_mb, wall_s, max_output_bytes)."""


class MultiTurnConfig(Section):
    """Multi-turn, tool-calling rollouts (rlmegatron/agent): between its turns the model may call tools, whose
    answers join the response as tokens it did not write (masked out of the loss)."""

    tools: list[ToolConfig] = []
    """The tools the model may call; none: every rollout is a single completion."""
    max_turns: PositiveInt = 5
    """Model turns per trajectory; the last one's tool calls are not answered."""
    max_tool_response_length: PositiveInt = 256
    """Tokens of one tool answer; a longer one is cut and says so. The whole response, tool answers included,
    stays within rollout.max_new_tokens."""
    tool_call_format: Annotated[str, AfterValidator(_require_tool_call_format)] = "hermes"
    """How the model writes tool calls: hermes is Hermes/Qwen's <tool_call>{"name": ..., "arguments": ...}</tool_call>."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Seconds one tool call may take; past them the model is told it timed out."""


class SpeculativeConfig(Section):
    """Speculative decoding in the rollout engines, the model's own MTP layers drafting (the actor's layers, synced
    with every weight push; actor.mtp.loss_weight keeps them following the policy)."""

    method: Literal["mtp"]
    """mtp: the checkpoint's multi-token-prediction layers draft. SGLang runs them as its NEXTN (EAGLE) draft model
    (--speculative-algorithm NEXTN, one draft per step); the local engine drafts with them and verifies with one
    forward of the main model, accepting by rejection sampling, so the samples' distribution is the main model's."""
    num_draft_tokens: PositiveInt = 3
    """Tokens drafted before each verification (SGLang: --speculative-num-steps k, --speculative-num-draft-tokens k+1,
    --speculative-eagle-topk 1)."""


class RolloutConfig(SamplingParams):
    n: PositiveInt = 8
    """Responses sampled per prompt; the group-relative default estimator (grpo) needs a group."""
    engine: Literal["sglang", "local"] = "sglang"
    """`local` generates in-process with transformers (CPU and tests); `sglang` runs inference servers."""
    max_new_tokens: PositiveInt | None = None
    """Defaults to data.max_response_length."""
    stop_token_ids: list[int] = []
    seed: int = 0
    tensor_parallel_size: PositiveInt = 1
    """GPUs per engine."""
    expert_parallel_size: PositiveInt = 1
    enable_dp_attention: bool = False
    mem_fraction_static: float = Field(0.7, gt=0, lt=1)
    num_gpus: PositiveInt | None = None
    """GPUs the engines use in total; null uses the whole rollout pool (the trainer GPUs when colocated)."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    update_weights_bucket_mb: PositiveInt = 512
    """Size of the flattened buckets that carry weights from the trainer to the engines."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8: every weight sync quantises the linear projections block-wise as they stream (float8_e4m3fn and a
    weight_scale_inv per 128 x 128 block, DeepSeek-V3's format, SGLang's names), about half the bytes of bf16; the
    engines sample with those weights (SGLang serves them in FP8, the local engine dequantised), so the rollout's
    log-probs move further from the trainer's, which algorithm.rollout_correction can correct. Training keeps
    model.dtype."""
    autoscale: bool = False
    """Disaggregate: the driver adds an engine for each node that joins the Ray cluster, and when generation was the
    bottleneck of two steps running (the trainer waited for its rollout more than half of each step), and removes
    one that sat idle through three (it waited less than a tenth), within placement.rollout_min_engines ..
    rollout_max_engines; its decisions are logged (pool/*)."""
    weight_sync: Literal["full", "delta"] = "full"
    """full: every weight sync sends every weight; delta: after a full push, each sync sends per tensor only the
    elements whose bits in the engine's dtype changed (positions or a bitmask, and their values: rollout/delta.py);
    both ends keep the last weights sent, in the engine's dtype on the CPU, and the engine rebuilds and loads only what
    changed, exactly. Full pushes still happen at the first sync, to a restarted engine and every full_sync_every
    steps. Disaggregated, the records travel over HTTP to the server's custom weight loader; colocated SGLang shares
    its buckets by IPC, which a delta would not make cheaper, and is refused."""
    full_sync_every: int = Field(0, ge=0)
    """weight_sync=delta: a full push every this many syncs, a guard against drift; 0: only where one is needed."""
    log_prob_micro_batch_size_per_gpu: PositiveInt | None = None
    """Sequences per forward pass on each data-parallel rank when the actor recomputes the rollout's log-probs (the
    old log-probs; ignored with actor.use_dynamic_bsz); null follows actor.ppo_micro_batch_size_per_gpu."""
    val_kwargs: ValSamplingParams = Field(default_factory=ValSamplingParams)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    speculative: SpeculativeConfig | None = None
    """Speculative decoding with the model's MTP layers as the draft (null: none)."""


class OverlongBufferConfig(Section):
    """DAPO's soft penalty for responses that run into the last `length` tokens of the budget."""

    enable: bool = False
    length: PositiveInt = 4096
    penalty_factor: float = Field(1.0, ge=0)


class RewardModelConfig(Section):
    """A learned reward model that scores prompt + response in the trainer ranks (sharing them, like the roles)."""

    path: Text | None = None
    """Directory of an HF `*ForSequenceClassification` with one label, and its tokenizer; null: rule-based rewards
    only. A tokenizer or chat template other than the policy's re-encodes prompt + response with the model's own."""
    weight: float = 1.0
    """reward = weight * model score + rule_weight * rule score (reward.function, or the built-in rule)."""
    rule_weight: float = 0.0
    """0 scores with the model alone (the rule does not run)."""
    combiner: PluginRef | None = None
    """path/to/file.py:function(model_score, rule_score, item) -> reward, in place of the weighted sum; `item` is
    the rule's RewardInput."""
    micro_batch_size_per_gpu: PositiveInt = 4
    """Sequences per forward pass on each data-parallel rank."""
    tensor_model_parallel_size: PositiveInt = 1
    """The reward model's own tensor parallelism on the trainer ranks."""
    sequence_parallel: bool = False
    offload: ParamOffloadConfig = Field(default_factory=ParamOffloadConfig)


class RewardConfig(Section):
    function: PluginRef | None = None
    """Custom reward as path/to/file.py:function_name; null picks the built-in rule for the data source."""
    manager: Literal["naive", "dapo"] = "naive"
    num_workers: int = Field(0, ge=0)
    """Processes that score samples. 0: a reward.function in worker processes sized to the machine (more once samples
    time out; an `async def` one in one worker's event loop, async_concurrency at once), the built-in rules in the
    driver; N: exactly N worker processes (N samples, and N timeouts, at once). A function never runs in the driver,
    where code stuck in C could not be stopped."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds one sample may take; past them it scores 0 and counts in reward/timeouts (its worker is killed and
    replaced when it does not stop)."""
    max_timeout_fraction: Probability = 0.5
    """More than this fraction of a batch's samples timing out stops the run (one line, exit 2), as soon as that is
    certain, rather than train on their zeros. 1: never stop for timeouts."""
    batch_timeout_s: float | None = Field(600.0, gt=0)
    """Seconds to score one batch (a step's rollout, a DAPO round, the ReMax baseline, a validation chunk); samples
    not scored by then score 0 and count in reward/timeouts. null: no limit beyond timeout_s per sample."""
    async_concurrency: PositiveInt = 64
    """Samples an `async def` reward function scores at once in the driver (num_workers=0)."""
    model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: PositiveInt = 10000


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more."""

    enable: bool = False
    max_num_gen_batches: Annotated[int, AfterValidator(_require_generation_rounds)] = 10
    """Generation rounds allowed per step to fill the batch; after the last one the step trains on what it kept."""


class RolloutCorrectionConfig(Section):
    """Correction for the rollout engine's policy differing from the trainer's (numerics, or older weights in
    asynchronous training), verl's algorithm.rollout_correction. The ratio is pi_old / pi_rollout: the trainer's
    recomputed log-prob of each sampled token against the one the engine reported; per sequence, their product
    (geometric: its per-token geometric mean). Logged as rollout_corr/* (the ratios' distribution, the mismatch KL,
    the fractions capped and rejected)."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights on the policy loss: each token's own ratio, or its sequence's; null: none."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate (TIS): weight min(ratio, rollout_is_threshold); mask (MIS): the ratio, or 0 above the threshold."""
    rollout_is_threshold: float = Field(2.0, gt=0)
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection: tokens, or whole sequences (by their ratio, or its geometric mean), whose ratio lies outside
    [rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss; null: none."""
    rollout_rs_threshold: float = Field(2.0, gt=0)
    rollout_rs_threshold_lower: float | None = Field(None, gt=0)
    """null: 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = Field(None, gt=0)
    """Reject a whole sequence when any of its tokens has a ratio below this (e.g. 1e-4); null: no veto."""

class DistillConfig(Section):
    """On-policy distillation: the student samples, the teacher scores each sampled token, and each response token's
    advantage gets -coef * (log p_student - log p_teacher), the per-token reverse KL's estimate, pushing the student
    towards the teacher where it samples (algorithms/distill.py). Logs distill/reverse_kl and
    distill/teacher_logp_mean each step."""

    coef: float = Field(1.0, gt=0, lt=FLOAT32_MAX)
    """The reverse KL's weight in the advantage."""
    mode: Text = "reverse_kl"
    """The divergence the advantage estimates; reverse_kl (log p_student - log p_teacher at the sampled token) is the
    one supported."""
    baseline: Literal["none", "group_mean"] = "none"
    """none: the term as it is (slime's and Tinker's OPD); group_mean: each token's term less its mean over the response
    tokens of its prompt's rollout.n responses (GRPO's baseline, for the teacher's signal), which takes out the
    divergence every sample shares: far from its teacher a student's samples all have a large one, which only adds
    noise (benchmarks/RESULTS.md, "On-policy distillation"). Needs rollout.n >= 2."""
    only: bool = False
    """true: the advantage is the distillation term alone (the task reward is still scored and logged, but trains
    nothing, so reward.function may be left unset); false: the term is added to algorithm.adv_estimator's
    advantages of the task reward."""


class AlgorithmConfig(Section):
    adv_estimator: Text = "grpo"
    """An advantage estimator registered in rlmegatron.algorithms (grpo, gae, rloo, ...) or path/to/file.py:function."""
    gamma: Probability = 1.0
    lam: Probability = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Text = "k1"
    """KL estimator for the in-reward penalty (use_kl_in_reward), registered like actor.kl_loss_type."""
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    distill: DistillConfig | None = None
    """On-policy distillation from `teacher` (slime's and NeMo-RL's OPD); null: none."""


class PlacementConfig(Section):
    mode: Literal["colocate", "disaggregate"] = "colocate"
    """colocate: rollout engines share the trainer GPUs; disaggregate: they get their own nodes."""
    nnodes: PositiveInt = 1
    """Trainer nodes."""
    gpus_per_node: PositiveInt = 8
    """Trainer GPUs per node; with device cpu, the number of gloo ranks per node."""
    device: Literal["cuda", "cpu"] = "cuda"
    rollout_nnodes: PositiveInt | None = None
    """Rollout nodes (disaggregate only)."""
    rollout_gpus_per_node: PositiveInt | None = None
    """Rollout GPUs per node (disaggregate only)."""
    rollout_min_engines: PositiveInt | None = None
    """Disaggregate: the fewest engines the rollout pool may shrink to while the job runs (`rlm pool remove`,
    rollout.autoscale); null: the engines it starts with."""
    rollout_max_engines: PositiveInt | None = None
    """Disaggregate: the most engines the rollout pool may grow to while the job runs (`rlm pool add`,
    rollout.autoscale), each joining on devices of its own (on Ray: a node with rollout.tensor_parallel_size free,
    beside the job's pools); null: the engines it starts with."""
    transport: Literal["auto", "ray", "processes"] = "auto"
    """How `rlm train` starts the trainer ranks. ray: as Ray actors (any number of nodes; joins the cluster in
    RAY_ADDRESS, else starts a local one); processes: as processes of this machine, driven over pipes, without Ray
    (one node; Ray's own start-up is saved, benchmarks/RESULTS.md "Start-up"); auto: processes when the run fits that (one node, no
    RAY_ADDRESS, and on GPU no rollout pool of its own), else ray."""

    @property
    def trainer_world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def fits_processes(self) -> bool:
        """Whether the ranks can run as processes of this machine: one node, and a rollout pool (if any) that
        needs no placing (on CPU its hosts run in the driver; GPUs of their own need Ray to place them)."""
        return self.nnodes == 1 and (self.mode == "colocate" or self.device == "cpu")

    def engine_bounds(self, tensor_parallel_size: int, num_gpus: int | None) -> tuple[int, int, int] | None:
        """(fewest, at the start, most) rollout engines of a disaggregated pool; None when colocated or undeclared."""
        if self.mode == "colocate" or self.rollout_pool_size is None:
            return None
        start = (num_gpus or self.rollout_pool_size) // tensor_parallel_size
        return self.rollout_min_engines or start, start, self.rollout_max_engines or start

    @property
    def rollout_pool_size(self) -> int | None:
        """GPUs the rollout engines may use: the trainer's when colocated; None if not yet declared."""
        if self.mode == "colocate":
            return self.trainer_world_size
        if self.rollout_nnodes is None or self.rollout_gpus_per_node is None:
            return None
        return self.rollout_nnodes * self.rollout_gpus_per_node


class TrainerConfig(Section):
    total_steps: PositiveInt | None = None
    """Stop after this many steps; null trains for total_epochs."""
    total_epochs: PositiveInt = 1
    save_freq: StepFrequency = -1
    """Steps between checkpoints; -1 never saves."""
    test_freq: StepFrequency = -1
    """Steps between validations; -1 never validates during training."""
    log_freq: StepFrequency = -1
    """Steps between full metric tables on the console; every other step prints one line (its mean score, response
    length, time and validation scores). -1: one line every step; `rlm train --verbose` prints the table every step."""
    run_dir: Text | None = None
    """Checkpoints, logs and prepared data of this run; defaults to runs/<experiment_name>."""
    experiment_name: Text = "default"
    resume: Text = "auto"
    """`auto` resumes from the newest complete checkpoint in run_dir that loads, `disable` starts fresh (refused while
    run_dir holds a complete checkpoint), else a checkpoint path (no fallback). See docs/reliability.md, "Checkpoints
    and resume"."""
    max_ckpt_to_keep: PositiveInt | None = None
    """null keeps every checkpoint."""
    seed: int = 42
    val_before_train: bool = True
    critic_warmup: int = Field(0, ge=0)
    """Steps at the start in which only the critic trains, so the actor's first advantages come from a value model
    that has seen some returns (PPO with a critic only)."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """sync: generate a step's rollout, then train on it, then push the weights; one_step_off: the engines generate
    step k+1's rollout while the trainer trains on step k's (samples one weight version old); async: the engines run
    ahead of the trainer by up to max_staleness steps, into a buffer of as many rollouts. Both need
    placement.mode=disaggregate. Each sample records the weight versions that produced it; training/staleness/*
    logs how many versions behind the trained policy they are."""
    max_staleness: PositiveInt = 2
    """async: the most weight versions a trained sample may lag behind the policy it trains (one_step_off: 1)."""
    on_policy_check: float | None = Field(None, gt=0)
    """The largest |log p_rollout - log p_old| a response token may have (trainer.mode=sync): past it the step stops
    (exit 3) naming the row and token, before the update. A detector of weight-sync and routing bugs: the engines
    should sample with exactly the weights the actor scores with. With rollout.engine=local in fp32 the gap is one
    float32 ulp of the log-prob at most, for a dense model and for an MoE one with actor.moe.routing_replay=r3
    (kernels round differently: benchmarks/RESULTS.md, "On-policy check"); 1e-5 leaves room for that. It adds the
    old-log-prob pass where the update would not need one. null checks nothing."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """Seconds a trainer rank waits in one collective (an all-reduce, an MoE all-to-all, a barrier) for the other ranks
    of its group; past them the run stops with a line naming the step and the call (exit 3) instead of waiting for
    good. Megatron's and torch's default; raise it where ranks legitimately wait longer (loading a very large model
    on one rank while the others wait)."""
    max_restarts: int = Field(0, ge=0)
    """Times the run restarts its trainer ranks when one dies (killed, out of memory, a collective that timed out, or
    a rank that raises what is not the user's mistake, such as a CUDA or NCCL error) within this `rlm train`: the others are stopped, the ranks and engines start again, and the run resumes from the
    last complete checkpoint (its data position, RNG and tracker run: a resume as trainer.resume=auto makes) and goes
    on. Past that many restarts the run stops with one line (exit 3). 0: the first death stops it."""
    check_sync_every: int = Field(0, ge=0)
    """Every this many weight syncs, each engine's weights are compared, per tensor, with what a full push gives
    (a checksum of each tensor's bits, rollout.engine=local); a mismatch stops the run naming the tensor and the
    engine (exit 3). 0 checks nothing."""
    partial_rollout: bool = False
    """one_step_off and async: new weights reach the engines mid-generation: in-flight samples are paused, the
    weights swapped, and each goes on from the tokens it has with the new policy (keeping every token's rollout
    log-prob and weight version); false: the engines take new weights between requests."""

    @property
    def staleness_bound(self) -> int:
        """Weight versions a sample may lag: 0 in sync, 1 one step off, max_staleness in async."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


class RolloutTraceConfig(Section):
    """A few of each step's rollout samples as text (verl's rollout trace): what the policy wrote, and its score."""

    backend: Literal["mlflow", "wandb", "tensorboard", "console"] | None = None
    """mlflow: a table (.json) and a text file (.txt) per step among the run's artifacts, under rollout_samples/;
    wandb: a table per step, logged as rollout_samples; tensorboard: a text summary per step, tagged rollout_samples;
    console: printed after the step's metrics; null logs none. The backend must be one of tracking.backends."""
    prompts_per_step: PositiveInt | None = 2
    """Prompts per step whose samples are logged, each with all of its rollout.n responses; null logs every one."""


class TrackingConfig(Section):
    backends: Annotated[
        list[Literal["mlflow", "wandb", "tensorboard", "console"]], BeforeValidator(_wrap_single_item)
    ] = ["console"]
    """Where every metric goes, each under the same name, in any combination. mlflow: a run in tracking_uri's store;
    wandb: a W&B run in trainer.run_dir/wandb (offline when WANDB_MODE=offline; `pip install rlmegatron[wandb]`);
    tensorboard: event files in trainer.run_dir/tensorboard (`pip install rlmegatron[tensorboard]`); console: a line
    per step. A resumed run continues the run directory's MLflow, W&B and TensorBoard runs."""
    tracking_uri: Text | None = None
    """MLflow server or store: http(s)://host:port, sqlite:///path.db, or MLflow's file store (file:/dir or a plain
    directory; MLflow 3 opens it only with MLFLOW_ALLOW_FILE_STORE=true, which a run sets for itself). null uses
    MLFLOW_TRACKING_URI, else sqlite:///<trainer.run_dir>/mlflow.db."""
    project_name: Text = "rlmegatron"
    """The MLflow experiment and the W&B project that group the runs (verl's trainer.project_name); each run is
    trainer.experiment_name."""
    rollout_trace: RolloutTraceConfig = Field(default_factory=RolloutTraceConfig)


class JobSpec(Section):
    """A whole RL post-training job, as read from YAML plus command-line overrides."""

    model: ModelConfig
    data: DataConfig
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @property
    def needs_reference(self) -> bool:
        """Whether any KL term needs the frozen reference policy's log-probs."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def mini_batch_sequences(self, role: Literal["actor", "critic"]) -> int:
        """Sequences per optimizer step of `role`'s update: its ppo_mini_batch_size counts prompts, each with its
        rollout.n responses."""
        return getattr(self, role).ppo_mini_batch_size * self.rollout.n

    def optimizer_steps_per_update(self, role: Literal["actor", "critic"], sequences: int | None = None) -> int:
        """Optimizer steps of one update of `role` over `sequences` (default: a step's data.train_batch_size prompts
        × rollout.n)."""
        if sequences is None:
            sequences = self.data.train_batch_size * self.rollout.n
        return optimizer_steps(sequences, self.mini_batch_sequences(role), getattr(self, role).ppo_epochs)

    def total_steps(self, batches_per_epoch: int) -> int:
        """The run's trainer steps: trainer.total_steps, else trainer.total_epochs passes over `batches_per_epoch`
        batches of data.train_files. The learning-rate schedules span them."""
        return self.trainer.total_steps or self.trainer.total_epochs * batches_per_epoch

    @property
    def needs_old_log_prob_pass(self) -> bool:
        """Whether the step needs the actor's log-probs before its update as a pass of their own. Not when the update
        is exactly on-policy (synchronous training, one optimizer step: its only forward runs on the weights that
        sampled, so the old log-probs are that forward's own, detached, as TRL and verl's bypass mode take them),
        unless something reads them before the update: the reward's KL penalty, rollout correction, or the on-policy
        check (trainer.on_policy_check)."""
        correction = self.algorithm.rollout_correction
        corrected = correction.rollout_is is not None or correction.rollout_rs is not None \
            or correction.rollout_token_veto_threshold is not None
        return (self.trainer.mode != "sync" or self.optimizer_steps_per_update("actor") > 1
                or self.algorithm.use_kl_in_reward or corrected or self.trainer.on_policy_check is not None)

    @property
    def rule_scores(self) -> bool:
        """Whether a rule (reward.function or the built-in one) scores the samples: not when a reward model scores
        alone."""
        model = self.reward.model
        return model.path is None or model.rule_weight != 0 or model.combiner is not None

    @model_validator(mode="after")
    def _fill_derived_defaults(self) -> JobSpec:
        # Mutating in place: an "after" validator that returns a new object is unsupported by pydantic.
        self.ref.megatron = _with_unset_from(self.ref.megatron, self.actor.megatron)
        self.critic.megatron = _with_unset_from(self.critic.megatron, self.actor.megatron)
        for megatron in (self.actor.megatron, self.ref.megatron, self.teacher.megatron, self.critic.megatron):
            if megatron.expert_tensor_parallel_size is None:
                megatron.expert_tensor_parallel_size = megatron.tensor_model_parallel_size
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.adv_estimator == "gae"
        if self.actor.policy_loss.loss_mode is None:
            self.actor.policy_loss.loss_mode = "gspo" if self.algorithm.adv_estimator == "gspo" else "vanilla"
        if self.rollout.max_new_tokens is None:
            self.rollout.max_new_tokens = self.data.max_response_length
        if self.rollout.log_prob_micro_batch_size_per_gpu is None:
            self.rollout.log_prob_micro_batch_size_per_gpu = self.actor.ppo_micro_batch_size_per_gpu
        if self.teacher.log_prob_micro_batch_size_per_gpu is None:
            self.teacher.log_prob_micro_batch_size_per_gpu = self.rollout.log_prob_micro_batch_size_per_gpu
        if self.model.tokenizer_path is None:
            self.model.tokenizer_path = self.model.path
        if self.trainer.run_dir is None:
            self.trainer.run_dir = f"runs/{self.trainer.experiment_name}"
        return self


def optimizer_steps(sequences: int, mini_batch_sequences: int, epochs: int) -> int:
    """A PPO update's optimizer steps: one per mini-batch (the last may be short) in each epoch. The driver's progress
    bar, the on-policy rule (JobSpec.needs_old_log_prob_pass) and the actor's own guard all count with this."""
    return epochs * -(-sequences // mini_batch_sequences)


def micro_batch_tokens(per_gpu: int, megatron: MegatronConfig) -> int:
    """A token-budget micro-batch's tokens from a per-GPU budget (ppo_max_token_len_per_gpu, ...): each of the
    role's context-parallel ranks holds 1/CP of them."""
    return per_gpu * megatron.context_parallel_size


def _with_unset_from(own: MegatronConfig, parent: MegatronConfig) -> MegatronConfig:
    """`own`'s explicitly set fields on top of `parent`'s values."""
    explicit = {name: getattr(own, name) for name in own.model_fields_set}
    return parent.model_copy(update=explicit, deep=True)
