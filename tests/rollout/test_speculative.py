"""MTP speculative decoding in the local engine (rollout/speculative.py) on a tiny DeepSeek-V3 with an MTP layer:
greedy tokens equal plain decoding's, log-probs are the main model's, and sampled tokens follow the main model's
distribution (a chi-square test that a wrong acceptance rule fails)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from rlmegatron.rollout import speculative
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from rlmegatron.rollout.local import LocalEngine
from rlmegatron.rollout.sampling import filter_top_k_top_p
from tests.models.tiny_hf import save_tiny_model

# A vocabulary of 8: the draft's and the main model's distributions overlap enough that most drafts are kept and
# some are not, and the exact distribution of a few tokens is a small enumeration.
VOCAB = 8
MTP = "model.layers.2."  # the MTP layer follows the 2 decoder layers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import load_file

    directory = str(tmp_path_factory.mktemp("deepseek_v3"))
    save_tiny_model("deepseek_v3", directory, vocab_size=VOCAB, num_hidden_layers=2)
    return directory, load_file(f"{directory}/model.safetensors")


def engine(checkpoint, num_draft_tokens: int, dtype=torch.float32, tensors=None, **kwargs) -> LocalEngine:
    """The checkpoint's model in a local engine, every weight loaded the way a sync loads them (the MTP layer's too,
    which the engine drafts with, or skips without drafting as SGLang's model does)."""
    from transformers import AutoModelForCausalLM

    directory, saved = checkpoint
    # transformers' grouped experts take no float64; its loop over the experts does.
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **(
        {"experts_implementation": "eager"} if dtype == torch.float64 else {}))
    engine = LocalEngine(model, num_draft_tokens=num_draft_tokens, **kwargs)
    engine.update_weights([(name, tensor.to(dtype)) for name, tensor in (tensors or saved).items()], "v")
    return engine


def draft_from_the_next_token_alone(saved: dict) -> dict:
    """The checkpoint with an MTP layer that sees only the token it is given (its hidden-state input and its
    layer's outputs zeroed): it drafts what the main model's embedding path alone would predict. With the embedding
    3x larger, so that the main model's prediction leans on that path too, that is the main model's argmax about
    half the time: greedy decoding both keeps and rejects drafts."""
    tensors = dict(saved)
    tensors["model.embed_tokens.weight"] = tensors[MTP + "embed_tokens.weight"] = saved["model.embed_tokens.weight"] * 3
    hidden = tensors["model.norm.weight"].shape[0]
    tensors[MTP + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    tensors[MTP + "enorm.weight"] = torch.ones(hidden)
    tensors[MTP + "shared_head.norm.weight"] = tensors["model.norm.weight"]
    for name in tensors:
        if name.startswith(MTP) and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    return tensors


def test_the_draft_layer_is_the_mtp_layer_megatron_trains(checkpoint):
    """MTPDraft over a whole sequence (the main model's final hidden states, each next token) gives the logits of
    conversion_jobs.hf_mtp_logits, which the conversion tests hold equal to Megatron-Core's own MTP forward."""
    from transformers import DynamicCache

    from tests.models.conversion_jobs import hf_mtp_logits

    drafting = engine(checkpoint, 1)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 5]])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        hidden = drafting.model.get_decoder()(tokens).last_hidden_state
        _, logits = drafting.draft(hidden, tokens.roll(-1, 1), positions, torch.ones_like(tokens), DynamicCache())
    reference = hf_mtp_logits(checkpoint[0], tokens)
    assert torch.equal(logits[:, :-1], reference[:, :-1])  # the last position has no token after it


def test_greedy_tokens_equal_plain_decoding_with_drafts_kept_and_rejected(checkpoint):
    tensors = draft_from_the_next_token_alone(checkpoint[1])
    # The third request stops at its third token, inside a verification (the others run to max_new_tokens).
    requests = [GenerationRequest(tuple((5 * i + j) % VOCAB for j in range(3 + 2 * i)),
                                  SamplingSpec(temperature=0.0, max_new_tokens=24, stop_token_ids=(6,) * (i == 2)))
                for i in range(4)]
    plain = engine(checkpoint, 0, tensors=tensors).generate(requests)
    assert plain[2].finish_reason == "stop" and len(plain[2].output_token_ids) == 3
    for k in (1, 3):
        drafted = engine(checkpoint, k, tensors=tensors).generate(requests)
        assert [(r.output_token_ids, r.finish_reason) for r in drafted] == [
            (r.output_token_ids, r.finish_reason) for r in plain]
        assert all(r.spec_num_proposed_drafts == k * r.spec_verify_ct for r in drafted)
        kept = sum(r.spec_num_correct_drafts for r in drafted) / sum(r.spec_num_proposed_drafts for r in drafted)
        assert 0.1 < kept < 0.9, kept  # both branches of the acceptance ran
        for a, b in zip(plain, drafted):
            assert max(abs(x - y) for x, y in zip(a.output_token_logprobs, b.output_token_logprobs)) < 1e-5


def test_logprobs_are_the_main_models_and_greedy_rows_mix_with_sampled_ones(checkpoint):
    """With a float64 model the reported log-probs are bitwise a full forward's over the sampled tokens (the engine's
    log-softmax is float32, as plain decoding's); a greedy row in the same batch still decodes as plain decoding
    does."""
    spec = SamplingSpec(n=3, temperature=0.8, top_p=0.9, max_new_tokens=10, seed=5)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=10)
    prompt = (1, 2, 3, 4)
    drafting = engine(checkpoint, 2, dtype=torch.float64)
    results = drafting.generate([GenerationRequest(prompt, spec), GenerationRequest(prompt, greedy)])
    assert sum(r.spec_num_correct_drafts for r in results) > 0
    for result in results:
        tokens = list(prompt) + list(result.output_token_ids)
        with torch.no_grad():
            logits = drafting.model(input_ids=torch.tensor([tokens])).logits[0, len(prompt) - 1:-1]
        temperature = 0.8 if result.request_index == 0 else 1.0
        # The engine's convention: log-softmax in float32 (plain decoding's too).
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(
            -1, torch.tensor(result.output_token_ids).unsqueeze(-1)).squeeze(-1)
        assert torch.equal(torch.tensor(result.output_token_logprobs), expected)
    plain = engine(checkpoint, 0, dtype=torch.float64).generate([GenerationRequest(prompt, greedy)])
    assert results[-1].output_token_ids == plain[0].output_token_ids


def exact_marginals(model, prompt: tuple, length: int, temperature: float, top_k: int
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The main model's sampler's exact distribution of each of the first `length` output tokens, and the joint of
    tokens 2 and 3, by enumerating every prefix (full forwards, no cache)."""
    def next_distribution(prefixes: list[tuple]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + p for p in prefixes])).logits[:, -1].float()
        return torch.softmax(filter_top_k_top_p(logits / temperature, top_k, 1.0).double(), -1)

    marginals, probability = [], {(): 1.0}
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for position in range(length):
        prefixes = list(probability)
        nexts = next_distribution(prefixes)
        marginals.append(sum(probability[p] * nexts[i] for i, p in enumerate(prefixes)))
        probability = {p + (t,): probability[p] * float(nexts[i, t])
                       for i, p in enumerate(prefixes) for t in range(VOCAB) if nexts[i, t] > 0}
        if position == 2:
            for p, mass in probability.items():
                joint[p[1], p[2]] += mass
    return marginals, joint


def chi_square_p(counts: torch.Tensor, expected_probabilities: torch.Tensor) -> float:
    """Pearson's test of `counts` against the probabilities, cells expected fewer than 5 times pooled."""
    expected = expected_probabilities.flatten() * counts.sum()
    counts = counts.flatten().double()
    if counts[expected == 0].sum() > 0:  # a token the main model's sampler never draws
        return 0.0
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = expected > 0
    return float(chisquare(observed[keep].numpy(), expected[keep].numpy() * observed.sum().item()
                           / expected[keep].sum().item()).pvalue)


def accept_always(p, q, drafts, uniform, greedy, main_argmax):
    """A wrong rule: every draft kept, the token after them from p."""
    return torch.full_like(drafts[:, 0], drafts.shape[1]), p[:, -1]


@pytest.mark.parametrize("rule", ["speculative sampling", "accept always"])
def test_sampled_tokens_follow_the_main_models_distribution(checkpoint, monkeypatch, rule):
    """2,500 samples of 4 tokens (10,000 tokens) at temperature 1 and top-k 6, 3 drafts per verification: the
    histograms of tokens 1-4 and of tokens 2 and 3 together against the exact distributions, each at the 0.1 %
    level. Accepting every draft fails them: its tokens follow the draft."""
    if rule == "accept always":
        monkeypatch.setattr(speculative, "accept_drafts", accept_always)
    prompt, length, temperature, top_k, samples = (1, 2, 3), 4, 1.0, 6, 2500
    drafting = engine(checkpoint, 3, max_batch_size=samples)
    results = drafting.generate([GenerationRequest(prompt, SamplingSpec(
        n=samples, temperature=temperature, top_k=top_k, max_new_tokens=length))])
    tokens = torch.tensor([r.output_token_ids for r in results])
    assert tokens.shape == (samples, length)
    marginals, joint = exact_marginals(drafting.model, prompt, length, temperature, top_k)
    p_values = [chi_square_p(torch.bincount(tokens[:, i], minlength=VOCAB), marginals[i]) for i in range(length)]
    p_values.append(chi_square_p(torch.bincount(tokens[:, 1] * VOCAB + tokens[:, 2], minlength=VOCAB ** 2)
                                 .view(VOCAB, VOCAB), joint))
    kept = sum(r.spec_num_correct_drafts for r in results) / sum(r.spec_num_proposed_drafts for r in results)
    if rule == "accept always":
        assert min(p_values[1:]) < 1e-6, p_values  # the drafted tokens' histograms are far off
    else:
        assert 0.3 < kept < 0.95, kept  # drafts both kept and rejected
        assert min(p_values) > 1e-3, p_values


def test_a_count_up_run_drafts_with_the_trained_mtp_layer_and_samples_from_the_policy(tmp_path):
    """Three steps of configs/count_up.yaml (the local engine drafting 3 tokens per verification, the MTP layer
    trained with the policy): each step logs the acceptance, the accepted drafts per verification are 3 times the
    rate (num_draft_tokens reached the engine), and the engine's log-probs of its samples are the trainer's policy's
    (the on-policy check: sampling and log-probs from the main model, not the draft)."""
    import json
    import sys
    from pathlib import Path

    from tests.helpers import warm_runs

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "history.json"
    run = warm_runs.run([sys.executable, "-m", "tests.driver.jobs", str(out), "launched", "configs/count_up.yaml",
                         f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.test_freq=-1",
                         "trainer.val_before_train=false", "data.val_files=[]", "trainer.resume=disable"],
                        cwd=root, timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    history = json.loads(out.read_text())["history"]
    rates, accepted = history["rollout/spec_accept_rate"], history["rollout/spec_accepted_tokens_mean"]
    assert [step for step, _ in rates] == [1, 2, 3] and all(0 < rate < 1 for _, rate in rates)
    assert all(abs(mean - 3 * rate) < 1e-9 for (_, rate), (_, mean) in zip(rates, accepted))
    assert len(history["actor/mtp_loss"]) == 3
    # The trainer's probabilities of the sampled tokens within 1e-6 of the engine's (8e-9 measured); the draft's differ
    # by tenths (a fifth of its drafts are rejected).
    assert max(value for _, value in history["training/rollout_probs_diff_max"]) < 1e-6


def test_the_local_server_drafts_when_launched_with_sglangs_speculative_flags(checkpoint):
    """Disaggregated, the local engine is a server launched with SGLang's command line: rollout.speculative's flags
    (server.speculative_flags) make it draft, and its answers carry the counts under SGLang's meta_info names, which
    the client reads back."""
    from rlmegatron.rollout.local_server import LocalServer, engine_for, parse_arguments
    from rlmegatron.rollout.sglang.client import parse_generate_response
    from rlmegatron.rollout.sglang.server import extra_flags, speculative_flags

    directory, saved = checkpoint
    args = parse_arguments(["--model-path", directory, "--port", "1", "--device", "cpu",
                            *extra_flags(speculative_flags(2))])
    served = engine_for(args)
    served.update_weights(list(saved.items()), "v")
    server = LocalServer(served)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "sampling_seed": 5}
    result = parse_generate_response(server.generate({"input_ids": [1, 2, 3], "sampling_params": params}), 0, 0)
    server.scheduler.hold("end")
    (direct,) = engine(checkpoint, 2, eos_token_ids=[served.model.config.eos_token_id]).generate(
        [GenerationRequest((1, 2, 3), SamplingSpec(max_new_tokens=6, seed=5))])
    assert result.output_token_ids == direct.output_token_ids and result.spec_verify_ct > 0
    assert (result.spec_verify_ct, result.spec_num_correct_drafts, result.spec_num_proposed_drafts) == (
        direct.spec_verify_ct, direct.spec_num_correct_drafts, 2 * direct.spec_verify_ct)


def test_a_seeded_sample_draws_the_same_tokens_whatever_else_is_in_its_batch(checkpoint):
    """Its draws come from its own generator, a fixed number per verification: other prompts (padding it) and
    unseeded samples beside it change nothing."""
    drafting = engine(checkpoint, 2)
    seeded = GenerationRequest((1, 2, 3), SamplingSpec(n=2, max_new_tokens=8, seed=7))
    alone = drafting.generate([seeded])
    mixed = drafting.generate([GenerationRequest((4, 5, 6, 7, 1), SamplingSpec(n=3, max_new_tokens=5)), seeded])
    assert [r.output_token_ids for r in mixed[3:]] == [r.output_token_ids for r in alone]
    assert alone[0].output_token_ids != alone[1].output_token_ids


def test_rejected_drafts_are_dropped_from_the_kv_caches_and_decoding_goes_on_as_plain(checkpoint, monkeypatch):
    """The checkpoint's own (random) draft is almost never the main model's argmax: hidden entries pile up in both
    caches, which are compacted once they are most of them; the tokens stay plain decoding's."""
    shrunk = []

    def watched(cache, mask):
        kept = compacted(cache, mask)
        shrunk.append(kept.shape[1] < mask.shape[1])
        assert all(layer.keys.shape[2] == kept.shape[1] for layer in cache.layers)
        return kept

    compacted = speculative._compacted
    monkeypatch.setattr(speculative, "_compacted", watched)
    requests = [GenerationRequest((i, 2, 5, 7)[i % 2:], SamplingSpec(temperature=0.0, max_new_tokens=40))
                for i in range(3)]
    drafted = engine(checkpoint, 3).generate(requests)
    plain = engine(checkpoint, 0).generate(requests)
    assert [r.output_token_ids for r in drafted] == [r.output_token_ids for r in plain]
    assert sum(shrunk) >= 2, shrunk  # the main cache and the draft's
