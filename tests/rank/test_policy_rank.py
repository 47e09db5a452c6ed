"""PolicyRank on 2 gloo ranks with the reference and the critic at their own layouts (and batching), against the run
where both follow the actor's layout: HF weights loaded into each role at its layout, the critic started from the
actor's, the fit loop's phases in its order, a checkpoint round trip and offload."""
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
# GAE with a KL loss: actor, reference and critic; synthetic batches of tests/rank/roles/jobs.py (6 + 6 tokens).
COMMON = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "data.max_prompt_length=6",
          "data.max_response_length=6", "actor.megatron.tensor_model_parallel_size=2",
          # adam_eps=1: the first Adam step is ~lr*g, not lr*sign(g), so gradient rounding is not amplified.
          "actor.optim.lr=1e-2", "actor.optim.adam_eps=1.0", "critic.optim.lr=1e-2", "critic.optim.adam_eps=1.0",
          "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=2"]
RUNS = {
    # Reference and critic follow the actor (TP=2); the reference packs micro-batches by a 16-token budget.
    "actor_layout": ["ref.log_prob_use_dynamic_bsz=true", "ref.log_prob_max_token_len_per_gpu=16"],
    # Reference at TP=1 (DP=2) in micro-batches of 3 sequences, critic at PP=2; both offloaded between phases.
    "own_layouts": ["ref.megatron.tensor_model_parallel_size=1", "critic.megatron.tensor_model_parallel_size=1",
                    "critic.megatron.pipeline_model_parallel_size=2", "ref.log_prob_micro_batch_size_per_gpu=3",
                    "ref.offload.params=true", "critic.offload.params=true", "critic.offload.grads=true",
                    "critic.offload.optimizer=true"],
    # Every role at CP=2 (TP=1, DP=1): each sequence split over the two ranks.
    "context_parallel": ["actor.megatron.tensor_model_parallel_size=1", "actor.megatron.context_parallel_size=2",
                         "ref.megatron.context_parallel_size=2", "critic.megatron.context_parallel_size=2"],
}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def write_hf_model(directory: Path) -> Path:
    """The quickstart model (config, tokenizer) with seeded random weights, as an HF checkpoint."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(REPO_ROOT / "configs" / "quickstart" / "model", directory)
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32).save_pretrained(directory)
    return directory


def recording_micro_batches() -> list[list[tuple[int, int]]]:
    """In a rank: the (sequences, tokens) of each micro-batch it runs, a list per forward(-backward) call, from now."""
    from rlmegatron.rank.roles import megatron_step

    micro_batches = []
    run_schedule = megatron_step.forward_backward

    def recording(chunks, batches, *args, **kwargs):
        micro_batches.append([(len(mb.rows), len(mb.source_index) + len(mb.rows)) for mb in batches])
        return run_schedule(chunks, batches, *args, **kwargs)

    megatron_step.forward_backward = recording
    return micro_batches


def _roles_job(workdir: str, model: str) -> dict:
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
    from tests.rank.roles.jobs import rollout_batch

    os.chdir(REPO_ROOT)  # the quickstart spec's paths are relative to the repository
    micro_batches = recording_micro_batches()
    batch = rollout_batch(n=8)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=3)
    requests = [GenerationRequest(tuple(row[mask.bool()][:4].tolist()), greedy)
                for row, mask in zip(batch.input_ids, batch.attention_mask)]
    reports = {}
    for name, overrides in RUNS.items():
        spec = load_spec("configs/quickstart.yaml", [*COMMON, *overrides, f"trainer.run_dir={workdir}/{name}",
                                                     f"model.path={model}", "model.random_init=false"])
        rank = PolicyRank(trainer_rank_settings(spec, spec.trainer.total_steps))
        report = reports[name] = {"layouts": {role: str(layout) for role, layout in rank.models.layouts.items()}}
        micro_batches.clear()
        report["log_probs"] = rank.compute_log_prob(batch)
        report["ref_log_probs"] = rank.compute_ref_log_prob(batch)
        report["values"] = rank.compute_values(batch)
        report["actor_micro_batches"], report["ref_micro_batches"] = micro_batches[0], micro_batches[1]
        returns = report["values"] + 0.3 * batch.response_mask
        train = replace(batch, old_log_probs=report["log_probs"], ref_log_probs=report["ref_log_probs"],
                        values=report["values"], returns=returns)
        report["critic_metrics"] = rank.update_critic(train)
        report["actor_metrics"] = rank.update_actor(train)
        rank.sync_weights("1")
        report["generated"] = [(r.output_token_ids, r.output_token_logprobs) for r in rank.generate(requests)]
        report["values_after"] = rank.compute_values(batch)
        report["log_probs_after"] = rank.compute_log_prob(batch)
        if name == "own_layouts":  # the actor-layout round trip is the resume tests' (tests/driver/test_train.py)
            checkpoint = os.path.join(workdir, name, "checkpoint")
            rank.save_checkpoint(checkpoint)
            rank.update_critic(train)
            rank.update_actor(train)
            moved = rank.compute_values(batch), rank.compute_log_prob(batch)
            rank.load_checkpoint(checkpoint)
            report["checkpoint_moved"] = [max_diff(moved[0], report["values_after"]),
                                          max_diff(moved[1], report["log_probs_after"])]
            report["values_restored"] = rank.compute_values(batch)
            report["log_probs_restored"] = rank.compute_log_prob(batch)
        rank.shutdown()
    return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("roles")
    reports = run_ranks(_roles_job, 2, str(workdir), str(write_hf_model(workdir / "model")), timeout_s=300)
    for name in RUNS:
        for key in ("ref_log_probs", "values", "values_after", "log_probs_after"):
            assert torch.equal(reports[0][name][key], reports[1][name][key]), "ranks disagree"
    return reports[0]


def test_reference_and_critic_at_their_own_layouts_equal_the_actor_layout_run(runs):
    same, own = runs["actor_layout"], runs["own_layouts"]
    assert same["layouts"] == {"actor": "TP2xPP1xETP2", "reference": "TP2xPP1xETP2", "critic": "TP2xPP1xETP2"}
    assert own["layouts"] == {"actor": "TP2xPP1xETP2", "reference": "TP1xPP1xETP1", "critic": "TP1xPP2xETP1"}
    mask = same["log_probs"] != 0
    assert mask.any() and same["values"].abs().sum() > 0
    # The reference is the initial policy, loaded from the HF checkpoint at its own TP: its log-probs are the
    # actor's, whatever its layout.
    assert max_diff(own["ref_log_probs"], same["ref_log_probs"]) < TOLERANCE
    assert max_diff(own["ref_log_probs"], same["log_probs"]) < TOLERANCE
    assert max_diff(own["values"], same["values"]) < TOLERANCE
    assert abs(own["critic_metrics"]["critic/vf_loss"] - same["critic_metrics"]["critic/vf_loss"]) < TOLERANCE
    # The critic trained at PP=2 moves its values as the TP=2 one does; the actor's update (its KL term uses the
    # reference's log-probs) and the weights it sent the engine are those of the actor-layout run.
    update = max_diff(same["values_after"], same["values"])
    assert update > 1e-3 and max_diff(own["values_after"], same["values_after"]) < 1e-3 * update
    assert max_diff(own["log_probs_after"], same["log_probs_after"]) < TOLERANCE
    assert max_diff(same["log_probs_after"], same["log_probs"]) > 1e-4
    for (tokens, logprobs), (same_tokens, same_logprobs) in zip(own["generated"], same["generated"]):
        assert tokens == same_tokens and max(abs(a - b) for a, b in zip(logprobs, same_logprobs)) < TOLERANCE


def test_every_role_at_context_parallel_2_equals_the_run_without(runs):
    """The fit loop's phases with each sequence split over 2 ranks: the actor's log-probs (before and after its
    update), the reference's, the critic's values and what the engine generates after the weight sync are those of
    the run at CP=1 (TP=2)."""
    same, cp = runs["actor_layout"], runs["context_parallel"]
    assert cp["layouts"] == {"actor": "TP1xPP1xCP2xETP1", "reference": "TP1xPP1xCP2xETP1",
                             "critic": "TP1xPP1xCP2xETP1"}
    for key in ("log_probs", "ref_log_probs", "values", "log_probs_after"):
        assert max_diff(cp[key], same[key]) < TOLERANCE, key
    assert abs(cp["actor_metrics"]["actor/pg_loss"] - same["actor_metrics"]["actor/pg_loss"]) < TOLERANCE
    assert abs(cp["critic_metrics"]["critic/vf_loss"] - same["critic_metrics"]["critic/vf_loss"]) < TOLERANCE
    update = max_diff(same["values_after"], same["values"])
    assert max_diff(cp["values_after"], same["values_after"]) < 1e-3 * update
    for (tokens, logprobs), (same_tokens, same_logprobs) in zip(cp["generated"], same["generated"]):
        assert tokens == same_tokens and max(abs(a - b) for a, b in zip(logprobs, same_logprobs)) < TOLERANCE


def test_each_role_saves_and_restores_its_checkpoint_at_its_layout(runs):
    report = runs["own_layouts"]
    assert min(report["checkpoint_moved"]) > 1e-4  # the updates after the save moved both roles
    assert torch.equal(report["values_restored"], report["values_after"])
    assert torch.equal(report["log_probs_restored"], report["log_probs_after"])


def test_the_reference_batches_its_forward_by_its_own_settings(runs):
    same, own = runs["actor_layout"], runs["own_layouts"]
    # The actor runs its 8 sequences (one DP rank at TP=2) as one micro-batch (ppo_micro_batch_size_per_gpu=32).
    assert same["actor_micro_batches"] == [(8, sum(t for _, t in same["actor_micro_batches"]))]
    # ref.log_prob_use_dynamic_bsz: the same sequences in micro-batches of at most 16 tokens.
    assert len(same["ref_micro_batches"]) > 1 and max(t for _, t in same["ref_micro_batches"]) <= 16
    assert sum(n for n, _ in same["ref_micro_batches"]) == 8
    # ref.log_prob_micro_batch_size_per_gpu=3 at TP=1: this DP rank's 4 sequences as 3 + 1.
    assert [n for n, _ in own["ref_micro_batches"]] == [3, 1]


def test_every_role_gets_one_padded_vocabulary_that_its_tensor_parallel_size_divides():
    from rlmegatron.rank.role_models import vocab_tp
    from rlmegatron.models.hf_config import model_facts, read_hf_config

    hf = read_hf_config(REPO_ROOT / "configs" / "quickstart" / "model")  # 128 tokens
    assert model_facts(hf, vocab_tp([2, 1, 1])).padded_vocab_size == 256  # the actor's own (TP=2) padding
    assert model_facts(hf, vocab_tp([1, 2])).padded_vocab_size == 256  # 128-row shares at TP=2 too
    assert model_facts(hf, vocab_tp([2, 3])).padded_vocab_size == 768  # 128-row shares at TP=2 and at TP=3
