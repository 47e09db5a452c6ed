"""The MTP layers in `rlm plan`: counted as DeepSeek publishes them, held on the last pipeline stage, with their
gradients, Adam state, activations and a phase of their own when actor.mtp.loss_weight trains them, in every weight
sync, and held by the engines as the draft model of rollout.speculative, whose generation the step-time model
shortens by an assumed acceptance rate (planner/step_time.tokens_per_verification)."""
import json

import pytest

from rlmegatron.config import read_architecture
from rlmegatron.planner.parameters import count_parameters
from rlmegatron.planner.plan import render_plan
from rlmegatron.planner.step_time import SPEC_ACCEPTANCE, tokens_per_verification
from tests.config.specs import MODELS_DIR
from tests.planner.test_memory import _plan, _spec

# TP 8 with PP 4 (an untied head on a last stage of its own: it needs the embedding again for the MTP layer), EP 8.
LAYOUT = {"tensor_model_parallel_size": 8, "sequence_parallel": True, "pipeline_model_parallel_size": 4,
          "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1, "recompute_granularity": "full",
          "extra": {"num_layers_in_first_pipeline_stage": 13, "num_layers_in_last_pipeline_stage": 18}}
ROLLOUT = {"tensor_parallel_size": 32, "expert_parallel_size": 32}
PLACEMENT = {"nnodes": 4}
GPU_GB = 1000.0  # room for every variant: the estimates, not the fit, are compared


@pytest.fixture(scope="module")
def without_mtp(tmp_path_factory):
    """DeepSeek-V3's config.json declaring no MTP layer: the same model as Megatron builds it from a checkpoint
    without one."""
    config = json.loads((MODELS_DIR / "deepseek-v3" / "config.json").read_text())
    directory = tmp_path_factory.mktemp("deepseek_v3_no_mtp")
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    return str(directory)


def _deepseek(hf_config=None, **sections):
    spec = _spec("deepseek-v3", LAYOUT, rollout={**ROLLOUT, **sections.pop("rollout", {})},
                 placement=PLACEMENT, **sections)
    if hf_config is not None:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"hf_config": hf_config})})
    return spec


def test_deepseek_v3s_mtp_module_is_counted_as_published():
    """DeepSeek-V3's Hugging Face checkpoint: 685B parameters, the 671B main model and a 14B MTP module (its layer,
    eh_proj and norms, and its copies of the embedding and head); what Megatron holds of it is the layer alone."""
    params = count_parameters(read_architecture(str(MODELS_DIR / "deepseek-v3")), mtp_layers=1)
    assert params.total / 1e9 == pytest.approx(671, rel=1e-3)
    checkpoint_module = params.mtp_total + 2 * params.embedding
    assert (params.total + checkpoint_module) / 1e9 == pytest.approx(685, rel=1e-3)
    layer = params.mtp[0]
    assert layer == params.layers[-1]  # Megatron builds it from the last decoder layer's spec (an MoE layer)
    assert params.mtp_total == layer.total + 2 * 7168 ** 2 + 3 * 7168


def test_the_mtp_layer_is_held_trained_and_synced_on_the_last_stage(without_mtp):
    params = count_parameters(read_architecture(str(MODELS_DIR / "deepseek-v3")), mtp_layers=1)
    carried, none = _plan(_deepseek(), GPU_GB), _plan(_deepseek(without_mtp), GPU_GB)
    trained_spec = _deepseek(actor={"mtp": {"loss_weight": 0.3}})
    trained = _plan(trained_spec, GPU_GB)
    assert carried.actor.pipeline_stage == none.actor.pipeline_stage == 3  # DeepSeek-V3's 61 layers: 13/15/15/18
    # On the last stage: the embedding again (the MTP layer embeds the next tokens) and the layer's dense part, split
    # by TP 8, its experts by EP 8; bf16 weights, and where they train fp32 gradients and Adam state (32 GPUs: no
    # data parallelism to shard it over).
    copy, mtp_dense, experts = params.embedding // 8, params.mtp_dense // 8, params.mtp_routed_experts // 8
    for plan in (carried, trained):
        assert plan.actor.dense_parameters == none.actor.dense_parameters + copy + mtp_dense
        assert plan.actor.expert_parameters == none.actor.expert_parameters + experts
        assert plan.actor.parameters - none.actor.parameters == (copy + mtp_dense + experts) * 2
    # Untrained (weight 0) the layer is frozen: only the embedding copy, which the first stage's ties, has state.
    assert carried.actor.gradients - none.actor.gradients == copy * 4
    assert carried.actor.optimizer_state - none.actor.optimizer_state == copy * 12
    assert trained.actor.gradients - none.actor.gradients == (copy + mtp_dense + experts) * 4
    assert trained.actor.optimizer_state - none.actor.optimizer_state == (copy + mtp_dense + experts) * 12
    # Carried untrained it keeps no activations; trained, one more layer's and one more set of logits.
    assert carried.actor.activations == none.actor.activations < trained.actor.activations
    # No engine loads an MTP layer it does not draft with, nor a layer's copies of embedding and head (SGLang's draft
    # takes the main model's): without rollout.speculative, or frozen, the layer adds nothing to a step's sync;
    # drafting and trained, its own weights (bf16).
    drafting = {"speculative": {"method": "mtp", "num_draft_tokens": 2}}
    trained_drafting = _plan(_deepseek(actor={"mtp": {"loss_weight": 0.3}}, rollout=drafting), GPU_GB)
    frozen_drafting = _plan(_deepseek(rollout=drafting), GPU_GB)
    assert carried.sync.total_bytes == trained.sync.total_bytes == frozen_drafting.sync.total_bytes \
        == none.sync.total_bytes
    assert trained_drafting.sync.total_bytes - none.sync.total_bytes == params.mtp_total * 2
    # The update's step time: a phase of its own only when it trains.
    assert "mtp_update" not in carried.step_time.phases and "mtp_update" not in none.step_time.phases
    assert 0 < trained.step_time.phases["mtp_update"] < trained.step_time.phases["update"] / 4
    # The last stage's GPUs alone run it: at PP 1 all 32 share it, a quarter of the time at PP 4.
    one_stage = {**LAYOUT, "pipeline_model_parallel_size": 1, "extra": {}}
    flat = _plan(_spec("deepseek-v3", one_stage, rollout=ROLLOUT, placement=PLACEMENT,
                       actor={"mtp": {"loss_weight": 0.3}}), GPU_GB)
    assert flat.step_time.phases["mtp_update"] == pytest.approx(trained.step_time.phases["mtp_update"] / 4)
    assert trained.step_time.phases["update"] == carried.step_time.phases["update"]
    assert "MTP layers: 11.61B parameters" in render_plan(trained_spec, trained)
    assert "MTP" not in render_plan(_deepseek(without_mtp), none)


def test_speculative_rollout_holds_the_draft_and_shortens_generation_by_the_assumed_acceptance():
    """The engines hold the draft and its KV layer; each step yields tokens_per_verification tokens; and SGLang, which
    caps the running samples at 48 for its speculative decoding unless told otherwise, is planned with that cap."""
    speculative = {"speculative": {"method": "mtp", "num_draft_tokens": 2}}
    unlimited = {"sglang": {"extra_args": {"max-running-requests": 100000}}}
    plain = _plan(_deepseek(), GPU_GB)
    drafting = _plan(_deepseek(rollout={**speculative, **unlimited}), GPU_GB)
    capped = _plan(_deepseek(rollout=speculative), GPU_GB)
    params = count_parameters(read_architecture(str(MODELS_DIR / "deepseek-v3")), mtp_layers=1)
    assert drafting.engine.weights - plain.engine.weights == pytest.approx(params.mtp_total * 2 / 32)
    # The draft layer's own latent KV cache: one layer more than the 61.
    assert drafting.engine.kv_bytes_per_token == plain.engine.kv_bytes_per_token * 62 / 61
    expected = tokens_per_verification(2)
    assert expected == pytest.approx(1 + SPEC_ACCEPTANCE + SPEC_ACCEPTANCE ** 2)
    ratio = plain.step_time.phases["generation"] / drafting.step_time.phases["generation"]
    # Fewer steps by the tokens each verification yields, each a little dearer (the drafts' reads, a smaller KV).
    assert 1.5 < ratio < expected
    assert any("accepted with probability 0.85 (assumed)" in line for line in drafting.step_time.assumptions)
    # SGLang's own cap of 48 running samples takes back more than the drafts give at this batch.
    assert capped.step_time.phases["generation"] > plain.step_time.phases["generation"]
    assert any("at most 48 samples running per engine" in line for line in capped.step_time.assumptions)
    assert not any("samples running" in line for line in plain.step_time.assumptions)
