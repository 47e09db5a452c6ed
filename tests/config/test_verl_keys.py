"""`--verl`: verl's command-line keys mapped onto the spec, accepted with a note, or rejected with our equivalent."""
import ast
import re
from pathlib import Path

import pytest
import yaml

from rlmegatron.entry.cli import EXIT_BAD_SPEC, EXIT_OK, main
from rlmegatron.config.fieldpaths import path_problem
from rlmegatron.config.spec import ActorConfig, JobSpec
from rlmegatron.config import verl_keys
from rlmegatron.config.verl_keys import VERL_KEYS, Follows, Maps, translate
from rlmegatron.prelaunch.spec_pipeline import SPEC_STAGES, SpecSource, check_job

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


def verl_spec(path, args):
    """The spec verl's `args` make on top of the YAML at `path` (None: none), through the spec's stages, and the
    notes the translation printed."""
    job = check_job(SpecSource(path, tuple(args), verl=True), SPEC_STAGES)
    return job.spec, job.notes

# verl's GSM8K GRPO example (docs: GRPO, "Qwen2.5-0.5B" on one GPU), as a shell hands it over.
GSM8K_GRPO = """
algorithm.adv_estimator=grpo data.train_files=data/gsm8k/train.parquet data.val_files=data/gsm8k/test.parquet
data.train_batch_size=16 data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True
data.truncation=error actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=16
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.trace.backend=mlflow actor_rollout_ref.rollout.trace.token2text=True
actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=2
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.7 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","mlflow"]
trainer.project_name=verl_grpo_gsm8k trainer.experiment_name=qwen25_05b trainer.n_gpus_per_node=1 trainer.nnodes=1
trainer.default_local_dir=/data/gsmk8/checkpoints trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=5
""".split()

# Where the command's value is also rlmegatron's default, the base spec says otherwise, so the value can only
# come from the command.
BASE = {
    "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "hf_config": str(MODELS_DIR / "qwen2.5-0.5b")},
    "data": {"train_files": ["other.parquet"]},
    "actor": {"kl_loss_type": "k1", "entropy_coeff": 0.01, "offload": {"params": True, "optimizer": True}},
    "ref": {"offload": {"params": False}},
    "rollout": {"engine": "local", "tensor_parallel_size": 2},
    "algorithm": {"adv_estimator": "rloo", "use_kl_in_reward": True},
    "placement": {"nnodes": 2, "gpus_per_node": 8},
    "trainer": {"critic_warmup": 3},
    "tracking": {"backends": ["console"]},
}

# Every key of the command that sets a field: the field, and the value it must resolve to.
MAPPED = {
    "algorithm.adv_estimator": ("algorithm.adv_estimator", "grpo"),
    "data.train_files": ("data.train_files", ["data/gsm8k/train.parquet"]),
    "data.val_files": ("data.val_files", ["data/gsm8k/test.parquet"]),
    "data.train_batch_size": ("data.train_batch_size", 16),
    "data.max_prompt_length": ("data.max_prompt_length", 512),
    "data.max_response_length": ("data.max_response_length", 1024),
    "data.filter_overlong_prompts": ("data.filter_overlong_prompts", True),
    "actor_rollout_ref.model.path": ("model.path", "Qwen/Qwen2.5-0.5B-Instruct"),
    "actor_rollout_ref.actor.optim.lr": ("actor.optim.lr", 1e-6),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("actor.ppo_mini_batch_size", 16),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("actor.ppo_micro_batch_size_per_gpu", 4),
    "actor_rollout_ref.actor.use_kl_loss": ("actor.use_kl_loss", True),
    "actor_rollout_ref.actor.kl_loss_coef": ("actor.kl_loss_coef", 0.001),
    "actor_rollout_ref.actor.kl_loss_type": ("actor.kl_loss_type", "low_var_kl"),
    "actor_rollout_ref.actor.entropy_coeff": ("actor.entropy_coeff", 0.0),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("actor.megatron.recompute_granularity", "full"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ("actor.offload.params", False),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("actor.offload.optimizer", False),
    "actor_rollout_ref.rollout.trace.backend": ("tracking.rollout_trace.backend", "mlflow"),
    "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker": ("tracking.rollout_trace.prompts_per_step", 2),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("rollout.log_prob_micro_batch_size_per_gpu", 8),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("rollout.tensor_parallel_size", 1),
    "actor_rollout_ref.rollout.name": ("rollout.engine", "sglang"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("rollout.mem_fraction_static", 0.7),
    "actor_rollout_ref.rollout.n": ("rollout.n", 5),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("ref.log_prob_micro_batch_size_per_gpu", 8),
    "actor_rollout_ref.ref.fsdp_config.param_offload": ("ref.offload.params", True),
    "algorithm.use_kl_in_reward": ("algorithm.use_kl_in_reward", False),
    "trainer.critic_warmup": ("trainer.critic_warmup", 0),
    "trainer.logger": ("tracking.backends", ["console", "mlflow"]),
    "trainer.project_name": ("tracking.project_name", "verl_grpo_gsm8k"),
    "trainer.experiment_name": ("trainer.experiment_name", "qwen25_05b"),
    "trainer.n_gpus_per_node": ("placement.gpus_per_node", 1),
    "trainer.nnodes": ("placement.nnodes", 1),
    "trainer.default_local_dir": ("trainer.run_dir", "/data/gsmk8/checkpoints"),
    "trainer.save_freq": ("trainer.save_freq", 20),
    "trainer.test_freq": ("trainer.test_freq", 5),
    "trainer.total_epochs": ("trainer.total_epochs", 5),
}
# Keys whose value is what rlmegatron always does: accepted, with a note.
ALWAYS = ["data.truncation", "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.rollout.trace.token2text"]


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return str(path)


def resolved(tree: dict, field: str):
    for part in field.split("."):
        tree = tree[part]
    return tree


def test_gsm8k_grpo_command_maps_every_key_onto_the_spec(base, capsys):
    assert main(["validate", "--verl", base, *GSM8K_GRPO]) == EXIT_OK
    out, err = capsys.readouterr()
    spec = yaml.safe_load(out)
    given = {arg.split("=")[0] for arg in GSM8K_GRPO}
    assert set(MAPPED) | set(ALWAYS) == given and not set(MAPPED) & set(ALWAYS)  # none left out
    for key, (field, value) in MAPPED.items():
        assert resolved(spec, field) == value, key
    notes = err.splitlines()
    for key in ALWAYS:
        assert sum(note.startswith(f"note: {key}=") for note in notes) == 1, key  # said once
    assert "note: actor_rollout_ref.model.use_remove_padding=true: each micro-batch is THD-packed or right-padded, " \
           "whichever costs less compute" in notes
    assert any(note.startswith("note: actor_rollout_ref.rollout.name=vllm: vLLM is not used here") for note in notes)


def test_every_key_of_the_command_becomes_an_override_or_a_note():
    translation = translate(GSM8K_GRPO, BASE)
    assert translation.problems == [] and translation.follows == []
    accounted = {o.origin for o in translation.overrides} | {n.split(": ")[1].split("=")[0] for n in translation.notes}
    assert accounted == {arg.split("=")[0] for arg in GSM8K_GRPO}


def test_a_key_without_meaning_and_an_unknown_key_exit_2_naming_the_key_and_our_equivalent(base, capsys):
    args = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.optim.lrr=1e-6",
            "critic.model.lora_rank=32", "actor_rollout_ref.rollout.trace.backend=weave"]
    assert main(["validate", "--verl", base, *GSM8K_GRPO, *args]) == EXIT_BAD_SPEC
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "command line: actor_rollout_ref.actor.ulysses_sequence_parallel_size=2: use the role's "
        "megatron.context_parallel_size: Megatron-Core's context parallelism splits each sequence over ranks",
        "command line: actor_rollout_ref.actor.optim.lrr=1.0e-06: unknown verl key; did you mean "
        "actor_rollout_ref.actor.optim.lr (rlmegatron's actor.optim.lr)?",
        "command line: critic.model.lora_rank=32: LoRA adapters are the actor's (actor.lora); the critic trains every "
        "weight",
        "command line: actor_rollout_ref.rollout.trace.backend=weave: weave is not supported; use mlflow (a table "
        "and a text file per step), wandb (a table), tensorboard (a text summary) or console",
    ]


def test_a_spec_problem_names_the_verl_key_that_set_the_field(base, capsys):
    args = [arg for arg in GSM8K_GRPO if not arg.startswith("actor_rollout_ref.rollout.n=")]
    assert main(["validate", base, "--verl", *args, "actor_rollout_ref.rollout.n=0"]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err.splitlines() == [
        "command line: rollout.n=0: should be greater than or equal to 1 (set by actor_rollout_ref.rollout.n)"]


def test_sub_keys_rejected_with_their_parent_and_hydra_syntax(base):
    translation = translate(["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",
                             "~data.use_shm", "trainer.total_epochs=${oc.env:EPOCHS}"], BASE)
    assert [str(p) for p in translation.problems] == [
        "command line: actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0: no meaning in rlmegatron: "
        "an FSDP setting; rlmegatron shards with Megatron-Core, so set the role's megatron section "
        "(e.g. actor.megatron.tensor_model_parallel_size) instead",
        "command line: ~data.use_shm: this verl key sets no field of its own to delete; leave the key out",
        "command line: trainer.total_epochs=${oc.env:EPOCHS}: Hydra interpolations are not resolved here; write the "
        "value itself",
    ]


@pytest.mark.parametrize("rejected, advised, default", [
    (["trainer.total_epochs=2"], "~trainer.total_steps", None),  # an rlmegatron field the YAML sets
    (["trainer.val_before_train=false", "trainer.test_freq=-1"], "~data.val_files", []),  # verl's key, same name
])
def test_a_deletion_the_advice_names_works_with_verl(rejected, advised, default, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["validate", "--verl", "configs/quickstart.yaml", *rejected]) == EXIT_BAD_SPEC
    assert f"({advised} on the command line)" in capsys.readouterr().err
    assert main(["validate", "--verl", "configs/quickstart.yaml", *rejected, advised]) == EXIT_OK
    resolved = yaml.safe_load(capsys.readouterr().out)
    section, key = advised[1:].split(".")
    assert resolved[section][key] == default


def test_translations_that_combine_yield_or_conflict(base, tmp_path):
    def spec_with(*args):
        return verl_spec(base, [*GSM8K_GRPO, *args])

    # Hydra's + prefix, rlmegatron's own keys beside verl's, and a path + name pair joined into one plug-in.
    reward, dataset = tmp_path / "r.py", tmp_path / "d.py"
    reward.touch(), dataset.touch()
    spec, _ = spec_with("+trainer.val_before_train=False", "trainer.seed=7", f"custom_reward_function.path={reward}",
                        f"data.custom_cls.path={dataset}", "data.custom_cls.name=Prompts")
    assert (spec.trainer.val_before_train, spec.trainer.seed) == (False, 7)
    assert (spec.reward.function, spec.data.dataset_class) == (f"{reward}:compute_score", f"{dataset}:Prompts")
    # verl's clip_ratio yields to clip_ratio_high, and enable_gradient_checkpointing to an explicit granularity.
    spec, notes = spec_with("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity="
                            "selective", "actor_rollout_ref.actor.megatron.override_transformer_config."
                            "apply_rope_fusion=False",
                            "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3",
                            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]")
    assert (spec.actor.clip_ratio_low, spec.actor.clip_ratio_high) == (0.3, 0.28)
    assert spec.actor.megatron.recompute_granularity == "selective"
    assert spec.actor.megatron.extra == {"apply_rope_fusion": False}
    assert spec.rollout.sglang.extra_args == {"attention-backend": "fa3"}
    assert (spec.actor.optim.adam_beta1, spec.actor.optim.adam_beta2) == (0.9, 0.95)
    assert ("note: actor_rollout_ref.actor.clip_ratio=0.3: actor.clip_ratio_high comes from "
            "actor_rollout_ref.actor.clip_ratio_high instead") in notes
    # Two keys that set one field differently, and a key whose rlmegatron field is set elsewhere, are errors.
    with pytest.raises(Exception) as rejected:
        spec_with("actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=2.0",
                  "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True")
    assert [str(p) for p in rejected.value.problems] == [
        "command line: actor_rollout_ref.actor.optim.clip_grad=2.0: sets actor.optim.clip_grad=2.0, but "
        "actor_rollout_ref.actor.grad_clip sets it to 0.5; keep one of them",
        "command line: actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true: rlmegatron uses "
        "actor.use_dynamic_bsz for this, which is false; set that instead",
    ]
    # With dynamic batching the command's micro-batch size would change nothing, which the spec rejects.
    dynamic = [arg for arg in GSM8K_GRPO if not arg.startswith(("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                                                  "actor_rollout_ref.rollout.log_prob_micro"))]
    _, notes = verl_spec(base, [*dynamic, "actor_rollout_ref.actor.use_dynamic_bsz=True",
                                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                     "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True"])
    assert ("note: actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true: rlmegatron uses actor.use_dynamic_bsz "
            "for this, which is the same") in notes


def test_every_mapped_field_is_a_spec_field():
    # actor.policy_loss arrives with the policy-loss registry; until then its keys fail as unknown spec keys.
    pending = () if "policy_loss" in ActorConfig.model_fields else ("actor.policy_loss.",)
    for key, entry in VERL_KEYS.items():
        fields = entry.fields if isinstance(entry, Maps) else (entry.field,) if isinstance(entry, Follows) else ()
        for field in fields:
            if not field.startswith(pending or ("\0",)):
                assert path_problem(JobSpec, tuple(field.rstrip(".").split("."))) is None, (key, field)


def test_conversions_that_read_other_keys():
    def translated(*args):
        translation = translate(args, BASE)
        return {o.path: o.value for o in translation.overrides}, [str(p) for p in translation.problems]

    # A critic from the policy's own checkpoint is rlmegatron's critic.init_from=actor.
    assert translated("critic.model.path=Qwen/Qwen2.5-0.5B-Instruct")[0] == {"critic.init_from": "actor"}
    assert translated("critic.model.path=/rm")[0] == {"critic.init_from": "/rm"}
    assert translated("trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_4")[0] == {
        "trainer.resume": "/ckpt/step_4"}
    assert translated("trainer.resume_mode=resume_path")[1] == [
        "command line: trainer.resume_mode=resume_path: needs trainer.resume_from_path=PATH (rlmegatron's "
        "trainer.resume=PATH)"]
    # verl's loggers that rlmegatron has are its tracking backends, in any combination; the others are named.
    assert translated("trainer.logger=[console,wandb]") == ({"tracking.backends": ["console", "wandb"]}, [])
    assert translated("trainer.logger=[tensorboard,mlflow,wandb]")[0] == {
        "tracking.backends": ["tensorboard", "mlflow", "wandb"]}
    assert translated("actor_rollout_ref.rollout.trace.backend=wandb", "trainer.logger=[wandb]")[0] == {
        "tracking.rollout_trace.backend": "wandb", "tracking.backends": ["wandb"]}
    assert translated("trainer.logger=[console,swanlab]")[1] == [
        "command line: trainer.logger=[console, swanlab]: rlmegatron tracks to console, mlflow, wandb and tensorboard "
        "only; drop swanlab"]
    assert translated("actor_rollout_ref.rollout.do_sample=False", "actor_rollout_ref.actor.kl_loss_type=mse")[0] == {
        "rollout.temperature": 0.0, "actor.kl_loss_type": "k2"}
    # verl's older TIS knob is token-level truncated importance sampling; its -1 turns it off.
    assert translated("actor_rollout_ref.actor.tis_imp_ratio_cap=2.0")[0] == {
        "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_threshold": 2.0}
    assert translated("actor_rollout_ref.actor.tis_imp_ratio_cap=-1") == ({}, [])
    # verl's rollout-correction keys of the same name apply as they are; its bypass mode is not rlmegatron's.
    assert translated("algorithm.rollout_correction.rollout_rs=geometric")[0] == {
        "algorithm.rollout_correction.rollout_rs": "geometric"}
    assert translated("algorithm.rollout_correction.bypass_mode=True")[1] == [
        "command line: algorithm.rollout_correction.bypass_mode=true: the old log-probs are always the trainer's own, "
        "recomputed; the rollout's only weigh or reject samples"]


def test_verls_own_command_line_needs_no_base_spec():
    """verl's command line is the whole job there: `rlm train --verl KEY=VALUE ...` reads it the same way, on the
    spec's defaults, with what verl has no key for (here a hub model's config.json) among its keys."""
    spec, _ = verl_spec(None, [*GSM8K_GRPO, f"model.hf_config={MODELS_DIR / 'qwen2.5-0.5b'}"])
    assert (spec.model.path, spec.data.train_files, spec.trainer.total_epochs, spec.trainer.total_steps,
            spec.trainer.run_dir) == ("Qwen/Qwen2.5-0.5B-Instruct", ["data/gsm8k/train.parquet"], 5, None,
                                      "/data/gsmk8/checkpoints")


def test_lora_reward_model_images_and_padding_translate_onto_the_fields_the_spec_has():
    def translated(*args):
        translation = translate(args, BASE)
        return {o.path: o.value for o in translation.overrides}, [str(p) for p in translation.problems], \
            translation.notes

    overrides, problems, _ = translated("actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=64",
                                        "actor_rollout_ref.model.target_modules=all-linear")
    assert problems == [] and overrides == {"actor.lora.rank": 32, "actor.lora.alpha": 64, "actor.lora.target_modules": [
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
    overrides, problems, notes = translated("actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]")
    assert overrides == {"actor.lora.target_modules": ["linear_qkv", "linear_fc2"]} and problems == []
    assert "Megatron-Core fuses k_proj and q_proj and v_proj into one linear" in notes[0]
    assert translated("actor_rollout_ref.model.target_modules=[lm_head]")[1] == [
        "command line: actor_rollout_ref.model.target_modules=[lm_head]: adapters go on all-linear or on q_proj, "
        "k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj; not on lm_head"]
    # A reward model: verl's switch and its path become reward.model.path; its batching and layout, reward.model's.
    overrides, problems, _ = translated("reward_model.enable=True", "reward_model.model.path=/rm",
                                        "reward_model.micro_batch_size_per_gpu=8",
                                        "reward_model.megatron.tensor_model_parallel_size=2")
    assert problems == [] and overrides == {"reward.model.path": "/rm", "reward.model.micro_batch_size_per_gpu": 8,
                                            "reward.model.tensor_model_parallel_size": 2}
    assert translated("reward_model.enable=True")[1] == [
        "command line: reward_model.enable=true: needs reward_model.model.path (rlmegatron's reward.model.path), the "
        "model that scores"]
    assert translated("data.image_key=pictures")[0] == {"data.image_key": "pictures"}
    assert translated("actor_rollout_ref.rollout.quantization=fp8")[0] == {"rollout.quantization": "fp8"}
    # The padded path is there: each micro-batch is laid out as it pays, so either value is accepted with a note.
    for value in ("True", "False"):
        overrides, problems, notes = translated(f"actor_rollout_ref.model.use_remove_padding={value}")
        assert (overrides, problems) == ({}, []) and "right-padded" in notes[0]


# Features of the spec, by the words a message would name them with, and the field that holds each. A message that
# calls one of them unsupported has drifted from the spec (issue 26).
FEATURES = {"lora": "actor.lora.rank", "adapter": "actor.lora.rank", "reward model": "reward.model.path",
            "model-based reward": "reward.model.path", "multimodal": "data.image_key", "image": "data.image_key",
            "fp8": "rollout.quantization", "quantiz": "rollout.quantization", "multi-turn": "rollout.multi_turn.tools",
            "tool": "rollout.multi_turn.tools", "context parallel": "actor.megatron.context_parallel_size",
            "router": "rollout.sglang.router", "asynchronous": "trainer.mode", "padded": None}
UNSUPPORTED = re.compile(r"not supported|unsupported|there is no\b|is not built|are not read")
FIELD_PATH = re.compile(r"\b[a-z_]+(?:\.[a-z_0-9]+)+\b")


def _messages() -> list[str]:
    """Every text verl_keys.py can show: its string constants, f-strings with their fields left out."""
    texts = []
    for node in ast.walk(ast.parse(Path(verl_keys.__file__).read_text())):
        if isinstance(node, ast.JoinedStr):
            texts.append("".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
    return texts


def test_a_not_supported_message_names_nothing_the_spec_has():
    for field in filter(None, FEATURES.values()):
        assert path_problem(JobSpec, tuple(field.split("."))) is None, f"FEATURES names {field}, not a spec field"
    drifted = []
    for text in _messages():
        # The clause that says what is missing; the rest names the alternative (which the spec has).
        for clause in re.split(r"[;:]", text):
            if not UNSUPPORTED.search(clause):
                continue
            words = [word for word in FEATURES if word in clause.lower() and FEATURES[word]]
            fields = [path for path in FIELD_PATH.findall(clause) if path_problem(JobSpec, tuple(path.split("."))) is None]
            if words or fields:
                drifted.append(f"{clause.strip()!r} names {', '.join(words + fields)}, which the spec has")
    assert not drifted, "\n".join(drifted)
    # The test sees the messages it guards: one the table has, and a stale one it would catch.
    assert any("weave is not supported" in text for text in _messages())
    clause = "LoRA is not supported"
    assert UNSUPPORTED.search(clause) and any(word in clause.lower() for word in FEATURES)
