"""LocalEngine: greedy parity with a no-cache argmax loop, log-prob convention, weight loading, finish reasons, seeds."""
from __future__ import annotations

import math

import pytest
import torch

from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT
from rlmegatron.rollout.buckets import iter_buckets
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from rlmegatron.rollout.local import LocalEngine, checkpoint_named_weights
from rlmegatron.models.families import FAMILIES
from tests.models.tiny_hf import MOE_FAMILIES, save_tiny_model

PROMPTS = [(5, 17, 42), (9,), (101, 3, 77, 12, 150, 8)]


def tiny_qwen3(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=160, max_position_embeddings=64, num_hidden_layers=2, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger logits than the default init so greedy paths and top-k/top-p cut-offs are not near-ties.
        model.get_input_embeddings().weight.mul_(50)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_greedy_matches_no_cache_argmax_loop(model):
    engine = LocalEngine(model)
    spec = SamplingSpec(temperature=0.0, max_new_tokens=8)
    results = engine.generate([GenerationRequest(p, spec) for p in PROMPTS])
    assert [(r.request_index, r.sample_index) for r in results] == [(0, 0), (1, 0), (2, 0)]
    for prompt, result in zip(PROMPTS, results):
        tokens = list(prompt)
        for _ in range(8):
            tokens.append(int(full_logits(model, tokens)[-1].argmax()))
        assert list(result.output_token_ids) == tokens[len(prompt):]
        assert result.finish_reason == "length"


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (0.7, 0.9, 20), (1.3, 1.0, -1)])
def test_logprobs_equal_full_forward_log_softmax(model, temperature, top_p, top_k):
    engine = LocalEngine(model)
    spec = SamplingSpec(n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6, seed=3)
    for result in engine.generate([GenerationRequest(p, spec) for p in PROMPTS]):
        prompt = PROMPTS[result.request_index]
        tokens = list(prompt) + list(result.output_token_ids)
        logits = full_logits(model, tokens)[len(prompt) - 1 : -1] / (temperature or 1.0)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.output_token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.output_token_logprobs), expected, atol=1e-5, rtol=0)


def test_top_k_one_is_greedy(model):
    engine = LocalEngine(model)
    sampled = engine.generate([GenerationRequest(p, SamplingSpec(temperature=1.0, top_k=1, max_new_tokens=5)) for p in PROMPTS])
    greedy = engine.generate([GenerationRequest(p, SamplingSpec(temperature=0.0, max_new_tokens=5)) for p in PROMPTS])
    assert [r.output_token_ids for r in sampled] == [r.output_token_ids for r in greedy]


def test_seeded_sampling_is_reproducible(model):
    engine = LocalEngine(model)
    requests = [GenerationRequest(p, SamplingSpec(n=3, temperature=4.0, max_new_tokens=6, seed=11)) for p in PROMPTS]
    first, second = engine.generate(requests), LocalEngine(model, seed=99).generate(requests)
    assert [r.output_token_ids for r in first] == [r.output_token_ids for r in second]
    assert len({r.output_token_ids for r in first if r.request_index == 2}) > 1, "the n samples should differ"


def test_a_seeded_sample_does_not_depend_on_its_batch(model):
    spec = SamplingSpec(n=3, temperature=1.5, top_k=30, max_new_tokens=6, seed=5)
    together = LocalEngine(model).generate([GenerationRequest(p, spec) for p in PROMPTS])
    alone = LocalEngine(model, max_batch_size=2).generate([GenerationRequest(PROMPTS[2], spec)])
    assert [r.output_token_ids for r in alone] == [r.output_token_ids for r in together if r.request_index == 2]


def test_a_seeded_samples_noise_is_one_draw_per_token_from_its_own_generator(model):
    """What a seed stands for, however the engine batches its draws (on the CPU, several tokens' noise in one call):
    token t of sample i is the argmax of logits / temperature plus Gumbel noise from the t-th vocabulary-sized draw
    of a generator seeded with seed * 1_000_003 + i. 8 tokens of a 160-token vocabulary cross the engine's blocks."""
    spec = SamplingSpec(n=3, temperature=4.0, max_new_tokens=8, seed=21)
    results = LocalEngine(model).generate([GenerationRequest(p, spec) for p in PROMPTS])
    for result in results:
        generator = torch.Generator().manual_seed(21 * 1_000_003 + result.sample_index)
        prompt = PROMPTS[result.request_index]
        tokens = list(prompt)
        for _ in range(8):
            gumbel = -torch.log(-torch.log(torch.rand(160, generator=generator, dtype=torch.float64)))
            tokens.append(int(torch.argmax(full_logits(model, tokens)[-1] / 4.0 + gumbel.float())))
        assert tuple(tokens[len(prompt):]) == result.output_token_ids
    assert len({r.output_token_ids for r in results if r.request_index == 2}) == 3, "the n samples should differ"


def test_the_samples_of_a_prompt_share_its_prefill_and_match_samples_made_one_by_one(model):
    spec = SamplingSpec(n=4, temperature=4.0, max_new_tokens=6, seed=11)
    prefill_rows = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    try:
        # The same prompt twice as two requests and a third prompt: 3 distinct prompts' prefill for 12 samples.
        requests = [GenerationRequest(PROMPTS[2], spec), GenerationRequest(PROMPTS[0], spec),
                    GenerationRequest(PROMPTS[2], spec)]
        shared = LocalEngine(model).generate(requests)
        first_call = prefill_rows[0]
        one_by_one = LocalEngine(model, max_batch_size=1).generate(requests)
    finally:
        hook.remove()
    assert first_call == (2, len(PROMPTS[2]))
    assert [r.output_token_ids for r in shared] == [r.output_token_ids for r in one_by_one]
    assert len({r.output_token_ids for r in shared if r.request_index == 0}) > 1, "the n samples should differ"
    for a, b in zip(shared, one_by_one):
        assert max(abs(x - y) for x, y in zip(a.output_token_logprobs, b.output_token_logprobs)) < 1e-5


def test_the_prefill_computes_the_last_positions_logits_only(model):
    """A [batch, prompt, vocabulary] logits tensor is what a long prompt with a 150k vocabulary cannot afford."""
    shapes = []
    hook = model.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.logits.shape)))
    try:
        LocalEngine(model).generate([GenerationRequest(PROMPTS[2], SamplingSpec(temperature=0.0, max_new_tokens=2))])
    finally:
        hook.remove()
    assert shapes == [(1, 1, 160), (1, 1, 160)]


@pytest.mark.parametrize("temperature,top_p,top_k", [(5.0, 1.0, -1), (10.0, 0.9, 20)])
def test_samples_follow_the_filtered_softmax(model, temperature, top_p, top_k):
    """4096 first tokens (high temperatures: the test model's logits are sharp): never outside the top-k / top-p
    set, and their frequencies are the renormalised softmax of logits / temperature over it, within twice the total
    variation that sampling noise alone gives on average."""
    from rlmegatron.rollout.sampling import filter_top_k_top_p

    prompt, draws = PROMPTS[2], 4096
    spec = SamplingSpec(n=draws, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1, seed=7)
    tokens = [r.output_token_ids[0] for r in LocalEngine(model, max_batch_size=512).generate(
        [GenerationRequest(prompt, spec)])]
    expected = torch.softmax(filter_top_k_top_p(full_logits(model, list(prompt))[-1] / temperature, top_k, top_p), -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double() / draws
    assert int((expected > 0.01).sum()) > 10, "a spread-out distribution, or the test shows little"
    assert all(expected[t] > 0 for t in set(tokens))
    # E|count_i/N - p_i| is about sqrt(2 p_i (1 - p_i) / (pi N)) for each token.
    noise = 0.5 * float((2 * expected * (1 - expected) / (math.pi * draws)).sqrt().sum())
    assert 0.5 * float((counts - expected.double()).abs().sum()) < 2 * noise


def test_stop_and_length_finish_reasons(model):
    engine = LocalEngine(model)
    greedy = engine.generate([GenerationRequest(PROMPTS[2], SamplingSpec(temperature=0.0, max_new_tokens=6))])[0]
    stop_token = greedy.output_token_ids[2]
    first_hit = greedy.output_token_ids.index(stop_token)
    spec = SamplingSpec(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop_token,))
    stopped, short = engine.generate([
        GenerationRequest(PROMPTS[2], spec),
        GenerationRequest(PROMPTS[2], SamplingSpec(temperature=0.0, max_new_tokens=2)),
    ])
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == greedy.output_token_ids[: first_hit + 1]
    assert len(stopped.output_token_logprobs) == first_hit + 1
    assert short.finish_reason == "length" and short.output_token_ids == greedy.output_token_ids[:2]


def test_update_weights_is_bit_identical_and_strict():
    engine = LocalEngine(tiny_qwen3(seed=0))
    new_state = {k: v.clone() for k, v in tiny_qwen3(seed=1).state_dict().items()}
    stream = iter_buckets(iter(new_state.items()), bucket_bytes=16 * 1024)
    engine.update_weights(stream, version="v1")
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, new_state[name]), name
    assert engine.generate([GenerationRequest(PROMPTS[0], SamplingSpec(max_new_tokens=1))])[0].weight_version == "v1"
    with pytest.raises(KeyError, match="not_a_weight"):
        engine.update_weights([("not_a_weight", torch.zeros(1))], version="v2")


def test_released_weights_refuse_generation(model):
    engine = LocalEngine(model)
    engine.release_memory(["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([GenerationRequest(PROMPTS[0])])
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache"])
    assert engine.generate([GenerationRequest(PROMPTS[0], SamplingSpec(max_new_tokens=2))])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="weights are released from an accelerator only")
def test_released_and_resumed_tied_weights_come_back_to_the_device_bit_for_bit():
    """Tied embeddings are one tensor under two names: each moves once, and returns to the device it left."""
    engine = LocalEngine(tiny_qwen3().cuda())
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    expected = engine.generate([GenerationRequest(PROMPTS[2], SamplingSpec(max_new_tokens=4, temperature=0.0))])
    engine.release_memory(["weights"])
    assert all(t.device.type == "cpu" for t in engine.model.state_dict().values())
    engine.resume_memory(["weights"])
    state = engine.model.state_dict()
    assert all(t.device.type == "cuda" and torch.equal(t, before[name]) for name, t in state.items())
    assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight
    again = engine.generate([GenerationRequest(PROMPTS[2], SamplingSpec(max_new_tokens=4, temperature=0.0))])
    assert again[0].output_token_ids == expected[0].output_token_ids


class PoisonedLogits(torch.nn.Module):
    """`model` with the last position's logits of `rows` set to `value` from the `from_call`-th forward on (1-based),
    and every logit from index `masked_from` on at -inf (a masked vocabulary)."""

    def __init__(self, model, rows, value, from_call, masked_from):
        super().__init__()
        self.model, self.rows, self.value, self.from_call, self.masked_from = model, rows, value, from_call, masked_from
        self.calls = 0

    def forward(self, **inputs):
        out = self.model(**inputs)
        self.calls += 1
        out.logits[:, -1, self.masked_from:] = float("-inf")
        if self.calls >= self.from_call:
            out.logits[self.rows, -1, :] = self.value
        return out


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "all-minus-inf"])
def test_non_finite_logits_of_a_sample_still_generating_stop_generation_naming_the_rollout_logits(model, value):
    from rlmegatron.errors import Divergence

    greedy = SamplingSpec(temperature=0.0, max_new_tokens=4)
    first = LocalEngine(model).generate([GenerationRequest(PROMPTS[0], greedy)])[0].output_token_ids[0]
    # Sample 0 stops at its first token, so its logits after that are never used; sample 1's are, from token 2 on.
    stop_first = SamplingSpec(temperature=0.0, max_new_tokens=4, stop_token_ids=(first,))
    requests = [GenerationRequest(PROMPTS[0], stop_first)] + [GenerationRequest(p, greedy) for p in PROMPTS[1:]]
    with pytest.raises(Divergence) as raised:
        LocalEngine(PoisonedLogits(model, [0, 1], value, from_call=2, masked_from=150)).generate(requests)
    assert str(raised.value) == ("rollout logits: NaN or inf for 1 of the 3 samples at response token 2; the rollout "
                                 "model's weights are not usable")
    # A masked vocabulary alone is fine, and nothing masked is sampled.
    results = LocalEngine(PoisonedLogits(model, [], value, from_call=1, masked_from=150)).generate(
        [GenerationRequest(p, SamplingSpec(n=4, max_new_tokens=4, seed=1)) for p in PROMPTS])
    assert max(token for r in results for token in r.output_token_ids) < 150
    assert all(math.isfinite(logprob) for r in results for logprob in r.output_token_logprobs)


def test_fp8_weight_updates_are_held_quantised_then_dequantised():
    """rollout.quantization fp8: each projection arrives as float8_e4m3fn + weight_scale_inv, here each in a bucket of
    its own, and the engine samples with exactly its dequantised values; the other weights arrive as they are."""
    engine = LocalEngine(tiny_qwen3(seed=0), weight_format=FP8_ROLLOUT)
    new_state = {k: v.clone() for k, v in tiny_qwen3(seed=1).state_dict().items()}
    stream = iter_buckets(FP8_ROLLOUT.quantised_stream(iter(new_state.items())), bucket_bytes=1)
    engine.update_weights(stream, version="fp8")
    quantised = [name for name in new_state if FP8_ROLLOUT.quantises(name)]
    assert len(quantised) == 2 * 7  # q, k, v, o, gate, up, down of both layers
    for name, tensor in engine.model.state_dict().items():
        expected = FP8_ROLLOUT.dequantise(*FP8_ROLLOUT.quantise(new_state[name])) if name in quantised \
            else new_state[name]
        assert torch.equal(tensor, expected), name
    assert all(not torch.equal(engine.model.state_dict()[name], new_state[name]) for name in quantised)
    weight = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=f"without the partner of \\['{weight}'\\]"):
        engine.update_weights([(weight, FP8_ROLLOUT.quantise(new_state[weight])[0])], version="v2")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_engine_names_every_weight_as_the_checkpoint_does(tmp_path, family):
    """What the weight sync streams is named as the family's checkpoint; the engine holds transformers 5's model,
    which stacks the experts and may keep a MoE block under another module name (Mixtral's and MiniMax-M2's
    block_sparse_moe.): every checkpoint tensor must be found under its own name, as a view of what the model holds."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rlmegatron.rollout.local import causal_lm_from_config

    directory = save_tiny_model(family, str(tmp_path))
    engine_class = type(causal_lm_from_config(AutoConfig.from_pretrained(directory), torch.float32, False))
    model = engine_class.from_pretrained(directory, dtype=torch.float32)
    named = checkpoint_named_weights(model)
    # The MTP layers DeepSeek and GLM ship, which transformers does not build, are the only tensors it lacks, but
    # for those a family carries as they are (Kimi-K2.5's vision tower), which no sync sends.
    family = FAMILIES[family]
    saved = {k: v for k, v in load_file(f"{directory}/model.safetensors").items()
             if not k.startswith(f"model.layers.{model.config.get_text_config().num_hidden_layers}.")
             and not family.carries(k)}
    assert named.keys() >= saved.keys()
    assert all(family.carries(k) or k.startswith("model.vision_tower.") for k in named.keys() - saved.keys())
    assert all(torch.equal(named[k], saved[k]) for k in saved)
    held = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert all(named[k].untyped_storage().data_ptr() in held for k in saved)  # copies into them reach the model
