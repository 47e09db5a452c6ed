"""rlmegatron's SGLang client against SGLang 0.5.23's own server code (tests/rollout/sglang_cpu): its FastAPI app,
tokenizer-manager control methods, scheduler-side weight-update manager and model-runner weight updater, with only
the model, the memory saver and the scheduler loop stood in. One server for the module (it starts in ~15-40 s)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from rlmegatron.rollout.delta import LOADER as DELTA_LOADER
from rlmegatron.rollout.sglang.client import SGLangClient, SGLangRequestError, ServerUnavailable
from rlmegatron.rollout.sglang.engine import EngineRestarted, SGLangEngine
from rlmegatron.rollout.sglang.protocol import DistributedGroupSpec
from rlmegatron.rollout.sglang.weight_push import DistributedWeightPush
from rlmegatron.rollout.sglang.protocol import RoutedExpertsLayout
from rlmegatron.rollout.sglang.server import ServerSpec
from rlmegatron.runtime.distributed import free_port
from tests.helpers.sglang_args import parse_with_sglang

HERE = Path(__file__).parent
REPO_ROOT = HERE.parents[1]
MODEL = REPO_ROOT / "configs" / "quickstart" / "model"
TOKEN_DELAY_S = 0.05
HEALTH_CHECK_TIMEOUT_S = 4


@pytest.fixture(autouse=True, scope="module")
def _buckets_by_named_shared_memory(file_system_sharing):
    """tests/rollout/conftest.py's file_system_sharing for every test of the module."""


def weights(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes; the bf16 tensor's odd length puts the fp32 one after it off a 4-byte boundary unless aligned."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", (torch.randn(7, 3, generator=generator) * scale).to(torch.bfloat16)),
        ("model.layers.0.mlp.gate_proj.weight", torch.randn(8, 16, generator=generator) * scale),
        ("model.layers.0.input_layernorm.weight", (torch.randn(5, generator=generator) * scale).half()),
        ("model.norm.weight", torch.randn(16, generator=generator) * scale),
    ]


def digest(tensor: torch.Tensor) -> list:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
            hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]


def checksum(named) -> int:
    return int(sum(float(tensor.double().sum()) for _, tensor in named) * 1000) % 997


def tokens(input_ids, count: int, weights_checksum: int) -> list[int]:
    """The stand-in model's tokens: token s is (sum(input) + 31 s + checksum of its weights) mod 1000."""
    return [(sum(input_ids) + 31 * step + weights_checksum) % 1000 for step in range(count)]


def model_state(engine: SGLangEngine) -> dict:
    return SGLangClient(engine.spec.url)._call("GET", "/standin/model")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("sglang_cpu")
    spec = ServerSpec(
        model_path=str(MODEL), port=free_port(), python=sys.executable, module="sglang_cpu_server",
        device="cpu", dtype="float32", load_format="dummy",
        extra_args={"enable-lora": True, "max-lora-rank": 4, "lora-target-modules": "all",
                    "enable-return-routed-experts": True, "custom-weight-loader": DELTA_LOADER},
        env={"PYTHONPATH": os.pathsep.join([str(HERE / "sglang_cpu"), str(REPO_ROOT)]),
             "RLM_SGLANG_CPU_TOKEN_DELAY": str(TOKEN_DELAY_S), "RLM_SGLANG_CPU_MAX_RUNNING": "2",
             # SGLang's own knob: a /health that hears nothing from the scheduler this long marks it unhealthy.
             "SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_CHECK_TIMEOUT_S)},
    )
    engine = SGLangEngine(spec, str(log_dir), bucket_bytes=256, startup_timeout_s=300, request_timeout_s=60,
                          partial_rollout=True, routing=ROUTING)
    yield engine
    engine.shutdown()


def test_the_server_runs_sglang_0_5_23_and_generates(engine):
    assert str(engine.client.version) == "0.5.23"
    (result,) = engine.generate([GenerationRequest((1, 2, 3), SamplingSpec(max_new_tokens=4, seed=3))])
    assert result.output_token_ids == tuple(tokens((1, 2, 3), 4, 0))
    assert result.output_token_logprobs == pytest.approx((-0.01, -0.02, -0.03, -0.04))
    assert result.finish_reason == "length" and result.weight_version == "default"


# The stand-in model routes both of its 2 layers, top-2 (sglang_cpu_server.standin_expert); the layout says which
# layers routing replay keeps: here the second only, as a model with a dense first layer has it.
ROUTING = RoutedExpertsLayout(layers=2, moe_layers=(1,), topk=2)


def test_each_tokens_experts_come_back_as_sglang_encodes_them(engine):
    """`return_routed_experts`, answered through SGLang's app and encoded by its own detokenizer code: one row per
    token the server ran (the prompt, then the output but its last token), the MoE layers of the layout kept."""
    from tests.rollout.sglang_cpu.standin_routing import standin_expert

    prompt = (3, 9, 4)
    (result,) = engine.generate([GenerationRequest(prompt, SamplingSpec(max_new_tokens=4),
                                                   return_routed_experts=True)])
    ran = [*prompt, *result.output_token_ids][:-1]
    expected = [[[standin_expert(token, layer, slot) for slot in range(2)] for layer in ROUTING.moe_layers]
                for token in ran]
    assert result.routed_experts.dtype == torch.int16 and result.routed_experts.tolist() == expected
    (plain,) = engine.generate([GenerationRequest(prompt, SamplingSpec(max_new_tokens=4))])
    assert plain.routed_experts is None


def test_colocated_push_after_sleep_hands_the_model_every_tensor_bit_for_bit(engine):
    """Release all memory, wake with weights: one weight-update session around the buckets (SGLang 0.5.21+ refuses
    updates outside one), buckets SGLang's FlattenedTensorBucket rebuilds (aligned), then the KV cache back."""
    engine.release_memory()
    assert model_state(engine)["released"] == ["cuda_graph", "kv_cache", "weights"]
    engine.wake_up_with_weights(iter(weights()), version="v1")
    state = model_state(engine)
    assert state["weights"] == {name: digest(tensor) for name, tensor in weights()}
    assert state["version"] == "v1" and state["released"] == []
    (result,) = engine.generate([GenerationRequest((4, 5), SamplingSpec(max_new_tokens=3))])
    assert result.output_token_ids == tuple(tokens((4, 5), 3, checksum(weights())))
    assert result.weight_version == "v1"


def test_a_lora_mode_sleep_resumes_only_what_it_released(engine):
    """LoRA adapter sync keeps the base weights on the device: the engine releases kv_cache and cuda_graph only, and
    waking it must not resume `weights`, which SGLang's scheduler answers by dying."""
    engine.release_memory(("kv_cache", "cuda_graph"))
    engine.wake_up_with_weights(iter(weights()), version="v1")
    assert engine.process.alive and engine.health()
    assert model_state(engine)["released"] == []


def test_disaggregated_push_over_gloo_hands_the_model_every_tensor_bit_for_bit(engine):
    push = DistributedWeightPush(bucket_bytes=256)
    push.connect(0, engine.spec.url, 1, DistributedGroupSpec("127.0.0.1", free_port(), "conformance", "gloo"))
    assert push.push(iter(weights(2.0)), "v2") == []
    state = model_state(engine)
    assert state["weights"] == {name: digest(tensor) for name, tensor in weights(2.0)}
    assert state["version"] == "v2"
    engine.update_weights(iter(weights()), "v1")  # back to what the other tests expect


def test_a_delta_push_reaches_the_model_through_sglangs_custom_weight_loader_bit_for_bit(engine):
    """rollout.weight_sync=delta: full, then deltas, each bucket's records in the body of SGLang's own
    /update_weights_from_tensor, unpickled by its safe unpickler and handed by its weight updater to the loader the
    server was launched with (--custom-weight-loader), which loads whole tensors into the model. The model holds
    every tensor bit for bit, and loads only those that changed."""
    from rlmegatron.rollout.delta import DeltaSender, SyncBytes, iter_records

    sender, counted = DeltaSender(), SyncBytes()
    push = _connected_push(engine)
    as_records = lambda full: (lambda buckets: iter_records(buckets, sender, full, counted))  # noqa: E731
    assert push.push(iter(weights(3.0)), "d1", as_records=as_records(True)) == []
    assert model_state(engine)["weights"] == {name: digest(tensor) for name, tensor in weights(3.0)}
    changed = [(name, tensor.clone()) for name, tensor in weights(3.0)]
    changed[0][1].view(-1)[1] += 1  # one element of the first tensor
    counted = SyncBytes()
    assert push.push(iter(changed), "d2", as_records=as_records(False)) == []
    state = model_state(engine)
    assert state["weights"] == {name: digest(tensor) for name, tensor in changed} and state["version"] == "d2"
    # One element of one tensor: its position (4 bytes, or a bitmask of a small tensor) and its value.
    assert counted.tensors_changed == 1 and counted.sent <= 4 + 4
    assert counted.full == sum(t.numel() * t.element_size() for _, t in changed)
    # A push in which nothing changed still labels the weights with its version.
    assert push.push(iter(changed), "d3", as_records=as_records(False)) == []
    assert model_state(engine)["version"] == "d3"
    engine.update_weights(iter(weights()), "v1")  # back to what the other tests expect


def _connected_push(engine: SGLangEngine, bucket_bytes: int = 256) -> DistributedWeightPush:
    push = DistributedWeightPush(bucket_bytes=bucket_bytes)
    push.connect(0, engine.spec.url, 1, DistributedGroupSpec("127.0.0.1", free_port(), f"g{free_port()}", "gloo"))
    return push


def test_a_request_that_arrives_between_two_buckets_runs_whole_on_the_new_weights(engine):
    """SGLang takes its writer lock per update call: between two buckets a request would run on a mix of old and
    new weights, labelled with the new version. The push holds the server's generation from its first bucket to its
    flush, so the request waits, then runs on the new weights alone, and says so."""
    push = _connected_push(engine)
    client = push.servers[0][0]
    announce, fired = client.update_weights_from_distributed, []
    prompt, new = (3, 4), weights(4.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        def after_the_first_bucket(**bucket):
            answer = announce(**bucket)
            if not fired:  # bucket 1 is in the model: a request now, before bucket 2
                fired.append(pool.submit(engine.generate, [GenerationRequest(prompt, SamplingSpec(max_new_tokens=4))]))
                time.sleep(0.5)  # it reaches the server
            return answer

        client.update_weights_from_distributed = after_the_first_bucket
        assert push.push(iter(new), "v4") == []
        (result,) = fired[0].result(timeout=60)
    assert len({name for name, _ in new}) > 1 and model_state(engine)["version"] == "v4"
    assert list(result.output_token_ids) == tokens(prompt, 4, checksum(new)) and result.weight_version == "v4"
    engine.update_weights(iter(weights()), "v1")


def test_the_push_flushes_the_cache_the_old_weights_made_before_any_request_runs(engine):
    """SGLang refuses /flush_cache while a request runs or waits: a request that came after the last bucket would
    keep the flush from happening, and prefixes computed by the old weights would stay in the cache for the new. Held
    until the push ends, it waits for the flush, which runs every time."""
    push = _connected_push(engine)
    client = push.servers[0][0]
    end, fired = client.end_weight_update, []
    prompt, new = (5, 6), weights(5.0)
    flushes = model_state(engine)["flushes"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        def then_a_request():
            end()
            fired.append(pool.submit(engine.generate, [GenerationRequest(prompt, SamplingSpec(max_new_tokens=40))]))
            time.sleep(0.5)  # it reaches the server before the flush

        client.end_weight_update = then_a_request
        assert push.push(iter(new), "v5") == []
        (result,) = fired[0].result(timeout=60)
    assert model_state(engine)["flushes"] == flushes + 1
    assert list(result.output_token_ids) == tokens(prompt, 40, checksum(new)) and result.weight_version == "v5"
    engine.update_weights(iter(weights()), "v1")


def test_a_push_refused_half_way_ends_its_session_and_the_next_push_succeeds(engine):
    """A bucket SGLang refuses (an FP8 tensor over gloo, which cannot carry float8: SGLang allocates one to receive
    into) leaves the server out of the push; the session is ended all the same, so after a new group the next push
    goes through."""
    push = _connected_push(engine, bucket_bytes=1 << 20)
    refused = [*weights(6.0), ("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn))]
    assert push.push(iter(refused), "v6") == [0]
    push.connect(0, engine.spec.url, 1, DistributedGroupSpec("127.0.0.1", free_port(), "after_refusal", "gloo"))
    assert push.push(iter(weights(7.0)), "v7") == []
    state = model_state(engine)
    assert state["version"] == "v7" and {n: d for n, d in state["weights"].items() if n in dict(weights())} == {
        name: digest(tensor) for name, tensor in weights(7.0)}
    engine.update_weights(iter(weights()), "v1")


def test_samples_waiting_in_sglangs_queue_at_a_pause_are_sent_again_with_their_experts(engine):
    """Routing replay with partial rollout: SGLang answers a request aborted in its waiting queue with no tokens and
    none of a started request's fields (routed experts, prompt tokens). It never started: the engine sends it again
    after the push, and every sample comes back whole, every token with its experts."""
    prompts = [(7, i) for i in range(4)]  # two run at once (RLM_SGLANG_CPU_MAX_RUNNING), two wait
    start = SGLangClient(engine.spec.url)._call("GET", "/standin/progress")["tokens"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(engine.generate, [GenerationRequest(p, SamplingSpec(max_new_tokens=12),
                                                                  return_routed_experts=True) for p in prompts])
        wait_for_generation(engine, start + 3)
        engine.pause_generation()
        engine.update_weights(iter(weights(8.0)), "v8")
        engine.continue_generation()
        results = pending.result(timeout=60)
    for prompt, result in zip(prompts, results):
        assert len(result.output_token_ids) == 12
        assert result.routed_experts.shape[0] == len(prompt) + 12 - 1
    # Those that only waited ran whole on the new weights.
    assert any(set(result.token_weight_versions or [result.weight_version]) == {"v8"} for result in results)
    engine.update_weights(iter(weights()), "v1")


def test_a_paused_server_that_a_health_check_marked_unhealthy_is_not_restarted(engine):
    """A router's /health waits while the server is paused; past SGLang's timeout it marks the server unhealthy and
    /ping answers 503 until a /health succeeds again. The engine asks the scheduler itself (/server_info) and keeps
    the server, paused and after."""
    client = SGLangClient(engine.spec.url)
    restarts = engine.restarts
    with ThreadPoolExecutor(max_workers=1) as pool:
        engine.pause_generation()
        probe = pool.submit(client.health, HEALTH_CHECK_TIMEOUT_S + 10)  # the router's health check
        time.sleep(HEALTH_CHECK_TIMEOUT_S + 1.5)
        assert not client.alive(timeout_s=2)  # SGLang's /ping: 503 now
        assert engine.health()
        engine.continue_generation()
        assert not probe.result(timeout=30)
        assert engine.health()
    assert engine.generate([GenerationRequest((9,), SamplingSpec(max_new_tokens=2))])[0].weight_version == "v1"
    assert engine.restarts == restarts
    assert client.health(timeout_s=30) and client.alive()  # the router's next /health: healthy again, /ping too


def wait_for_generation(engine: SGLangEngine, count: int) -> None:
    deadline = time.monotonic() + 60
    while SGLangClient(engine.spec.url)._call("GET", "/standin/progress")["tokens"] < count:
        assert time.monotonic() < deadline, "the server generated nothing in 60 s"
        time.sleep(0.02)


def test_pause_keeps_the_server_alive_and_partial_rollout_goes_on_with_the_new_weights(engine):
    """While paused SGLang's /health waits (it generates a token): the engine's liveness probe must still say alive,
    or every paused server would be left out of the push."""
    prompt, length = (1, 2), 30
    start = SGLangClient(engine.spec.url)._call("GET", "/standin/progress")["tokens"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(engine.generate, [GenerationRequest(prompt, SamplingSpec(max_new_tokens=length))])
        wait_for_generation(engine, start + 3)
        engine.pause_generation()
        probed = time.monotonic()
        assert engine.health()
        assert time.monotonic() - probed < 2
        engine.update_weights(iter(weights(3.0)), version="v3")
        engine.continue_generation()
        (result,) = pending.result(timeout=120)
    versions = result.token_weight_versions
    before = versions.count("v1")
    assert 0 < before < length and versions == ("v1",) * before + ("v3",) * (length - before)
    head = tokens(prompt, before, checksum(weights()))
    assert list(result.output_token_ids) == head + tokens((*prompt, *head), length - before, checksum(weights(3.0)))
    engine.update_weights(iter(weights()), "v1")


def adapter(tmp_path: Path, name: str, seed: int) -> str:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    path = tmp_path / name
    path.mkdir()
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.randn(4, 16, generator=generator),
               f"{prefix}.lora_B.weight": torch.randn(16, 4, generator=generator)},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return str(path)


def test_an_adapter_loads_while_requests_run_though_sglang_refuses_the_flush(engine, tmp_path):
    """Loading an adapter takes no model-update lock, so generation runs on: SGLang refuses /flush_cache (400) while
    any request runs. That is no failure: the adapter is in, the next one replaces it, samples name it."""
    request = [GenerationRequest((1, 2, 3), SamplingSpec(max_new_tokens=20))]
    start = SGLangClient(engine.spec.url)._call("GET", "/standin/progress")["tokens"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(engine.generate, request)
        wait_for_generation(engine, start + 2)
        assert not engine.client.flush_cache()  # SGLang's answer while a request runs
        engine.load_adapter("step_1", adapter(tmp_path, "step_1", 1), "step_1")
        running.result(timeout=60)
    assert engine.generate(request)[0].weight_version == "step_1"
    engine.load_adapter("step_2", adapter(tmp_path, "step_2", 2), "step_2")
    assert sorted(model_state(engine)["adapters"]) == ["step_2"]
    assert engine.generate(request)[0].weight_version == "step_2"
    engine.lora_adapters, engine.adapter = False, None  # the other tests sample with the base weights


def protocol_answers(url: str, progress: str) -> list[tuple[str, str]]:
    """What a server answers to the calls where SGLang 0.5.23 is strict, in order (the last one ends the server):
    a weight update outside and inside a session, /flush_cache while a request runs, /health and /ping while
    generation is paused, and the resume of a memory tag it never released. `progress`: the server's route that
    counts the tokens it generated."""
    from rlmegatron.rollout.buckets import Bucketer
    from rlmegatron.rollout.sglang.client import ServerUnavailable, SGLangRequestError, sampling_params
    from rlmegatron.rollout.sglang.protocol import serialize_flattened_bucket

    client = SGLangClient(url, timeout_s=30)
    client.check_version()
    bucket = next(Bucketer(1 << 20, (), shared_memory=True).buckets(iter(weights())))
    payload = [serialize_flattened_bucket(bucket)]
    answers = []

    def attempt(name: str, call) -> None:
        try:
            call()
            answers.append((name, "ok"))
        except SGLangRequestError as error:
            answers.append((name, "refused: " + str(error).split("HTTP ", 1)[1][:3]))
        except ServerUnavailable:
            answers.append((name, "unavailable"))

    attempt("update outside a session", lambda: client.update_weights_from_tensor(payload, "v1"))
    attempt("begin a session", client.begin_weight_update)
    attempt("update inside it", lambda: client.update_weights_from_tensor(payload, "v1"))
    attempt("end it", client.end_weight_update)
    with ThreadPoolExecutor(max_workers=1) as pool:
        start = client._call("GET", progress)["tokens"]
        running = pool.submit(client.generate, [1, 2], sampling_params(SamplingSpec(max_new_tokens=40)))
        deadline = time.monotonic() + 60
        while client._call("GET", progress)["tokens"] < start + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        answers.append(("flush while a request runs", "ok" if client.flush_cache() else "refused"))
        client.pause_generation()
        answers.append(("health while paused", "answers" if client.health(timeout_s=2) else "waits"))
        answers.append(("ping while paused", "answers" if client.alive(timeout_s=2) else "waits"))
        client.continue_generation()
        running.result(timeout=60)
    # The paused /health left a one-token generation queued, and SGLang asserts an idle scheduler before it
    # releases memory (it dies otherwise): a health check of our own returns once that one is done too.
    answers.append(("health after continuing", "answers" if client.health(timeout_s=30) else "waits"))
    answers += _strict_about_pushes(client, progress, payload)
    attempt("release kv_cache", lambda: client.release_memory_occupation(["kv_cache"]))
    attempt("resume weights, never released", lambda: client.resume_memory_occupation(["weights"]))
    deadline = time.monotonic() + 10
    while client.alive(timeout_s=1) and time.monotonic() < deadline:
        time.sleep(0.1)
    answers.append(("alive after that", str(client.alive(timeout_s=1))))
    return answers


def _strict_about_pushes(client: SGLangClient, progress: str, payload) -> list[tuple[str, str]]:
    """Where a push meets generation (issue 42): an update outside a pause waits for the requests in flight (the
    model-update lock), a flush with a timeout waits for them too, a request aborted in the waiting queue comes back
    bare, and a /health that timed out while paused makes /ping say 503 until one succeeds. Both servers run 2
    requests at once."""
    from rlmegatron.rollout.sglang.client import sampling_params

    answers = []

    def tokens_now() -> int:
        return client._call("GET", progress)["tokens"]

    def request(length: int = 40):
        return client.generate([1, 2], sampling_params(SamplingSpec(max_new_tokens=length)))

    with ThreadPoolExecutor(max_workers=4) as pool:
        start = tokens_now()
        running = pool.submit(request)
        while tokens_now() < start + 2:
            time.sleep(0.02)
        client.begin_weight_update()
        client.update_weights_from_tensor(payload, "v1")
        # The server's own count says whether the request had generated all its tokens when the update returned.
        answers.append(("update outside a pause, a request running",
                        "after it" if tokens_now() == start + 40 else "beside it"))
        client.end_weight_update()
        running.result(timeout=30)
        start = tokens_now()
        running = pool.submit(request)
        while tokens_now() < start + 2:
            time.sleep(0.02)
        flushed = client.flush_cache(timeout_s=30)
        answers.append(("flush with a timeout, a request running", f"{flushed}, after it: {tokens_now() == start + 40}"))
        running.result(timeout=30)
        start = tokens_now()
        queued = [pool.submit(request) for _ in range(3)]  # two run, one waits
        while tokens_now() < start + 2:
            time.sleep(0.02)
        client.pause_generation()
        waited = [future.result(timeout=30) for future in queued if not future.result(timeout=30)["output_ids"]]
        answers.append(("aborted in the waiting queue", "bare" if len(waited) == 1 and not {
            "routed_experts", "prompt_tokens"} & set(waited[0]["meta_info"]) else f"{waited}"))
        probe = pool.submit(client.health, HEALTH_CHECK_TIMEOUT_S + 10)  # a router's, while paused
        time.sleep(HEALTH_CHECK_TIMEOUT_S + 1.5)
        answers.append(("ping after a paused health check timed out", "answers" if client.alive() else "503"))
        client.continue_generation()
        probe.result(timeout=30)
        client.health(timeout_s=30)
        answers.append(("ping after a health check succeeded", "answers" if client.alive() else "503"))
    return answers


def test_the_fake_server_answers_as_sglang_0_5_23_where_it_is_strict(engine, tmp_path, monkeypatch):
    """The same calls against SGLang's own code and against tests/rollout/fake_sglang, which the rest of the suite
    uses because it starts in a second: the same answers, so the fake is no more lenient. Ends the real server,
    which the next test restarts."""
    from tests.rollout.test_sglang import make_engine

    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(HEALTH_CHECK_TIMEOUT_S))  # as the real server has it
    fake = make_engine(tmp_path, **{"fake-token-delay": TOKEN_DELAY_S, "fake-max-running": 2})
    try:
        expected = protocol_answers(fake.spec.url, "/fake/progress")
    finally:
        fake.shutdown()
    assert expected == [
        ("update outside a session", "refused: 400"), ("begin a session", "ok"), ("update inside it", "ok"),
        ("end it", "ok"), ("flush while a request runs", "refused"), ("health while paused", "waits"),
        ("ping while paused", "answers"), ("health after continuing", "answers"),
        ("update outside a pause, a request running", "after it"),
        ("flush with a timeout, a request running", "True, after it: True"),
        ("aborted in the waiting queue", "bare"), ("ping after a paused health check timed out", "503"),
        ("ping after a health check succeeded", "answers"), ("release kv_cache", "ok"), ("resume weights, never released", "unavailable"), ("alive after that", "False")]
    assert protocol_answers(engine.spec.url, "/standin/progress") == expected


UNPICKLING_ALLOWLIST = """
import json
import gpu_stubs
gpu_stubs.install()
from sglang.srt.utils.common import SafeUnpickler
print(json.dumps(sorted(SafeUnpickler.ALLOWED_GLOBALS)))
"""


def test_the_fake_unpickles_a_bucket_with_no_more_than_sglang_allows():
    """SGLang 0.5.23 unpickles a weight bucket through its SafeUnpickler's allowlist (a global outside it ends the
    scheduler, and so the server); the stand-in's list is a part of SGLang's own, and it ends too on one outside."""
    import importlib.util
    import subprocess

    allowed = subprocess.run([sys.executable, "-c", UNPICKLING_ALLOWLIST], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(HERE / "sglang_cpu"), str(REPO_ROOT)])})
    sglang_allows = {tuple(pair) for pair in json.loads(allowed.stdout.splitlines()[-1])}
    spec = importlib.util.spec_from_file_location("safe_unpickling", HERE / "fake_sglang" / "safe_unpickling.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    assert fake.ALLOWED_GLOBALS <= sglang_allows, fake.ALLOWED_GLOBALS - sglang_allows
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed"):
        fake.SafeUnpickler(__import__("io").BytesIO(pickle.dumps({"metadata": [os.system]}))).load()


def test_a_dead_server_restarts_stale_and_serves_the_weights_the_caller_pushes_then(engine):
    """Router-free restart as EngineFleet drives it: the server is down (the test before ended it); the next
    generation restarts it and is refused (the new server holds no trained weights); the caller relaunches and
    pushes, and the sample comes from the pushed weights."""
    engine.process.stop()
    request = GenerationRequest((4, 5), SamplingSpec(max_new_tokens=3))
    with pytest.raises(EngineRestarted):
        engine.generate([request])
    assert engine.restarts == 1 and engine.stale and engine.released == set()
    engine.relaunch()
    engine.update_weights(iter(weights()), "v1")
    (result,) = engine.generate([request])
    assert result.output_token_ids == tuple(tokens((4, 5), 3, checksum(weights())))
    assert model_state(engine)["weights"] == {name: digest(tensor) for name, tensor in weights()}


def test_every_launch_flag_the_project_emits_parses_with_sglangs_own_server_args():
    """server_command for every option the spec reaches (TP/EP, dp-attention, memory saver, tokenizer, remote code,
    dtype, device, load format, several nodes, LoRA, deterministic inference) and the flags verl_keys recommends,
    through SGLang 0.5.23's argparse, which exits 2 on an unknown or ambiguous flag."""
    from rlmegatron.config.spec import RolloutConfig
    from rlmegatron.driver.role_settings import server_spec
    from rlmegatron.rollout.sglang.server import installed_sglang, server_command

    rollout = RolloutConfig(tensor_parallel_size=4, expert_parallel_size=2, enable_dp_attention=True,
                            mem_fraction_static=0.6, sglang={"load_format": "dummy", "extra_args": {
                                # what verl_keys maps verl's rollout options to
                                "disable-cuda-graph": True, "disable-radix-cache": True, "chunked-prefill-size": -1,
                                "max-running-requests": 64, "max-prefill-tokens": 8192,
                                "cuda-graph-bs-decode": [1, 2, 4], "enable-deterministic-inference": True}})
    spec = server_spec(rollout, str(MODEL), port=30000, lora_rank=8, trust_remote_code=True, dtype="bfloat16",
                       device="cpu", nnodes=2, dist_init_addr="10.0.0.1:5000")
    plain = server_spec(RolloutConfig(sglang={"enable_memory_saver": False, "skip_tokenizer_init": False}),
                        str(MODEL), port=30000)
    # verl's engine_kwargs.sglang.cuda_graph_bs, passed through: a prefix of two 0.5.23 flags, which argparse refuses.
    verl = dataclasses.replace(spec, extra_args={**spec.extra_args, "cuda-graph-bs": [1, 2, 4]})
    installed = installed_sglang(sys.executable)
    assert installed == "0.5.23"
    commands = [server_command(dataclasses.replace(spec, sglang_version=installed).for_node(1))[3:],
                server_command(dataclasses.replace(verl, sglang_version=installed))[3:],
                server_command(plain)[3:]]
    # As spelled for an older SGLang, verl's pass-through is what 0.5.23 refuses.
    refused = server_command(dataclasses.replace(verl, sglang_version="0.5.20"))[3:]
    results, stderr = parse_with_sglang([*commands, refused])
    assert results == [[command, "ok"] for command in commands] + [[refused, "exit 2"]], stderr[-2000:]
    assert "ambiguous option: --cuda-graph-bs could match --cuda-graph-bs-decode" in stderr
    stderr = stderr.split("ambiguous option")[0]  # what the three spelled for 0.5.23 made SGLang say
    # Spelled as 0.5.23 spells them: none of its deprecated flags, and SGLang says nothing of deprecation.
    assert "Deprecated" not in stderr and "deprecated" not in stderr, stderr[-2000:]
    assert "--attn-dp-size" in commands[0] and "--enable-dp-attention" not in commands[0]
    assert "--disable-cuda-graph" not in commands[0] and "--cuda-graph-backend-decode" in commands[0]
    assert "--cuda-graph-bs-decode" in commands[1] and "--cuda-graph-bs" not in commands[1]
    # An older SGLang (or one not known) keeps the spellings it had.
    older = server_command(dataclasses.replace(verl, sglang_version="0.5.20"))
    assert "--enable-dp-attention" in older and "--cuda-graph-bs" in older and "--disable-cuda-graph" in older
    assert "--cuda-graph-bs-decode" in commands[0] and "--enable-lora" in commands[0] and "--nnodes" in commands[0]


def test_a_loader_the_server_was_not_launched_with_is_refused_by_sglang(engine):
    """The same records named with a load_format outside --custom-weight-loader: SGLang's weight updater raises
    (NotImplementedError) and its scheduler ends, and the server with it. Last of the tests on this server."""
    from rlmegatron.rollout.sglang.protocol import serialize_records

    client = SGLangClient(engine.spec.url)
    client.check_version()
    client.begin_weight_update()
    with pytest.raises((SGLangRequestError, ServerUnavailable)):
        client.update_weights_from_tensor([serialize_records([("w", torch.zeros(2))])], "x",
                                          load_format="rlmegatron.rollout.delta.not_a_loader")
    deadline = time.monotonic() + 30
    while engine.process.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engine.process.alive


FP8_RECORDS = """
import gpu_stubs
gpu_stubs.install()
import torch
from sglang.srt.utils.common import MultiprocessingSerializer
from rlmegatron.rollout.delta import DeltaReceiver, DeltaSender, bits
from rlmegatron.rollout.sglang.protocol import serialize_records

torch.manual_seed(0)
weight = torch.randn(64, 64).to(torch.float8_e4m3fn)
scale = torch.rand(1, 1)
sender, receiver = DeltaSender(), DeltaReceiver()
for step in range(3):
    if step:
        weight = weight.clone()
        weight.view(torch.uint8)[step, :5] ^= 1
    records, _ = sender.records([("o.weight", weight), ("o.weight_scale_inv", scale)], full=step == 0)
    receiver.apply(MultiprocessingSerializer.deserialize(serialize_records(records)))
    assert torch.equal(bits(receiver.held["o.weight"]), bits(weight)) and receiver.held["o.weight"].dtype == weight.dtype
print("exact")
"""


def test_fp8_records_pass_sglangs_unpickler_and_rebuild_bit_for_bit():
    """SGLang's safe unpickler cannot rebuild an FP8 storage sent by value (torch's weights-only load): delta records
    of FP8 tensors travel as their bytes, named with their dtype, and come back FP8, whole and deltas alike."""
    import subprocess

    run = subprocess.run([sys.executable, "-c", FP8_RECORDS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "sglang_cpu"), str(REPO_ROOT)])})
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "exact", run.stderr[-2000:]
