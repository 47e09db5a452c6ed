"""MoE routing replay (models/routing_replay.py) on 2 gloo ranks, through a PolicyRank built from a spec: the local
engine records each token's experts, the actor replays them (r3) or its own old-log-prob pass's (r2), at EP=2, TP=2
with sequence parallelism, PP=2 and CP=2, for Qwen3-MoE's softmax router and DeepSeek-V3's grouped, biased sigmoid.

The numeric truths: replaying the routing the model would choose anyway changes nothing, bit for bit, in every layout
(a record placed on the wrong token would); a routing of other experts changes the log-probs; in fp32 the engine and
Megatron route every token alike; and the router still learns under replay."""
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import FAMILY_CONFIGS

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "qwen3_moe": {"ep2": ["actor.megatron.expert_model_parallel_size=2"],
                  "tp2_sp": ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true"],
                  "pp2": ["actor.megatron.pipeline_model_parallel_size=2"],
                  "cp2": ["actor.megatron.context_parallel_size=2"]},
    "deepseek_v3": {"ep2": ["actor.megatron.expert_model_parallel_size=2"]},
}
RESPONSE = 5


def write_model(directory: Path, family: str) -> Path:
    """The quickstart's tokenizer with a tiny seeded MoE of `family`: 8 experts, top-2 (DeepSeek-V3: 2 groups, one
    chosen per token, a dense first layer and no MTP)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(REPO_ROOT / "configs" / "quickstart" / ("moe_model" if family == "qwen3_moe" else "model"),
                    directory)
    config = json.loads((directory / "config.json").read_text())
    if family == "qwen3_moe":
        config.update(num_hidden_layers=4)  # PP=2: two MoE layers per stage
    else:
        keep = {key: config[key] for key in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id",
                                             "hidden_size", "max_position_embeddings", "rms_norm_eps")}
        config = {**FAMILY_CONFIGS["deepseek_v3"], **keep, "architectures": ["DeepseekV3ForCausalLM"],
                  "model_type": "deepseek_v3", "n_routed_experts": 8, "num_nextn_predict_layers": 0,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
                  "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "e_score_correction_bias" in name:  # a zero bias would hide a router that ignores it
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


def _replay_job(workdir: str, model: str, layouts: dict[str, list[str]]) -> dict:
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.driver.rollout_data import build_batch
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec

    os.chdir(REPO_ROOT)
    generator = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(5, 100, (int(length),), generator=generator).tolist())
               for length in torch.randint(2, 7, (6,), generator=generator)]
    requests = [GenerationRequest(prompt, SamplingSpec(n=2, max_new_tokens=RESPONSE, seed=3),
                                  return_routed_experts=True) for prompt in prompts]
    reports = {}
    for name, overrides in layouts.items():
        spec = load_spec("configs/quickstart.yaml", [
            f"data.max_response_length={RESPONSE}", f"trainer.run_dir={workdir}/{name}", f"model.path={model}",
            "model.random_init=false", "actor.moe.routing_replay=r3", *overrides])
        rank = PolicyRank(trainer_rank_settings(spec, 3))
        actor = rank.models.actor
        results = rank.generate(requests)
        batch = build_batch([list(prompts[r.request_index]) for r in results], results, RESPONSE)
        report = reports[name] = {"batch": batch, "replayed": rank.compute_log_prob(batch)}
        report["agreement"] = actor.measured[1]
        actor.settings = dataclasses.replace(actor.settings, routing_replay="r2")  # records the model's own routing
        report["free"] = rank.compute_log_prob(batch)
        own = report["own"] = actor.recorded_routing[1]
        actor.settings = dataclasses.replace(actor.settings, routing_replay="r3")
        report["own_replayed"] = rank.compute_log_prob(dataclasses.replace(batch, routed_experts=own))
        # Each token's second expert swapped for the next one: other experts, still k distinct ones.
        other = own.clone()
        other[..., 1] = torch.where(own[..., 1] >= 0, (torch.maximum(own[..., 0], own[..., 1]) + 1) % 8, -1)
        other[..., 0] = torch.where(own[..., 0] >= 0, torch.minimum(own[..., 0], own[..., 1]), -1)
        report["other_replayed"] = rank.compute_log_prob(dataclasses.replace(batch, routed_experts=other))
        router = next(p for n, p in actor.chunks[0].module.named_parameters() if "router.weight" in n)
        before = router.detach().clone()
        rank.compute_log_prob(batch)  # the old-log-prob pass: its agreement is the update's metric
        train = dataclasses.replace(batch, old_log_probs=report["replayed"], advantages=torch.randn(
            batch.response_mask.shape, generator=generator) * batch.response_mask)
        report["metrics"] = rank.update_actor(train)
        report["router_change"] = float((router.detach() - before).abs().max())
        rank.shutdown()
    return reports


@pytest.fixture(scope="module", params=list(LAYOUTS))
def replays(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"replay_{request.param}")
    model = write_model(workdir / "model", request.param)
    reports = run_ranks(_replay_job, 2, str(workdir), str(model), LAYOUTS[request.param], timeout_s=600)
    for name in LAYOUTS[request.param]:
        assert torch.equal(reports[0][name]["own_replayed"], reports[1][name]["own_replayed"]), "ranks disagree"
    return reports[0]


def test_the_engine_records_every_token_it_ran_and_megatron_routes_them_alike_in_fp32(replays):
    for name, report in replays.items():
        batch, own = report["batch"], report["own"]
        engine = batch.routed_experts
        ran = (engine >= 0).all(dim=-1)
        # The prompt and every response token but the last: what the engine fed through its layers.
        expected = batch.attention_mask.bool().clone()
        last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.flip(1).argmax(dim=1)
        expected[torch.arange(len(last)), last] = False
        assert torch.equal(ran, expected[..., None].expand_as(ran)), name
        same = (engine.sort(dim=-1).values == own.sort(dim=-1).values).all(dim=-1)
        assert bool(same[ran].all()), name
        agreeing, compared = report["agreement"]
        assert compared >= int(ran.sum()) // 2 and agreeing == compared, (name, report["agreement"])
        assert report["metrics"]["moe/routing_agreement"] == 1.0, name


def test_replaying_the_models_own_routing_changes_nothing_bit_for_bit_in_every_layout(replays):
    for name, report in replays.items():
        mask = report["batch"].response_mask.bool()
        assert mask.any() and torch.equal(report["own_replayed"], report["free"]), name
        # r3's replay of the engine's routing: the same experts, which the engine may list in another order (the
        # routing weights then sum in it).
        assert float((report["replayed"] - report["free"]).abs().max()) < 1e-6, name


def test_replaying_other_experts_changes_the_log_probs_and_the_router_still_learns(replays):
    for name, report in replays.items():
        mask = report["batch"].response_mask.bool()
        assert float((report["other_replayed"] - report["free"])[mask].abs().max()) > 1e-3, name
        assert report["router_change"] > 0, name


def test_r3_log_probs_are_the_rollouts_in_fp32(replays):
    for name, report in replays.items():
        batch = report["batch"]
        mask = batch.response_mask.bool()
        assert float((report["replayed"] - batch.rollout_log_probs)[mask].abs().max()) < 1e-5, name
