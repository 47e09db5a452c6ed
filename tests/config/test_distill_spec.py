"""On-policy distillation's spec: the teacher section becomes its role (own layout, batching, offload, checkpoint), and
what cannot run is one line before anything starts: a distill without a teacher, a teacher without a distill, a mode
that does not exist, a critic with nothing to learn, a teacher of another vocabulary or tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from rlmegatron.driver.role_settings import trainer_rank_settings
from rlmegatron.entry.cli import EXIT_BAD_SPEC, main
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
from rlmegatron.runtime import ParallelLayout
from tests.config.specs import MODELS_DIR, minimal_spec, problems_of
from tests.rank.test_policy_rank import write_hf_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TEACHER = f"teacher.path={MODELS_DIR / 'tiny-qwen3-moe'}"
DISTILL = "algorithm.distill.coef=0.5"


def test_the_teacher_role_is_laid_out_batched_and_offloaded_by_its_own_section():
    spec = spec_from_raw(minimal_spec("tiny-qwen3-moe"), [
        TEACHER, DISTILL, "actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true",
        "teacher.megatron.pipeline_model_parallel_size=2", "teacher.megatron.virtual_pipeline_model_parallel_size=2",
        "teacher.megatron.context_parallel_size=2", "teacher.megatron.expert_model_parallel_size=2",
        "teacher.megatron.expert_tensor_parallel_size=1", "teacher.megatron.extra={attention_dropout: 0.0}",
        "teacher.log_prob_micro_batch_size_per_gpu=5", "teacher.log_prob_use_dynamic_bsz=true",
        "teacher.log_prob_max_token_len_per_gpu=300", "teacher.offload.params=true"])
    settings = trainer_rank_settings(spec, 10)
    teacher = settings.roles["teacher"]
    assert list(settings.roles) == ["actor", "teacher"] and settings.teacher_path == str(MODELS_DIR / "tiny-qwen3-moe")
    # Its layout is its own: fields it leaves unset are Megatron's defaults (TP=1), not the actor's (TP=2 + SP).
    assert teacher.layout == ParallelLayout(tp=1, pp=2, vpp=2, cp=2, ep=2, etp=1, sequence_parallel=False)
    assert settings.roles["actor"].layout.tp == 2
    assert teacher.config_options == {"attention_dropout": 0.0}
    assert teacher.offload == ("params",)
    # Its forward batching is its own; its log-probs are computed as the actor's (temperature, routing off).
    assert (teacher.worker.micro_batch_size, teacher.worker.max_token_len) == (5, 300 * 2)  # x CP
    assert teacher.worker.temperature == settings.roles["actor"].worker.temperature
    assert teacher.worker.routing_replay == "off"
    # Unset, the teacher's micro-batches follow the student's log-prob batching.
    unset = spec_from_raw(minimal_spec("tiny-qwen3-moe"), [TEACHER, DISTILL, "actor.ppo_micro_batch_size_per_gpu=2"])
    assert trainer_rank_settings(unset, 10).roles["teacher"].worker.micro_batch_size == 2
    plain = trainer_rank_settings(spec_from_raw(minimal_spec("tiny-qwen3-moe"), []), 10)
    assert "teacher" not in plain.roles and plain.teacher_path is None


def test_distillation_without_a_teacher_and_a_teacher_without_distillation_are_one_line_each():
    raw = minimal_spec()
    assert problems_of(raw, DISTILL) == [
        "command line: algorithm.distill: needs a teacher to distill from; set teacher.path to its HF checkpoint (or a "
        "checkpoint written by `rlm convert hf-to-mcore`)"]
    assert problems_of(raw, TEACHER) == [
        f"command line: {TEACHER}: the teacher only scores the student's tokens for on-policy distillation, and "
        "algorithm.distill is not set; remove it (~teacher.path on the command line) or set algorithm.distill"]
    assert problems_of(raw, TEACHER, DISTILL) == []


def test_an_unknown_mode_a_critic_and_a_training_knob_of_the_teacher_are_refused():
    raw = minimal_spec()
    assert problems_of(raw, TEACHER, "algorithm.distill.mode=forward_kl") == [
        "command line: algorithm.distill.mode=forward_kl: is not a registered distillation mode (reverse_kl)"]
    critic = problems_of(raw, TEACHER, "algorithm.distill.only=true", "algorithm.adv_estimator=gae",
                         "critic.ppo_mini_batch_size=8")
    assert critic[0].startswith("command line: algorithm.distill.only=true: the advantage is the teacher's term alone")
    for knob in ("recompute_granularity=full", "recompute_method=block", "recompute_num_layers=2",
                 "use_distributed_optimizer=false"):
        field = knob.partition("=")[0]
        # (recompute_method and recompute_num_layers without full recompute also say that they do nothing there)
        assert (f"command line: teacher.megatron.{knob}: the teacher never trains (no optimizer, no backward pass); "
                f"remove it (~teacher.megatron.{field} on the command line)"
                in problems_of(raw, TEACHER, DISTILL, f"teacher.megatron.{knob}"))


def test_the_teachers_architecture_comes_from_its_config_or_hf_config_and_its_layout_must_fit_it(tmp_path):
    raw = minimal_spec()
    # tiny-qwen3-moe has 4 attention heads: TP=8 cannot split them.
    heads = problems_of(raw, TEACHER, DISTILL, "teacher.megatron.tensor_model_parallel_size=8")[0]
    assert heads == ("command line: teacher.megatron.tensor_model_parallel_size=8: does not divide the model's 4 "
                     "attention heads; use 1, 2 or 4"), heads
    # A hub id is read through teacher.hf_config; without one it is one line.
    hub = "teacher.path=Org/Teacher"
    assert problems_of(raw, hub, DISTILL) == [
        "command line: teacher.path=Org/Teacher: is not a local directory and teacher.hf_config is not set; hub ids "
        "cannot be fetched here, so set teacher.hf_config to the teacher's config.json (configs/models/ has common "
        "ones)"]
    assert problems_of(raw, hub, DISTILL, f"teacher.hf_config={MODELS_DIR / 'tiny-qwen3-moe'}") == []
    # Another vocabulary: its log-probs could not be compared token by token.
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((MODELS_DIR / "tiny-qwen3-moe" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    [vocabulary] = problems_of(raw, f"teacher.path={other}", DISTILL)
    assert "has a vocabulary of 300 tokens and the student (model.path) 256" in vocabulary


def test_a_teacher_whose_tokenizer_is_not_the_students_is_refused_by_rlm_validate(tmp_path, monkeypatch, capsys):
    """The quickstart's char tokenizer against a copy of itself (accepted) and a copy with two tokens swapped; a
    teacher directory without weights is refused too."""
    monkeypatch.chdir(REPO_ROOT)
    same, swapped = tmp_path / "same", tmp_path / "swapped"
    for directory in (same, swapped):
        write_hf_model(directory)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = ["validate", "configs/quickstart.yaml", "algorithm.distill.only=true",
            f"trainer.run_dir={tmp_path / 'run'}"]
    assert main([*args, f"teacher.path={same}"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*args, "teacher.path=configs/quickstart/model"]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err.strip() == (
        "teacher.path=configs/quickstart/model: has no model.safetensors or model.safetensors.index.json; point it at "
        "the teacher's HF checkpoint, or a checkpoint written by `rlm convert hf-to-mcore`")
    assert main([*args, f"teacher.path={swapped}"]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err.strip()
    assert err == (f"teacher.path={swapped}: its tokenizer is not the student's "
                   "(model.tokenizer_path=configs/quickstart/model): token 'a' (the student's id "
                   f"{vocab['b']}) is id {vocab['a']} there; distillation compares log-probs token by token, so it "
                   "needs a teacher with the student's tokenizer (cross-tokenizer distillation is not supported)"), err


def test_distillation_alone_needs_no_groups_and_refuses_the_estimators_settings():
    """With only=true no estimator runs on the reward: one response per prompt is enough, and a setting of the
    estimator (or the in-reward KL, which shapes the reward it would read) would change nothing."""
    raw = minimal_spec()
    alone = (TEACHER, "algorithm.distill.only=true")
    assert problems_of(raw, *alone, "rollout.n=1", "actor.ppo_mini_batch_size=16") == []
    assert problems_of(raw, *alone, "rollout.n=1", "actor.ppo_mini_batch_size=16",
                       "algorithm.distill.baseline=group_mean") == [
        "command line: algorithm.distill.baseline=group_mean: subtracts the mean over each prompt's responses, which "
        "needs rollout.n >= 2; use baseline=none, or sample more responses per prompt"]
    assert problems_of(raw, DISTILL, TEACHER, "rollout.n=1", "actor.ppo_mini_batch_size=16") == [
        "command line: rollout.n=1: algorithm.adv_estimator=grpo compares the responses to each prompt, which needs "
        "rollout.n >= 2"]
    for setting in ("algorithm.norm_adv_by_std_in_grpo=false", "algorithm.use_kl_in_reward=true",
                    "algorithm.adv_estimator=rloo"):
        field = setting.partition("=")[0]
        assert problems_of(raw, *alone, setting) == [
            f"command line: {setting}: with algorithm.distill.only=true the advantage is the teacher's term alone: no "
            f"estimator runs on the reward; remove it (~{field} on the command line) or set "
            "algorithm.distill.only=false"]
