"""The MTP layers trained with the policy (actor.mtp.loss_weight; models/mtp.py, rank/roles/actor.mtp_loss) on 2 gloo
ranks, through a PolicyRank built from a spec, on a tiny DeepSeek-V3 with one MTP layer.

The numeric truths: at weight 0 the update is the update of the same checkpoint without MTP layers, bit for bit (the
RL loss, the grad norm and every main-model weight after the step; the MTP layer, frozen, unchanged); at weight > 0
the RL loss is still the same and actor/mtp_loss is the cross-entropy of an independent HF computation of the MTP
layer (DeepSeek's definition) over the sampled tokens two places on, masked to the response, padded, packed or with
EP fillers; its gradient is linear in the weight and moves the MTP layer and the trunk (the layer alone with
actor.mtp.detach, the policy's step then the RL loss's, bit for bit); the layouts (TP=2 with sequence parallelism,
PP=2 with the MTP layer on the last stage, PP=2 with virtual stages, EP=2) agree with TP=1; and the drafting local
engine holds the trained MTP layer after the next weight sync."""
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import save_quickstart_mtp_model

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT, RESPONSE = 6, 8
WEIGHT = 0.5
TEMPERATURE = 0.8
LAYOUTS = {
    "tp2_sp": ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true"],
    "pp2": ["actor.megatron.pipeline_model_parallel_size=2"],
    # The MTP layer on the last virtual stage of the last rank.
    "pp2_vpp2": ["actor.megatron.pipeline_model_parallel_size=2",
                 "actor.megatron.virtual_pipeline_model_parallel_size=2"],
    "ep2": ["actor.megatron.expert_model_parallel_size=2"],
}
MTP_LAYER = "model.layers.4."  # the tiny DeepSeek-V3 has 4 decoder layers
COPIES = {MTP_LAYER + "embed_tokens.weight", MTP_LAYER + "shared_head.head.weight"}  # of the main embedding and head
DRAFTING = "rollout.speculative={method: mtp, num_draft_tokens: 2}"


SAMPLED = ((3, 6, 4, 5), (8, 5, 7, 3))  # prompt and response lengths
# One sequence of 14 tokens and three of 6: split over 2 DP ranks by tokens and cut by a budget of 14 tokens, the
# first rank has one micro-batch and the other two, so the first runs a filler (megatron_step._same_count_as_peers).
UNEVEN = ((6, 3, 3, 3), (8, 3, 3, 3))


def sampled_batch(advantage_scale: float = 1.0, lengths=SAMPLED):
    """Four sequences, prompts left-padded and responses right-padded to `lengths`, with advantages (times
    `advantage_scale`): what the actor's update gets from a step (on-policy, so no old log-probs)."""
    from rlmegatron.rank.roles.batch import RolloutBatch

    generator = torch.Generator().manual_seed(1)
    prompts, responses = lengths
    input_ids = torch.zeros(len(prompts), PROMPT + RESPONSE, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        span = slice(PROMPT - prompt, PROMPT + response)
        input_ids[row, span] = torch.randint(5, 128, (prompt + response,), generator=generator)
        attention[row, span] = 1
    mask = attention[:, PROMPT:].float()
    return RolloutBatch(input_ids=input_ids, attention_mask=attention, response_mask=mask,
                        advantages=torch.randn(mask.shape, generator=generator) * mask * advantage_scale)


def _update_job(workdir: str, models: dict[str, str], runs: dict[str, list[str]]) -> dict:
    """Per run (name -> (model, overrides, advantage scale, packed, lengths)): one actor update of sampled_batch()
    (`packed`: its micro-batches THD-packed, else right-padded) and then a weight
    sync; returns the metrics, the HF-named weights that sync sent and, where the run drafts with the local engine
    (rollout.speculative), the MTP layer's weights that engine's draft holds after it."""
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.policy_rank import PolicyRank

    os.chdir(REPO_ROOT)
    reports = {}
    for name, (model, overrides, advantage_scale, packed, lengths) in runs.items():
        spec = load_spec("configs/quickstart.yaml", [
            f"model.path={models[model]}", "model.random_init=false", f"trainer.run_dir={workdir}/{name}",
            f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}", "rollout.n=2",
            f"rollout.temperature={TEMPERATURE}", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size_per_gpu=1", "actor.optim.clip_grad=1.0e9", *overrides])
        # What the sync hands every engine (colocated or a server) is WeightPush's stream; only the drafting run
        # starts its colocated local engine.
        drafting = spec.rollout.speculative is not None
        rank = PolicyRank(dataclasses.replace(trainer_rank_settings(spec, 3), colocated=drafting))
        pushes: list[dict] = []
        push = rank.weights._push

        def capture(stream, version, engines, report):
            received = {}
            pushes.append(received)

            def kept():
                for key, tensor in stream:
                    received[key] = tensor.detach().clone()
                    yield key, tensor
            return push(kept(), version, engines, report)

        rank.weights._push = capture
        actor = rank.models.actor
        actor.settings = dataclasses.replace(actor.settings, use_packing=packed)
        metrics = rank.update_actor(sampled_batch(advantage_scale, lengths))
        rank.sync_weights("v1")
        # The trained weights as a checkpoint holds them (every MTP tensor, the copies of embedding and head too).
        exported = {key: tensor.detach().clone() for key, tensor in rank.weights._exporter().stream()}
        reports[name] = {"metrics": metrics, "received": pushes[0], "exported": exported,
                         "mtp_weight": rank.models.actor.settings.mtp_loss_weight}
        if drafting:
            held = rank.engine.leader.draft.checkpoint_tensors()
            reports[name]["draft"] = {key: held[key].detach().clone() for key in held if key.startswith(MTP_LAYER)}
            rank.sync_weights("v2", fresh=True)  # what an engine that holds no weights yet gets
            reports[name]["received_fresh"] = pushes[1]
        rank.shutdown()
    return reports


def hf_mtp_loss(hf_dir: str, lengths=SAMPLED) -> float:
    """actor/mtp_loss from first principles: DeepSeek's MTP layer in HF's modules (conversion_jobs.hf_mtp_logits) at
    each sequence's own positions, -log p(token i+2 | position i) at the rollout temperature, summed over the
    response tokens i+2 and divided by all response tokens."""
    from tests.models.conversion_jobs import hf_mtp_logits

    batch = sampled_batch(lengths=lengths)
    total = 0.0
    for row in range(len(batch)):
        tokens = batch.input_ids[row][batch.attention_mask[row].bool()][None]
        logits = hf_mtp_logits(hf_dir, tokens)[0] / TEMPERATURE
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        prompt = int(batch.attention_mask[row, :PROMPT].sum())
        for target in range(max(prompt, 2), tokens.shape[1]):  # response tokens two places past a position
            total -= float(log_probs[target - 2, tokens[0, target]])
    return total / float(batch.response_mask.sum())


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mtp_training")
    models = {"mtp": save_quickstart_mtp_model(str(workdir / "mtp")),
              "no_mtp": save_quickstart_mtp_model(str(workdir / "no_mtp"), mtp_tensors=False)}
    weighted = f"actor.mtp.loss_weight={WEIGHT}"
    runs = {"no_mtp": ("no_mtp", [], 1.0, False, SAMPLED), "off": ("mtp", [], 1.0, False, SAMPLED),
            # ... drafting with the local engine (rollout.speculative), which receives the trained layer.
            "on": ("mtp", [weighted, DRAFTING], 1.0, False, SAMPLED),
            # ... and drafting with the untrained (frozen) layer.
            "frozen_drafting": ("mtp", [DRAFTING], 1.0, False, SAMPLED),
            # Two sequences per THD-packed micro-batch: the labels roll within each packed sequence.
            "packed": ("mtp", [weighted, "actor.ppo_micro_batch_size_per_gpu=2"], 1.0, True, SAMPLED),
            # The MTP loss training the MTP layer alone (actor.mtp.detach).
            "detached": ("mtp", [weighted, "actor.mtp.detach=true"], 1.0, False, SAMPLED),
            # No RL signal: the gradient is the MTP loss's alone.
            "mtp_only": ("mtp", [weighted], 0.0, False, SAMPLED),
            "mtp_only_doubled": ("mtp", [f"actor.mtp.loss_weight={2 * WEIGHT}"], 0.0, False, SAMPLED),
            # At EP 2 a rank with fewer micro-batches runs fillers, whose backward must pass the MTP layer's MoE too.
            "ep2_filler": ("mtp", [weighted, "actor.megatron.expert_model_parallel_size=2",
                                   "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=14",
                                   "~actor.ppo_micro_batch_size_per_gpu"], 1.0, False, UNEVEN),
            **{name: ("mtp", [weighted, *overrides], 1.0, False, SAMPLED) for name, overrides in LAYOUTS.items()}}
    reports = run_ranks(_update_job, 2, str(workdir), models, runs, timeout_s=600)
    return {"reports": reports[0], "ranks_agree": reports[0]["on"]["metrics"] == reports[1]["on"]["metrics"],
            "mtp_dir": models["mtp"]}


def _main(received: dict) -> dict:
    return {key: value for key, value in received.items() if not key.startswith(MTP_LAYER)}


def test_at_weight_zero_the_update_is_exactly_the_update_without_mtp_layers(updates):
    off, no_mtp = updates["reports"]["off"], updates["reports"]["no_mtp"]
    assert off["mtp_weight"] == 0.0 and "actor/mtp_loss" not in off["metrics"]
    for name in ("actor/pg_loss", "actor/entropy"):
        assert off["metrics"][name] == no_mtp["metrics"][name], name
    # The same gradients: the frozen MTP layer adds no parameter to the optimizer, so even the norm is the same.
    assert off["metrics"]["actor/grad_norm"] == no_mtp["metrics"]["actor/grad_norm"]
    main = _main(off["exported"])
    assert main.keys() == no_mtp["exported"].keys()
    assert [key for key in main if not torch.equal(main[key], no_mtp["exported"][key])] == []
    # Untrained, the MTP layer is frozen: no weight decay moves it, and it keeps the checkpoint's values.
    from safetensors.torch import load_file

    initial = load_file(os.path.join(updates["mtp_dir"], "model.safetensors"))
    own = [key for key in initial if key.startswith(MTP_LAYER) and key not in COPIES]
    assert own and [key for key in own if not torch.equal(off["exported"][key], initial[key])] == []


def test_with_a_weight_the_mtp_loss_is_megatrons_over_the_response_and_its_gradient_trains_mtp_and_trunk(updates):
    reports = updates["reports"]
    on, off = reports["on"], reports["off"]
    assert updates["ranks_agree"]
    assert on["mtp_weight"] == WEIGHT
    # The gradient is the weight times the MTP loss's: twice the weight, twice the gradient.
    alone, doubled = reports["mtp_only"]["metrics"], reports["mtp_only_doubled"]["metrics"]
    assert alone["actor/mtp_loss"] == doubled["actor/mtp_loss"] == pytest.approx(on["metrics"]["actor/mtp_loss"])
    assert alone["actor/grad_norm"] > 0 and doubled["actor/grad_norm"] == pytest.approx(2 * alone["actor/grad_norm"],
                                                                                         rel=1e-6)
    # The RL loss reads the main head only: unchanged, bit for bit.
    assert on["metrics"]["actor/pg_loss"] == off["metrics"]["actor/pg_loss"]
    expected = hf_mtp_loss(updates["mtp_dir"])
    assert on["metrics"]["actor/mtp_loss"] == pytest.approx(expected, rel=1e-5)
    assert reports["packed"]["metrics"]["actor/mtp_loss"] == pytest.approx(expected, rel=1e-5)
    assert reports["ep2_filler"]["metrics"]["actor/mtp_loss"] == pytest.approx(
        hf_mtp_loss(updates["mtp_dir"], UNEVEN), rel=1e-5)
    changed = {key for key in on["exported"] if not torch.equal(on["exported"][key], off["exported"][key])}
    # The MTP layer moved (its own tensors, not only its copies of the embedding and head) ...
    assert {MTP_LAYER + name for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                          "self_attn.kv_a_proj_with_mqa.weight")} <= changed
    # ... and so did the trunk below it, as in Megatron's pretraining, through the shared embedding too.
    assert {"model.embed_tokens.weight", "model.layers.3.self_attn.q_a_proj.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= changed


def test_detached_the_mtp_loss_trains_the_mtp_layer_alone_and_the_policy_steps_as_without_it(updates):
    reports = updates["reports"]
    detached, on, off = reports["detached"], reports["on"], reports["off"]
    assert detached["metrics"]["actor/pg_loss"] == off["metrics"]["actor/pg_loss"]
    assert detached["metrics"]["actor/mtp_loss"] == on["metrics"]["actor/mtp_loss"]  # the same forward
    # The main model's step is the RL loss's alone, bit for bit (Adam per element; the clip is out of reach) ...
    main = _main(detached["exported"])
    assert [key for key in main if not torch.equal(main[key], off["exported"][key])] == []
    # ... while the MTP layer trained.
    eh_proj = MTP_LAYER + "eh_proj.weight"
    assert not torch.equal(detached["exported"][eh_proj], off["exported"][eh_proj])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_the_mtp_layer_as_tp1_does(updates, layout):
    on, laid_out = updates["reports"]["on"], updates["reports"][layout]
    # The same losses, and the same gradient (its norm): the MTP term is scaled alike at every DP size and
    # micro-batch count.
    for name in ("actor/pg_loss", "actor/mtp_loss", "actor/grad_norm"):
        assert laid_out["metrics"][name] == pytest.approx(on["metrics"][name], rel=1e-5), name
    assert laid_out["exported"].keys() == on["exported"].keys()
    for key in (MTP_LAYER + "eh_proj.weight", MTP_LAYER + "mlp.experts.0.down_proj.weight",
                "model.embed_tokens.weight"):
        torch.testing.assert_close(laid_out["exported"][key], on["exported"][key], rtol=1e-4, atol=1e-6)


def test_the_changed_mtp_weights_arrive_at_the_drafting_engine_in_the_sync_after_the_step(updates):
    from safetensors.torch import load_file

    received = updates["reports"]["on"]["received"]
    initial = load_file(os.path.join(updates["mtp_dir"], "model.safetensors"))
    mtp_names = sorted(key for key in initial if key.startswith(MTP_LAYER) and key not in COPIES)
    assert mtp_names and set(mtp_names) <= received.keys()
    moved = [key for key in mtp_names if not torch.equal(received[key], initial[key])]
    assert MTP_LAYER + "eh_proj.weight" in moved and len(moved) > len(mtp_names) // 2
    # The local engine drafting with the MTP layer holds what the sync after the step sent: the trained layer.
    drafting = updates["reports"]["on"]
    draft = drafting["draft"]
    # transformers holds the experts stacked (mlp.experts.gate_up_proj), which the sync sends one by one; every
    # other tensor of the layer goes by its checkpoint name.
    same_names = draft.keys() & drafting["received"].keys()
    assert {MTP_LAYER + name for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                          "self_attn.q_a_proj.weight", "mlp.gate.weight")} <= same_names
    for key in same_names:
        assert torch.equal(draft[key], drafting["received"][key]), key
    assert not torch.equal(draft[MTP_LAYER + "eh_proj.weight"], initial[MTP_LAYER + "eh_proj.weight"])


def test_the_sync_sends_the_engines_the_mtp_layer_they_draft_with_and_none_of_its_copies(updates):
    """SGLang loads an MTP layer only as its NEXTN draft, the first one, whose embedding and head are the main
    model's (its loader skips the layer's copies of them), and so does the local engine: the sync sends that and no
    more, while the export (a checkpoint) keeps every tensor. DeepSeek-V3: 27 GB a sync without drafting, 3.7 GB
    with."""
    from safetensors.torch import load_file

    reports = updates["reports"]
    initial = load_file(os.path.join(updates["mtp_dir"], "model.safetensors"))
    own = {key for key in initial if key.startswith(MTP_LAYER)} - COPIES
    assert own and COPIES <= initial.keys()

    def mtp(names) -> set:
        return {key for key in names if key.startswith(MTP_LAYER)}

    # Not drafting: nothing of the layer, trained or frozen, though the export has all of it.
    for name in ("off", "packed", "detached", *LAYOUTS):
        assert mtp(reports[name]["received"]) == set(), name
        assert mtp(reports[name]["exported"]) == own | COPIES, name
    # Drafting and trained: the layer's own tensors at every push; no copy.
    on = reports["on"]
    assert mtp(on["received"]) == mtp(on["received_fresh"]) == own
    # Drafting with the layer frozen: an engine that holds no weights gets it; the push after a step only its
    # router's expert bias (a buffer, which moves outside the optimizer), and the draft keeps the checkpoint's
    # values.
    frozen = reports["frozen_drafting"]
    assert mtp(frozen["received"]) == {MTP_LAYER + "mlp.gate.e_score_correction_bias"}
    assert mtp(frozen["received_fresh"]) == own
    same = frozen["draft"].keys() & own
    assert MTP_LAYER + "eh_proj.weight" in same
    assert [key for key in same if not torch.equal(frozen["draft"][key], initial[key])] == []
