"""A policy rank built from a spec with `actor.lora` (one gloo rank): adapters of that rank, scale and dropout on the
chosen linears, and the embedding trained whole (modules_to_save); the reference is the actor with its adapters off
and its base embedding (no second model); the engine gets the merged weights; a checkpoint holds the adapters and
the embedding (and their optimizer) only and resumes them; the HF export is merged."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
LORA_SPEC = [
    "placement.gpus_per_node=1", "data.train_batch_size=4", "rollout.n=2", "data.max_prompt_length=6",
    "data.max_response_length=6", "data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1",
    "actor.use_kl_loss=true", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
    "actor.optim.lr=0.05", "actor.offload.params=true",
    "actor.lora.rank=4", "actor.lora.alpha=12", "actor.lora.dropout=0.1",
    "actor.lora.target_modules=[linear_qkv,linear_fc2]", "actor.lora.modules_to_save=[embedding]",
]
EMBEDDING = "embedding.word_embeddings.weight"


def _lora_rank_job(workdir: str) -> dict:
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT
    from rlmegatron.models.lora import adapted_modules, adapters_disabled, is_adapter_name
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.rank.roles.megatron_step import unwrap
    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.rollout.local import checkpoint_named_weights
    from tests.helpers.fp8_engine import engine_vs_fp8_actor
    from tests.rank.roles.jobs import rollout_batch

    os.chdir(REPO_ROOT)  # the quickstart spec's paths are relative to the repository
    spec = load_spec("configs/quickstart.yaml", [*LORA_SPEC, f"trainer.run_dir={workdir}/run"])
    rank = PolicyRank(trainer_rank_settings(spec, 1))
    models = rank.models
    with models.phase("actor"):
        modules = {type(m).__name__: (m.lora_A.shape[0], m.lora_scale, m.lora_dropout.p)
                   for m in adapted_modules(models.actor.chunks)}
    report = {"adapted": modules, "shared": models.reference.chunks is models.actor.chunks}

    def embedding():
        with models.phase("actor"):
            return dict(unwrap(models.actor.chunks[0]).named_parameters())[EMBEDDING].detach().clone()

    report["embedding_before"] = embedding()
    with models.phase("actor"):
        report["trainable"] = sum(p.numel() for chunk in models.actor.chunks
                                  for p in unwrap(chunk).parameters() if p.requires_grad)

    batch = rollout_batch(n=8)
    log_probs = rank.compute_log_prob(batch)
    report["ref_before"] = rank.compute_ref_log_prob(batch)
    report["log_probs_before"] = log_probs
    train = replace(batch, old_log_probs=log_probs, ref_log_probs=report["ref_before"])
    for _ in range(2):
        rank.update_actor(train)
    report["log_probs"] = rank.compute_log_prob(batch)
    report["ref_after"] = rank.compute_ref_log_prob(batch)
    report["embedding_after"] = embedding()
    with models.phase("actor"):
        with adapters_disabled(models.actor.chunks):
            report["base_stream"] = {n: t.clone() for n, t in HFWeightExporter(models.actor.chunks,
                                                                                 models.weight_map).stream()}
        # Cloned: unmerged tensors are the parameters themselves, whose storage the offload frees.
        report["merged_stream"] = {n: t.clone() for n, t in HFWeightExporter(models.actor.chunks,
                                                                             models.weight_map).stream()}
    rank.sync_weights("2")
    report["served"] = {name: tensor.clone()
                        for name, tensor in checkpoint_named_weights(rank.engine.leader.model).items()}

    checkpoint = os.path.join(workdir, "checkpoint")
    rank.save_checkpoint(checkpoint)
    report["checkpoint_keys"] = sorted(dist_checkpointing.load_tensors_metadata(os.path.join(checkpoint, "actor")))
    exported = Path(rank.export_hf(os.path.join(workdir, "hf")))
    report["exported"] = {k: v for shard in exported.glob("*.safetensors") for k, v in load_file(shard).items()}
    rank.update_actor(train)  # the third step, which the resumed rank must take alike (dropout's RNG included)
    continued = rank.compute_log_prob(batch)
    rank.shutdown()  # a new rank rebuilds the parallel groups, which leaves this one unusable

    # The resumed rank rolls out in FP8, which changes only what its engine holds.
    resumed = PolicyRank(trainer_rank_settings(load_spec("configs/quickstart.yaml", [
        *LORA_SPEC, "rollout.quantization=fp8", f"trainer.run_dir={workdir}/run"]), 1))
    resumed.load_checkpoint(checkpoint)
    report["resumed_log_probs"] = resumed.compute_log_prob(batch)
    resumed.update_actor(train)
    report["third_step"] = (resumed.compute_log_prob(batch), continued)
    resumed.sync_weights("3")
    report["fp8_engine"] = engine_vs_fp8_actor(resumed)
    with resumed.models.phase("actor"), adapters_disabled(resumed.models.actor.chunks):
        base = {n: t.clone() for n, t in HFWeightExporter(resumed.models.actor.chunks,
                                                          resumed.models.weight_map).stream()}
    served = checkpoint_named_weights(resumed.engine.leader.model)
    report["fp8_projections_served_as_the_base_quantised"] = [
        n for n in base if FP8_ROLLOUT.quantises(n)
        and torch.equal(served[n], FP8_ROLLOUT.dequantise(*FP8_ROLLOUT.quantise(base[n])).to(base[n].dtype))]
    report["saved_whole"] = [k for k in report["checkpoint_keys"]
                             if not k.startswith("optimizer") and not is_adapter_name(k)]
    resumed.shutdown()
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_ranks(_lora_rank_job, 1, str(tmp_path_factory.mktemp("lora_rank")), timeout_s=300)[0]


def test_the_spec_puts_adapters_of_its_rank_scale_and_dropout_on_the_chosen_linears(report):
    assert report["adapted"] == {"LoRAColumnParallelLinear": (4, 3.0, 0.1), "LoRARowParallelLinear": (4, 3.0, 0.1)}


def test_rlm_plan_counts_the_gradients_and_adam_state_of_what_trains(report, monkeypatch):
    """The planner's LoRA accounting against the rank: fp32 gradients and Adam's two moments of every parameter that
    trains (the adapters and the embedding), on one rank."""
    from rlmegatron.config import read_architecture
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.planner.plan import PlanSettings, build_plan

    monkeypatch.chdir(REPO_ROOT)  # the spec's paths are relative to the repository
    spec = load_spec("configs/quickstart.yaml", LORA_SPEC)
    plan = build_plan(spec, read_architecture(REPO_ROOT / "configs" / "quickstart" / "model"), PlanSettings())
    assert plan.actor.gradients == report["trainable"] * 4
    assert plan.actor.optimizer_state == report["trainable"] * 8


def test_the_reference_is_the_actor_with_its_adapters_off(report):
    assert report["shared"], "with LoRA the reference has no model of its own"
    # B starts at zero (the reference batches by ref.log_prob_micro_batch_size_per_gpu, so not bit for bit)
    assert (report["ref_before"] - report["log_probs_before"]).abs().max() < 1e-5
    assert (report["log_probs"] - report["log_probs_before"]).abs().max() > 0.05, "the adapters must have trained"
    assert torch.equal(report["ref_after"], report["ref_before"])  # the base weights never change
    # ... and the embedding, which trains whole (modules_to_save), is the base one again with the adapters off.
    assert (report["embedding_after"] - report["embedding_before"]).abs().max() > 1e-3


def test_the_engine_and_the_hf_export_get_the_merged_weights(report):
    merged, base = report["merged_stream"], report["base_stream"]
    assert max(float((merged[n] - base[n]).abs().max()) for n in merged) > 1e-3
    vocab = base["model.embed_tokens.weight"].shape[0]
    assert torch.equal(base["model.embed_tokens.weight"], report["embedding_before"][:vocab])
    assert torch.equal(merged["model.embed_tokens.weight"], report["embedding_after"][:vocab])
    assert all(torch.equal(report["served"][n], merged[n]) for n in merged)
    assert all(torch.equal(report["exported"][n], merged[n]) for n in merged)


def test_fp8_rollout_quantises_the_merged_weights(report):
    """With rollout.quantization=fp8 the engine holds the merged weights quantised block-wise then dequantised, and
    none of the adapted projections (q/k/v and down_proj of each layer: 4 per layer) as the base alone quantised."""
    fp8 = report["fp8_engine"]
    assert fp8["quantised"] == 14 and fp8["differ"] == [] and fp8["unchanged_by_fp8"] == [], fp8
    as_base = report["fp8_projections_served_as_the_base_quantised"]
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "down_proj.weight")) for n in as_base)
    assert len(as_base) == 14 - 4 * 2, as_base  # o_proj, gate_proj and up_proj carry no adapter


def test_a_checkpoint_holds_the_adapters_and_the_modules_trained_whole_and_resumes_them(report):
    assert report["saved_whole"] == [EMBEDDING]  # beside the adapters: no frozen weight
    assert torch.equal(report["resumed_log_probs"], report["log_probs"])
    resumed, continued = report["third_step"]
    assert torch.equal(resumed, continued)  # Adam's moments and step came back too
