"""The spec becomes each role's settings: a spec with every field off its default lands in the actor's, critic's and
reference's settings (pure Python), and a policy rank built from such a spec runs with them (one gloo rank)."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlmegatron.algorithms import PolicyLossConfig
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
# Where the spec becomes role settings; one import line to repoint when that code moves.
from rlmegatron.driver.role_settings import _offload_parts, actor_settings, critic_settings, parallel_layout, rollout_settings
from rlmegatron.runtime import ParallelLayout
from rlmegatron.transport.local_ranks import run_ranks
from rlmegatron.rank.roles import OptimizerSettings
from tests.config.specs import minimal_spec
from tests.helpers.fp8_engine import engine_vs_fp8_actor

REPO_ROOT = Path(__file__).resolve().parents[2]


def spec(*overrides: str, model: str = "tiny-qwen3"):
    return spec_from_raw(minimal_spec(model), overrides)


def test_the_actor_settings_carry_every_actor_field():
    settings = actor_settings(spec(
        "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=1024", "actor.optim.lr=2e-6", "actor.optim.weight_decay=0.1",
        "actor.optim.adam_beta1=0.8", "actor.optim.adam_beta2=0.95", "actor.optim.adam_eps=1e-6",
        "actor.optim.clip_grad=0.5", "actor.clip_ratio_low=0.1", "actor.clip_ratio_high=0.28",
        "actor.clip_ratio_c=5.0", "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.05", "actor.kl_loss_type=k2",
        "rollout.temperature=0.7", "actor.optim.min_lr=1e-7", "actor.optim.lr_warmup_steps=2",
        "actor.optim.lr_decay_style=cosine"), total_steps=10)
    assert settings.ppo_mini_batch_size == 4 * 4  # prompts x rollout.n sequences
    assert (settings.ppo_epochs, settings.max_token_len, settings.loss_agg_mode) == (2, 1024, "seq-mean-token-mean")
    assert settings.optimizer == OptimizerSettings(lr=2e-6, min_lr=1e-7, lr_warmup_steps=2, lr_decay_style="cosine",
                                                   lr_decay_steps=10, weight_decay=0.1, adam_beta1=0.8,
                                                   adam_beta2=0.95, adam_eps=1e-6, clip_grad=0.5)
    assert settings.policy_loss_config == PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=5.0)
    assert (settings.use_kl_loss, settings.kl_loss_coef, settings.kl_loss_type) == (True, 0.05, "k2")
    assert (settings.entropy_coeff, settings.temperature) == (0.01, 0.7)
    # Micro-batches by count unless the token budget is on; greedy rollouts score log-probs at temperature 1.
    counted = actor_settings(spec("actor.ppo_micro_batch_size_per_gpu=2", "rollout.temperature=0"), 1)
    assert (counted.micro_batch_size, counted.max_token_len, counted.temperature) == (2, None, 1.0)


def test_the_actor_settings_carry_the_moe_routing_fields_and_the_reference_routes_freely():
    from rlmegatron.driver.role_settings import reference_settings

    replayed = spec("actor.moe.routing_replay=r2", "actor.moe.routing_agreement=true", model="tiny-qwen3-moe")
    settings = actor_settings(replayed, 1)
    assert (settings.routing_replay, settings.routing_agreement) == ("r2", True)
    reference = reference_settings(settings, replayed.ref)
    assert (reference.routing_replay, reference.routing_agreement) == ("off", False)
    assert replayed.actor.wants_rollout_routing
    assert not spec("actor.moe.routing_replay=r2", model="tiny-qwen3-moe").actor.wants_rollout_routing
    assert spec("actor.moe.routing_replay=r3", model="tiny-qwen3-moe").actor.wants_rollout_routing


def test_a_per_gpu_token_budget_holds_the_tokens_of_every_context_parallel_rank():
    # Each of the CP ranks holds 1/CP of a micro-batch's tokens, so the micro-batch packs CP x the per-GPU budget.
    cp2 = spec("actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=1024",
               "actor.megatron.context_parallel_size=2", "algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true",
               "critic.ppo_max_token_len_per_gpu=512", "critic.megatron.context_parallel_size=4",
               "critic.ppo_mini_batch_size=8")
    assert actor_settings(cp2, 1).max_token_len == 2048
    assert critic_settings(cp2, 1).max_token_len == 4 * 512  # the critic's own CP


def test_the_critic_settings_carry_every_critic_field_and_the_shared_loss_aggregation():
    settings = critic_settings(spec(
        "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2", "critic.ppo_epochs=3",
        "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=2048", "critic.optim.lr=3e-5",
        "critic.optim.weight_decay=0.2", "critic.optim.adam_beta1=0.7", "critic.optim.adam_beta2=0.9",
        "critic.optim.adam_eps=1e-7", "critic.optim.clip_grad=0.25", "critic.cliprange_value=0.2",
        "actor.loss_agg_mode=seq-mean-token-sum", "critic.optim.min_lr=1e-6", "critic.optim.lr_warmup_steps=3",
        "critic.optim.lr_decay_style=linear"), total_steps=20)
    assert (settings.ppo_mini_batch_size, settings.ppo_epochs, settings.max_token_len) == (2 * 4, 3, 2048)
    assert settings.optimizer == OptimizerSettings(lr=3e-5, min_lr=1e-6, lr_warmup_steps=3, lr_decay_style="linear",
                                                   lr_decay_steps=20, weight_decay=0.2, adam_beta1=0.7,
                                                   adam_beta2=0.9, adam_eps=1e-7, clip_grad=0.25)
    assert settings.cliprange_value == 0.2
    # One aggregation for both roles (spec.CriticConfig says why).
    assert settings.loss_agg_mode == "seq-mean-token-sum"
    counted = critic_settings(spec("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8",
                                   "critic.ppo_micro_batch_size_per_gpu=2"), 1)
    assert (counted.micro_batch_size, counted.max_token_len) == (2, None)


def test_the_actor_gets_the_chosen_loss_and_every_knob():
    spec = spec_from_raw(minimal_spec(), [
        "actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.01",
        "actor.policy_loss.clip_cov_lb=0.5", "actor.policy_loss.clip_cov_ub=2.0", "actor.clip_ratio_low=0.1",
        "actor.clip_ratio_high=0.28"])
    settings = actor_settings(spec, 1)
    assert settings.policy_loss == "clip_cov"
    assert settings.policy_loss_config == PolicyLossConfig(
        clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0, clip_cov_ratio=0.01,
        clip_cov_lb=0.5, clip_cov_ub=2.0)
    kl_cov = actor_settings(spec_from_raw(minimal_spec(), [
        "actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.05",
        "actor.policy_loss.ppo_kl_coef=1.0"]), 1)
    assert (kl_cov.policy_loss, kl_cov.policy_loss_config.kl_cov_ratio, kl_cov.policy_loss_config.ppo_kl_coef) == (
        "kl_cov", 0.05, 1.0)
    no_dual_clip = actor_settings(spec_from_raw(minimal_spec(), ["actor.clip_ratio_c=null"]), 1)
    assert no_dual_clip.policy_loss_config.clip_ratio_c is None
    assert actor_settings(spec_from_raw(minimal_spec(), ["algorithm.adv_estimator=gspo"]), 1).policy_loss == "gspo"


def test_the_multi_turn_section_reaches_the_engines_agent_loop():
    assert rollout_settings(spec()).multi_turn is None  # no tools: single completions, no agent loop
    settings = rollout_settings(spec(
        "rollout.multi_turn.tools=[{plugin: python, config: {cpu_s: 2}}, {plugin: tools.py:Lookup}]",
        "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tool_response_length=17",
        "rollout.multi_turn.tool_timeout_s=2.5", "model.tokenizer_path=some/tokenizer")).multi_turn
    assert (settings.max_turns, settings.max_tool_response_length, settings.tool_timeout_s) == (3, 17, 2.5)
    assert settings.tools == (("python", {"cpu_s": 2}), ("tools.py:Lookup", {}))
    assert (settings.tool_call_format, settings.tokenizer_path) == ("hermes", "some/tokenizer")


def test_the_actor_layout_is_the_spec_layout():
    layout = parallel_layout(spec(
        "actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true",
        "actor.megatron.expert_model_parallel_size=4", "actor.megatron.expert_tensor_parallel_size=1",
        "actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.virtual_pipeline_model_parallel_size=2",
        "actor.ppo_micro_batch_size_per_gpu=4", model="tiny-qwen3-moe").actor.megatron)
    assert layout == ParallelLayout(tp=2, pp=2, vpp=2, cp=1, ep=4, etp=1, sequence_parallel=True)


@pytest.mark.parametrize("parts", [("params",), ("grads",), ("optimizer",), ("params", "optimizer")])
def test_each_offload_field_offloads_its_part(parts):
    offload = [f"{role}.offload.{part}=true" for role in ("actor", "critic") for part in parts]
    reference = ["actor.use_kl_loss=true"] + (["ref.offload.params=true"] if "params" in parts else [])
    resolved = spec("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8", *offload, *reference)
    assert _offload_parts(resolved.actor.offload) == parts
    assert _offload_parts(resolved.critic.offload) == parts
    assert _offload_parts(resolved.ref.offload) == tuple(part for part in parts if part == "params")


# --- a policy rank built from a spec ------------------------------------------------------------------------------

# 4 prompts x 2 samples (the synthetic batch of tests/rank/roles/jobs.py: 6 + 6 tokens); every role, offloaded parts.
RANK_SPEC = [
    "placement.gpus_per_node=1", "data.train_batch_size=4", "rollout.n=2", "data.max_prompt_length=6",
    "data.max_response_length=6", "data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1",
    "model.dtype=bf16", "trainer.seed=7",
    "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
    "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2", "actor.ppo_micro_batch_size_per_gpu=2",
    "actor.optim.lr=2e-3", "actor.optim.weight_decay=0.05", "actor.optim.adam_beta1=0.8",
    "actor.optim.adam_beta2=0.95", "actor.optim.adam_eps=1e-6", "actor.optim.clip_grad=0.5",
    "critic.ppo_mini_batch_size=1", "critic.ppo_epochs=2", "critic.use_dynamic_bsz=true",
    "critic.ppo_max_token_len_per_gpu=12", "critic.optim.lr=3e-3", "critic.optim.weight_decay=0.02",
    "critic.optim.adam_beta1=0.7", "critic.optim.adam_beta2=0.9", "critic.optim.adam_eps=1e-7",
    "critic.optim.clip_grad=0.25",
    "actor.offload.params=true", "actor.offload.optimizer=true", "ref.offload.params=true", "critic.offload.grads=true",
]
OPTIMIZER_FIELDS = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")


def _reward_model(directory: Path) -> Path:
    """A one-label token-classification model of the quickstart architecture: what critic.init_from may name."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "model", tie_word_embeddings=False,
                                        num_labels=1)
    torch.manual_seed(3)
    AutoModelForTokenClassification.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def _first_weights(rank):
    """The actor's word embeddings: a seeded random init."""
    from rlmegatron.rank.roles.megatron_step import unwrap

    with rank.models.phase("actor"):
        return unwrap(rank.models.actor.chunks[0]).embedding.word_embeddings.weight.detach().float().clone()


def _rank_job(workdir: str) -> dict:
    import os
    from dataclasses import replace

    import torch
    from safetensors.torch import load_file

    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.rollout.local import checkpoint_named_weights
    from rlmegatron.rank.roles import megatron_step
    from tests.rank.roles.jobs import rollout_batch

    os.chdir(REPO_ROOT)  # the quickstart spec's paths are relative to the repository
    micro_batches: list[list[tuple[int, int]]] = []  # (sequences, tokens) per micro-batch, per schedule call
    schedule = megatron_step.forward_backward

    def recording(chunks, batches, *args, **kwargs):
        micro_batches.append([(len(mb.rows), len(mb.source_index) + len(mb.rows)) for mb in batches])
        return schedule(chunks, batches, *args, **kwargs)

    megatron_step.forward_backward = recording
    reward_model = _reward_model(Path(workdir) / "reward_model")
    spec = load_spec("configs/quickstart.yaml", [*RANK_SPEC, f"critic.init_from={reward_model}",
                                                 f"trainer.run_dir={workdir}/run"])
    rank = PolicyRank(trainer_rank_settings(spec, 1))
    report = {
        "offload_parts": rank.models.offload_parts,
        "offloaded": {role: getattr(rank.models, role).offloader.offloaded_bytes for role in rank.models.offload_parts},
        "optimizers": {role: [{name: getattr(o.config, name) for name in OPTIMIZER_FIELDS}
                              for o in getattr(getattr(rank.models, role).optimizer, "chained_optimizers", [])]
                       for role in ("actor", "critic")},
        "engine_dtypes": {str(p.dtype) for p in rank.engine.leader.model.parameters()},
        "weights": _first_weights(rank),
    }
    served = checkpoint_named_weights(rank.engine.leader.model)
    with rank.models.phase("actor"):  # the exported tensors may share the (offloaded) parameters' storage
        # Megatron's local norms keep fp32 weights whatever the dtype; the matmul weights follow it.
        report["actor_dtypes"] = {str(p.dtype) for name, p in rank.models.actor.chunks[0].named_parameters()
                                  if "layernorm" not in name}
        report["engine_holds_the_actor"] = all(torch.equal(served[name], tensor) for name, tensor
                                               in HFWeightExporter(rank.models.actor.chunks,
                                                                   rank.models.weight_map).stream())
    with rank.models.phase("critic"):
        head = megatron_step.unwrap(rank.models.critic.chunks[-1]).output_layer.weight.detach().clone()
    report["value_head_is_the_score"] = torch.equal(
        head, load_file(reward_model / "model.safetensors")["score.weight"].to(head.dtype))

    batch = rollout_batch(n=8)
    steps = {"actor": [], "critic": []}
    log_probs = rank.compute_log_prob(batch)
    values = rank.compute_values(batch)
    micro_batches.clear()
    train = replace(batch, old_log_probs=log_probs, values=values, returns=values + 0.3 * batch.response_mask)
    rank.update_critic(train, steps["critic"].append)
    report["critic_micro_batches"] = list(micro_batches)
    micro_batches.clear()
    rank.update_actor(train, steps["actor"].append)
    report["actor_micro_batches"] = list(micro_batches)
    report["optimizer_steps"] = {role: len(reported) for role, reported in steps.items()}
    rank.shutdown()

    other = PolicyRank(trainer_rank_settings(load_spec("configs/quickstart.yaml", [
        "placement.gpus_per_node=1", "model.dtype=bf16", "trainer.seed=8", "rollout.quantization=fp8",
        f"trainer.run_dir={workdir}/other"]), 1))
    report["weights_at_seed_8"] = _first_weights(other)
    report["fp8_engine"] = engine_vs_fp8_actor(other)
    other.shutdown()
    return report


@pytest.fixture(scope="module")
def rank_report(tmp_path_factory):
    return run_ranks(_rank_job, 1, str(tmp_path_factory.mktemp("rank")), timeout_s=240)[0]


def test_a_rank_built_from_the_spec_offloads_the_parts_each_role_asks_for(rank_report):
    assert rank_report["offload_parts"] == {"actor": ("params", "optimizer"), "reference": ("params",),
                                            "critic": ("grads",)}
    assert all(count > 0 for count in rank_report["offloaded"].values()), rank_report["offloaded"]


def test_a_rank_built_from_the_spec_steps_with_its_optimizer_settings(rank_report):
    expected = {"actor": dict(lr=2e-3, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6,
                              clip_grad=0.5),
                "critic": dict(lr=3e-3, weight_decay=0.02, adam_beta1=0.7, adam_beta2=0.9, adam_eps=1e-7,
                               clip_grad=0.25)}
    for role, configs in rank_report["optimizers"].items():
        assert configs and all(config == pytest.approx(expected[role]) for config in configs), (role, configs)


def test_a_rank_built_from_the_spec_batches_its_updates_as_the_spec_says(rank_report):
    # Actor: 8 sequences in mini-batches of 2 prompts x 2 samples, 2 epochs; micro-batches of 2 sequences.
    assert rank_report["optimizer_steps"] == {"actor": 2 * 2, "critic": 4 * 2}
    assert [[rows for rows, _ in call] for call in rank_report["actor_micro_batches"]] == [[2, 2]] * 4
    # Critic: mini-batches of 1 prompt x 2 samples, packed into micro-batches of at most 12 tokens.
    calls = rank_report["critic_micro_batches"]
    assert len(calls) == 8 and all(tokens <= 12 for call in calls for _, tokens in call)
    assert any(len(call) == 2 for call in calls), "no mini-batch needed a second micro-batch at 12 tokens"


def test_rollout_quantization_fp8_has_the_engine_sample_with_the_actors_weights_quantised_block_wise(rank_report):
    fp8 = rank_report["fp8_engine"]
    assert fp8["quantised"] > 0 and fp8["differ"] == [] and fp8["unchanged_by_fp8"] == [], fp8


def test_a_rank_built_from_the_spec_has_its_dtype_seed_and_critic_init(rank_report):
    assert rank_report["actor_dtypes"] == rank_report["engine_dtypes"] == {"torch.bfloat16"}
    assert rank_report["engine_holds_the_actor"]
    assert rank_report["value_head_is_the_score"]
    assert not rank_report["weights"].equal(rank_report["weights_at_seed_8"])
