"""The local engine in its own process behind SGLang's API (rollout.local_server), driven by SGLangEngine as a
disaggregated SGLang server is: weights over a gloo weight-update group, then generation that matches the model's own
greedy decoding and log-probs; with partial rollout, a sample paused mid-generation goes on from its tokens under the
new weights, every token's log-prob exactly the log-softmax of the weights that produced it."""
from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlmegatron.driver.role_settings import LOCAL_SERVER_MODULE
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from rlmegatron.rollout.local import checkpoint_named_weights
from rlmegatron.rollout.sglang.engine import SGLangEngine
from rlmegatron.rollout.sglang.protocol import DistributedGroupSpec
from rlmegatron.rollout.sglang.weight_push import DistributedWeightPush
from rlmegatron.rollout.sglang.server import ServerSpec
from rlmegatron.runtime.distributed import free_port

PROMPT = (5, 17, 42)


def model_config(path):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=160, max_position_embeddings=1024, num_hidden_layers=2, tie_word_embeddings=True,
    )
    config.save_pretrained(path)
    return config


def model(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    built = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        built.get_input_embeddings().weight.mul_(50)  # clear greedy choices, no near-ties
    return built


def teacher_forced(policy, prompt: list[int], response: list[int]) -> tuple[list[int], list[float]]:
    """For each response position: the greedy choice given the tokens before it, and the response token's
    log-softmax; one forward pass."""
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    log_softmax = torch.log_softmax(logits, -1)
    return log_softmax.argmax(-1).tolist(), log_softmax.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A local server of a tiny Qwen3, and the trainer-side weight push joined with it."""
    directory = tmp_path_factory.mktemp("local_server")
    config = model_config(directory / "model")
    spec = ServerSpec(model_path=str(directory / "model"), port=free_port(), python=sys.executable,
                      module=LOCAL_SERVER_MODULE, device="cpu", dtype="float32")
    engine = SGLangEngine(spec, str(directory), bucket_bytes=1 << 20, startup_timeout_s=120, request_timeout_s=120,
                          partial_rollout=True)
    push = DistributedWeightPush(1 << 20)
    push.connect(0, spec.url, 1, DistributedGroupSpec("127.0.0.1", free_port(), "local_server_test", "gloo"))
    yield config, engine, push
    engine.shutdown()


def push_model(push, policy, version: str) -> None:
    push.push(iter(checkpoint_named_weights(policy).items()), version)


def test_generation_follows_the_pushed_weights(served):
    config, engine, push = served
    policy = model(config, seed=1)
    push_model(push, policy, "v1")
    (result,) = engine.generate([GenerationRequest(PROMPT, SamplingSpec(temperature=0.0, max_new_tokens=12))])
    tokens, logprobs = teacher_forced(policy, list(PROMPT), list(result.output_token_ids))
    assert list(result.output_token_ids) == tokens
    assert result.output_token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert (result.weight_version, result.finish_reason) == ("v1", "length")


def test_partial_rollout_continues_under_the_new_weights_with_exact_log_probs(served):
    config, engine, push = served
    old, new = model(config, seed=1), model(config, seed=2)
    length = 800
    for pause_after in (0.2, 0.05, 0.6):  # a loaded machine may start the batch late: try another moment
        push_model(push, old, "v1")
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(engine.generate,
                                  [GenerationRequest(PROMPT, SamplingSpec(temperature=0.0, max_new_tokens=length))])
            time.sleep(pause_after)
            engine.pause_generation()
            push_model(push, new, "v2")
            engine.continue_generation()
            (result,) = pending.result(timeout=300)
        before = result.token_weight_versions.count("v1")
        if 0 < before < length:
            break
    assert 0 < before < length, "the pause never landed mid-generation"
    assert result.token_weight_versions == ("v1",) * before + ("v2",) * (length - before)
    head, tail = list(result.output_token_ids[:before]), list(result.output_token_ids[before:])
    head_tokens, head_logprobs = teacher_forced(old, list(PROMPT), head)
    tail_tokens, tail_logprobs = teacher_forced(new, [*PROMPT, *head], tail)
    assert head == head_tokens and tail == tail_tokens
    assert result.output_token_logprobs == pytest.approx(head_logprobs + tail_logprobs, abs=1e-4)


def test_non_finite_logits_reach_the_client_as_a_divergence(served):
    from rlmegatron.errors import Divergence

    config, engine, push = served
    broken = model(config, seed=1)
    with torch.no_grad():
        broken.model.norm.weight.fill_(math.nan)
    push_model(push, broken, "nan")
    with pytest.raises(Divergence, match="rollout logits: the server's log-prob of response token 1"):
        engine.generate([GenerationRequest(PROMPT, SamplingSpec(temperature=0.0, max_new_tokens=4))])


def test_fp8_weights_cross_gloo_as_bytes_and_the_server_samples_with_them_dequantised(tmp_path):
    """rollout.quantization fp8, disaggregated on CPU: gloo has no float8 type, so the FP8 weights travel as their
    bytes; the server, launched with SGLang's --quantization fp8, samples with exactly the dequantised weights."""
    from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT

    config = model_config(tmp_path / "model")
    spec = ServerSpec(model_path=str(tmp_path / "model"), port=free_port(), python=sys.executable,
                      module=LOCAL_SERVER_MODULE, device="cpu", dtype="float32", extra_args={"quantization": "fp8"})
    engine = SGLangEngine(spec, str(tmp_path), bucket_bytes=1 << 20, startup_timeout_s=120, request_timeout_s=120)
    try:
        push = DistributedWeightPush(1 << 20)
        push.connect(0, spec.url, 1, DistributedGroupSpec("127.0.0.1", free_port(), "fp8_test", "gloo"))
        policy = model(config, seed=1)
        push.push(FP8_ROLLOUT.quantised_stream(iter(checkpoint_named_weights(policy).items())), "v1")
        (result,) = engine.generate([GenerationRequest(PROMPT, SamplingSpec(temperature=0.0, max_new_tokens=12))])
    finally:
        engine.shutdown()
    with torch.no_grad():
        for name, weight in checkpoint_named_weights(policy).items():
            if FP8_ROLLOUT.quantises(name):
                weight.copy_(FP8_ROLLOUT.dequantise(*FP8_ROLLOUT.quantise(weight)))
    tokens, logprobs = teacher_forced(policy, list(PROMPT), list(result.output_token_ids))
    assert list(result.output_token_ids) == tokens and result.weight_version == "v1"
    assert result.output_token_logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="one GPU split between trainer and engine needs a GPU")
def test_a_server_on_the_trainers_own_gpu_takes_cuda_weights_over_gloo(tmp_path):
    """One GPU split between the trainer and a disaggregated engine (a run without Ray): the server's process gets
    this process's GPU, and the weights, CUDA tensors, cross over the backend `weight_group_backend` picks for it
    (gloo: NCCL refuses two ranks of a group on one device); generation then follows them."""
    import socket

    from rlmegatron.rollout.sglang.servers import device_id, weight_group_backend

    torch.cuda.set_device(0)
    gpu = device_id("cuda")
    backend = weight_group_backend("cuda", ((socket.gethostname(), gpu),))
    assert backend == "gloo"
    config = model_config(tmp_path / "model")
    spec = ServerSpec(model_path=str(tmp_path / "model"), port=free_port(), python=sys.executable,
                      module=LOCAL_SERVER_MODULE, device="cuda", dtype="float32", env={"CUDA_VISIBLE_DEVICES": gpu})
    engine = SGLangEngine(spec, str(tmp_path), bucket_bytes=1 << 20, startup_timeout_s=120, request_timeout_s=120)
    try:
        push = DistributedWeightPush(1 << 20)
        push.connect(0, spec.url, 1, DistributedGroupSpec("127.0.0.1", free_port(), "same_gpu_test", backend))
        policy = model(config, seed=1).cuda()
        push_model(push, policy, "v1")
        (result,) = engine.generate([GenerationRequest(PROMPT, SamplingSpec(temperature=0.0, max_new_tokens=12))])
    finally:
        engine.shutdown()
    tokens, logprobs = teacher_forced(policy.cpu(), list(PROMPT), list(result.output_token_ids))
    assert list(result.output_token_ids) == tokens and result.weight_version == "v1"
    assert result.output_token_logprobs == pytest.approx(logprobs, abs=1e-3)  # the GPU's kernels against the CPU's


def test_the_local_server_returns_each_tokens_experts_in_sglangs_format():
    """A Qwen3-MoE whose first layer is dense: the answer's routed_experts is SGLang's layout (every decoder layer,
    zeros in the dense one), which the client's RoutedExpertsLayout reads back as the engine recorded it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlmegatron.rollout.local import LocalEngine
    from rlmegatron.rollout.local_server import LocalServer
    from rlmegatron.rollout.sglang.protocol import RoutedExpertsLayout

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                  num_experts_per_tok=2, mlp_only_layers=[0], vocab_size=160,
                                  max_position_embeddings=64, num_hidden_layers=3)
    torch.manual_seed(0)
    engine = LocalEngine(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    server = LocalServer(engine, return_routed_experts=True)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "sampling_seed": 5}
    answer = server.generate({"input_ids": list(PROMPT), "sampling_params": params, "return_routed_experts": True})
    layout = RoutedExpertsLayout.of(config.to_dict())
    assert layout == RoutedExpertsLayout(layers=3, moe_layers=(1, 2), topk=2)
    (direct,) = engine.generate([GenerationRequest(PROMPT, SamplingSpec(max_new_tokens=4, seed=5),
                                                   return_routed_experts=True)])
    assert answer["output_ids"] == list(direct.output_token_ids)
    assert torch.equal(layout.decode(answer["meta_info"]["routed_experts"]), direct.routed_experts)
    assert direct.routed_experts.shape == (len(PROMPT) + 4 - 1, 2, 2)
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32).reshape(-1, 3, 2)
    assert (raw[:, 0] == 0).all()  # the dense layer
    server.scheduler.hold("end")


def test_image_data_is_refused_rather_than_dropped(served):
    """The local server has no multimodal processor: a request with images fails in one line, never samples from
    the prompt's ids without them."""
    from rlmegatron.rollout.sglang.client import SGLangRequestError

    _, engine, _ = served
    with pytest.raises((SGLangRequestError, RuntimeError), match="the local server does not take image_data yet"):
        engine.generation_client.generate(list(PROMPT), {"max_new_tokens": 1, "temperature": 0.0, "top_p": 1.0,
                                                         "top_k": -1}, image_data=["aGk="])
