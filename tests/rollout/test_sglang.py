"""SGLangEngine against a fake SGLang server on loopback: schemas, bucket round trips, call order, restarts."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rlmegatron.config.spec import RolloutConfig
from rlmegatron.driver.role_settings import server_spec
from rlmegatron.rollout.buckets import travel_rules_for
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from rlmegatron.rollout.sglang.client import (RouterClient, SGLangClient, SGLangRequestError, ServerUnavailable,
                                              parse_generate_response, sampling_params)
from rlmegatron.rollout.sglang.engine import EngineRestarted, SGLangEngine
from rlmegatron.rollout.sglang.protocol import DistributedGroupSpec
from rlmegatron.rollout.sglang.weight_push import DistributedWeightPush
from rlmegatron.rollout.sglang.server import (
    ServerProcess,
    ServerSpec,
    ServerStartupError,
    router_command,
    server_command,
)
from rlmegatron.runtime.distributed import free_port

FAKE_SGLANG = Path(__file__).parent / "fake_sglang"
REPO_ROOT = Path(__file__).parents[2]

LOAD_S = 0.2  # a stand-in server's load of a bucket, where a test needs it to last
# DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa, which SGLang fuses while loading, travel in one bucket.
DEEPSEEK_TRAVEL_RULES = travel_rules_for({"model_type": "deepseek_v3", "q_lora_rank": 32})


@pytest.fixture(autouse=True, scope="module")
def _buckets_by_named_shared_memory(file_system_sharing):
    """tests/rollout/conftest.py's file_system_sharing for every test of the module."""


def weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=generator).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_a_proj.weight", torch.randn(8, 16, generator=generator)),
        ("model.layers.0.mlp.gate_proj.weight", torch.randn(32, 16, generator=generator)),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", torch.randn(12, 16, generator=generator)),
        ("model.layers.0.input_layernorm.weight", torch.randn(16, generator=generator).half()),
        ("model.norm.step", torch.tensor(7, dtype=torch.int64)),
    ]


def digest(tensor: torch.Tensor) -> list:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
            hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]


def make_engine(tmp_path: Path, router_url=None, partial_rollout=False, **fake_flags) -> SGLangEngine:
    spec = ServerSpec(
        model_path="fake/model", port=free_port(), python=sys.executable, load_format="dummy",
        extra_args={"fake-record": str(tmp_path / "calls.jsonl"), "fake-marker": str(tmp_path / "died"),
                    **fake_flags},
        env={"PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)])},
    )
    return SGLangEngine(spec, str(tmp_path), bucket_bytes=1024, travel_rules=DEEPSEEK_TRAVEL_RULES,
                        router_url=router_url, startup_timeout_s=30, request_timeout_s=30,
                        max_concurrency=8, partial_rollout=partial_rollout)


def calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def server_weights(engine: SGLangEngine) -> dict:
    return SGLangClient(engine.spec.url)._call("GET", "/fake/weights")


def test_launch_commands_follow_the_config():
    rollout = RolloutConfig(tensor_parallel_size=4, expert_parallel_size=2, enable_dp_attention=True,
                            mem_fraction_static=0.6, sglang={"python": "/venv/bin/python", "load_format": "dummy",
                                                             "extra_args": {"chunked-prefill-size": 4096,
                                                                            "disable-radix-cache": True}})
    spec = server_spec(rollout, "/ckpt/hf", port=30000, nnodes=2, dist_init_addr="10.0.0.1:5000")
    command = server_command(spec.for_node(1))
    assert command[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    text = " ".join(command)
    for flag in ["--model-path /ckpt/hf", "--tp-size 4", "--ep-size 2", "--enable-dp-attention --dp-size 4",
                 "--mem-fraction-static 0.6", "--enable-memory-saver", "--load-format dummy", "--skip-tokenizer-init",
                 "--port 30000", "--host 127.0.0.1", "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000",
                 "--chunked-prefill-size 4096", "--disable-radix-cache"]:
        assert flag in text, flag
    assert router_command("py", ["http://a:1", "http://b:2"], port=8000)[:6] == [
        "py", "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2"]


def test_launch_commands_leave_out_what_the_config_turns_off():
    rollout = RolloutConfig(sglang={"enable_memory_saver": False, "skip_tokenizer_init": False})
    command = server_command(server_spec(rollout, "/ckpt/hf", port=30000))
    assert "--enable-memory-saver" not in command and "--skip-tokenizer-init" not in command
    assert "--load-format" in command  # the flags around them are there


def test_generate_schema_results_and_finish_reasons(tmp_path):
    engine = make_engine(tmp_path)
    try:
        stop_token = (1 + 2 + 3 + 31 * 2) % 1000  # the fake's third token for prompt (1, 2, 3)
        results = engine.generate([
            GenerationRequest((1, 2, 3), SamplingSpec(n=2, max_new_tokens=5, stop_token_ids=(stop_token,))),
            GenerationRequest((4, 5), SamplingSpec(max_new_tokens=4, temperature=0.0, seed=1)),
        ])
        assert [(r.request_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (1, 0)]
        assert results[0].finish_reason == "stop" and results[0].output_token_ids == (6, 37, stop_token)
        assert results[0].output_token_logprobs == pytest.approx((-0.01, -0.02, -0.03))
        assert results[2].finish_reason == "length" and len(results[2].output_token_ids) == 4
        assert results[2].weight_version == "default"
        assert engine.health() and engine.client.health_generate()
    finally:
        engine.shutdown()
    assert not engine.health()


@pytest.mark.parametrize("logprob, shown", [(float("nan"), "nan"), (None, "nan"), (float("-inf"), "-inf")],
                         ids=["nan", "null", "minus-inf"])
def test_a_non_finite_log_prob_from_the_server_stops_generation_naming_the_rollout_logits(logprob, shown):
    """A server that samples from NaN or inf logits says so only through the log-probs (null where its JSON
    encoder has no NaN)."""
    from rlmegatron.errors import Divergence

    answer = {"output_ids": [5, 6, 7], "meta_info": {"finish_reason": {"type": "length"},
                                                     "output_token_logprobs": [[-0.5, 5, None], [logprob, 6, None],
                                                                               [-0.25, 7, None]]}}
    with pytest.raises(Divergence) as raised:
        parse_generate_response(answer, request_index=3, sample_index=1)
    assert str(raised.value) == (f"rollout logits: the server's log-prob of response token 2 of sample 3/1 is {shown}; "
                                 "the rollout model's weights are not usable")
    answer["meta_info"]["output_token_logprobs"][1][0] = -1.0
    assert parse_generate_response(answer, 3, 1).output_token_logprobs == (-0.5, -1.0, -0.25)


def test_the_remax_greedy_pass_asks_the_server_for_greedy_samples():
    """SGLang samples greedily (top_k becomes 1) exactly when 0 <= temperature < 1e-6 (its SamplingParams
    __post_init__): the trainer's greedy pass reaches the server at temperature 0, without a default replacing
    the 0, one sample per prompt, with the samples' token budget and stop tokens."""
    from rlmegatron.driver.rollout_data import sampling_spec
    from rlmegatron.driver.trainer import GREEDY

    params = sampling_params(sampling_spec(GREEDY, max_new_tokens=3, stop_token_ids=(7,), seed=5))
    assert 0 <= params["temperature"] < 1e-6
    assert (params["n"], params["max_new_tokens"], params["stop_token_ids"]) == (1, 3, [7])


def test_colocated_sync_round_trips_buckets_in_order(tmp_path):
    engine = make_engine(tmp_path)
    try:
        engine.release_memory()
        engine.wake_up_with_weights(iter(weights()), version="v1")
        pushed = server_weights(engine)
        assert pushed["version"] == "v1"
        assert pushed["weights"] == {name: digest(tensor) for name, tensor in weights()}
        log = calls(tmp_path)
        order = [(c["path"], c.get("tags")) for c in log]
        updates = [c for c in log if c["path"] == "/update_weights_from_tensor"]
        assert order[:2] == [("/release_memory_occupation", ["weights", "kv_cache", "cuda_graph"]),
                             ("/resume_memory_occupation", ["weights"])]
        assert order[2:4 + len(updates)] == [("/begin_weight_update", None), *[("/update_weights_from_tensor", None)]
                                             * len(updates), ("/end_weight_update", None)]
        assert order[4 + len(updates):] == [("/flush_cache", None),
                                            ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]
        assert len(updates) > 1, "1 KiB buckets should split these weights"
        assert all(c["modules"] == ["sglang.srt.weight_sync.tensor_bucket"] for c in updates)
        together = [c["names"] for c in updates if "model.layers.0.self_attn.q_a_proj.weight" in c["names"]]
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in together[0]
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC handles need a GPU")
def test_cuda_buckets_reach_the_server_through_ipc_handles_naming_the_device_by_uuid(tmp_path):
    engine = make_engine(tmp_path)
    try:
        device = torch.cuda.device_count() - 1
        engine.update_weights(((name, tensor.to(f"cuda:{device}")) for name, tensor in weights()), version="v2")
        assert server_weights(engine)["weights"] == {name: digest(tensor) for name, tensor in weights()}
    finally:
        engine.shutdown()


def test_paused_generation_holds_requests_until_continued(tmp_path):
    engine = make_engine(tmp_path)
    try:
        engine.pause_generation()
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(engine.generate, [GenerationRequest((1, 2), SamplingSpec(max_new_tokens=2))])
            time.sleep(0.5)
            assert not pending.done()
            engine.continue_generation()
            assert len(pending.result(timeout=30)) == 1
    finally:
        engine.shutdown()
    assert [c["path"] for c in calls(tmp_path)] == ["/pause_generation", "/continue_generation", "/generate"]


def wait_for_tokens(engine: SGLangEngine, count: int) -> None:
    """Until the server has generated `count` tokens (it takes --fake-token-delay seconds per token)."""
    deadline = time.monotonic() + 30
    while SGLangClient(engine.spec.url)._call("GET", "/fake/progress")["tokens"] < count:
        assert time.monotonic() < deadline, "the server generated nothing in 30 s"
        time.sleep(0.01)


def fake_tokens(input_ids, count: int, checksum: int) -> list[int]:
    """What the fake server generates (no seed): token s is (sum(input) + 31 s + checksum) mod its vocabulary."""
    return [(sum(input_ids) + 31 * step + checksum) % 1000 for step in range(count)]


def fake_checksum(named: list[tuple[str, torch.Tensor]]) -> int:
    return int(sum(float(tensor.double().sum()) for _, tensor in named) * 1000) % 997


def test_partial_rollout_goes_on_from_the_paused_tokens_with_the_new_weights(tmp_path):
    old = weights()
    new = [(name, tensor * 2) for name, tensor in old]
    engine = make_engine(tmp_path, partial_rollout=True, **{"fake-token-delay": 0.05})
    try:
        engine.update_weights(iter(old), version="v1")
        prompt, length = (1, 2, 3), 30
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(engine.generate, [GenerationRequest(prompt, SamplingSpec(max_new_tokens=length))])
            wait_for_tokens(engine, 3)
            engine.pause_generation()
            engine.update_weights(iter(new), version="v2")
            engine.continue_generation()
            (result,) = pending.result(timeout=30)
    finally:
        engine.shutdown()
    versions = result.token_weight_versions
    before = versions.count("v1")
    assert 0 < before < length and versions == ("v1",) * before + ("v2",) * (length - before)
    assert result.oldest_weight_version == "v1" and result.weight_version == "v2"
    head = fake_tokens(prompt, before, fake_checksum(old))
    assert list(result.output_token_ids) == head + fake_tokens((*prompt, *head), length - before, fake_checksum(new))
    # Every token keeps the log-prob the server reported for it (the fake's -0.01 x position in its request).
    expected = [-0.01 * (i + 1) for i in range(before)] + [-0.01 * (i + 1) for i in range(length - before)]
    assert result.output_token_logprobs == pytest.approx(expected)
    assert result.finish_reason == "length"
    generates = [c for c in calls(tmp_path) if c["path"] == "/generate"]
    assert [c["input_ids"] for c in generates] == [list(prompt), [*prompt, *head]]


def test_without_partial_rollout_a_push_waits_for_the_samples_in_flight_and_holds_new_ones(tmp_path):
    """The engine's samples in flight when a push begins finish whole on the old weights; one asked for during the
    push starts only once it ended, whole on the new weights."""
    engine = make_engine(tmp_path, **{"fake-token-delay": 0.05})
    request = [GenerationRequest((1, 2), SamplingSpec(max_new_tokens=30))]
    try:
        engine.update_weights(iter(weights()), "v1")
        with ThreadPoolExecutor(max_workers=2) as pool:
            in_flight = pool.submit(engine.generate, request)
            wait_for_tokens(engine, 3)
            engine.pause_generation()  # returns once the sample in flight is done
            # Its answer came (the generation thread may still be assembling it): a sample the pause held instead
            # would wait for continue_generation, past this timeout.
            in_flight.result(timeout=5)
            tokens = SGLangClient(engine.spec.url)._call("GET", "/fake/progress")["tokens"]
            during = pool.submit(engine.generate, request)
            time.sleep(0.5)
            assert not during.done() and SGLangClient(engine.spec.url)._call("GET", "/fake/progress")["tokens"] == \
                tokens
            engine.update_weights(iter([(name, tensor * 2) for name, tensor in weights()]), "v2")
            engine.continue_generation()
            (after,) = during.result(timeout=30)
        (before,) = in_flight.result()
    finally:
        engine.shutdown()
    assert (before.finish_reason, len(before.output_token_ids), before.weight_version) == ("length", 30, "v1")
    assert (after.finish_reason, len(after.output_token_ids), after.weight_version) == ("length", 30, "v2")
    assert before.token_weight_versions == after.token_weight_versions == ()


def test_a_dead_server_is_restarted_and_stale_until_the_caller_pushes_then_serves_every_sample(tmp_path):
    """The engine restarts a server that died, but the weights live in the trainer: it refuses to generate
    (`EngineRestarted`) until the caller has relaunched and pushed, as EngineFleet does, then serves every sample."""
    engine = make_engine(tmp_path, **{"fake-die-after-generates": 5})
    try:
        engine.update_weights(iter(weights()), "v7")
        requests = [GenerationRequest((i, i + 1), SamplingSpec(n=2, max_new_tokens=3)) for i in range(12)]
        with pytest.raises(EngineRestarted):
            engine.generate(requests)
        assert engine.restarts == 1 and engine.stale
        engine.relaunch()
        engine.update_weights(iter(weights()), "v7")
        results = engine.generate(requests)
        assert [(r.request_index, r.sample_index) for r in results] == [(i, s) for i in range(12) for s in range(2)]
        assert all(r.weight_version == "v7" and len(r.output_token_ids) == 3 for r in results)
        assert engine.restarts == 1 and not engine.stale
        assert server_weights(engine)["weights"] == {name: digest(tensor) for name, tensor in weights()}
        assert len({c["pid"] for c in calls(tmp_path)}) == 2
    finally:
        engine.shutdown()


def test_a_sample_on_its_way_while_another_restarts_the_server_meets_the_old_one_never_the_unsynced_new_one(
        tmp_path):
    """The race a loaded machine plays: a sample passes the engine's checks and, before it reaches the port, another
    finds the server dead and restarts it. The restart waits for the first to land (on the stopped server, where it
    fails): the new server, which holds no trained weights, never sees it. Both samples then meet the stale engine."""
    import threading

    engine = make_engine(tmp_path)
    try:
        engine.update_weights(iter(weights()), "v7")
        request = GenerationRequest((1, 2), SamplingSpec(max_new_tokens=3))
        send = engine.generation_client.generate
        on_its_way, go = threading.Event(), threading.Event()

        def delayed(*args, **kwargs):
            engine.generation_client.generate = send
            on_its_way.set()
            go.wait(60)
            return send(*args, **kwargs)

        engine.generation_client.generate = delayed
        outcomes = {}

        def sample(index):
            try:
                engine.generate_one(0, index, request)
            except Exception as error:
                outcomes[index] = error

        first = threading.Thread(target=sample, args=(0,))
        first.start()
        assert on_its_way.wait(30)
        engine.process.stop()
        second = threading.Thread(target=sample, args=(1,))  # finds the server dead and restarts it
        second.start()
        # Let the restart go as far as it will while the first sample is still on its way: without the wait for it,
        # the new server comes up now, and the first sample reaches it.
        down_since, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:
            if engine.restarts and engine.process.alive and engine.health():
                break
            down_since = down_since or (time.monotonic() if engine.restarts and not engine.process.alive else None)
            if down_since and time.monotonic() - down_since > 1.0:
                break
            time.sleep(0.05)
        go.set()
        first.join(60)
        second.join(60)
        assert all(isinstance(outcomes.get(i), EngineRestarted) for i in (0, 1)), outcomes
        assert engine.restarts == 1 and engine.stale
        first_server = calls(tmp_path)[0]["pid"]
        assert [c for c in calls(tmp_path) if c["pid"] != first_server and c["path"] == "/generate"] == []
    finally:
        engine.shutdown()


def test_a_push_that_ends_after_the_server_restarted_leaves_the_new_server_stale(tmp_path):
    """one_step_off and async generate beside a push: the server may die and restart between the push's pause and
    its end. The push's end (`mark_synced`) is not the new server's: it holds no trained weights and stays out of
    generation until a push of its own."""
    engine = make_engine(tmp_path, **{"fake-die-after-generates": 1})
    try:
        engine.update_weights(iter(weights()), "v7")
        request = GenerationRequest((1, 2), SamplingSpec(max_new_tokens=3))
        engine.pause_generation()  # a push starts to the server that is up now
        engine.continue_generation()
        with pytest.raises(EngineRestarted):  # a sample beside it kills the server, which restarts
            engine.generate_one(0, 0, request)
        engine.mark_synced("v8")  # the push ends
        assert engine.restarts == 1 and engine.stale and engine.weight_version == "v7"
        with pytest.raises(EngineRestarted):
            engine.generate_one(0, 1, request)
        engine.relaunch()  # the caller's own push to the restarted server
        engine.mark_synced("v8")
        assert not engine.stale and engine.weight_version == "v8"
    finally:
        engine.shutdown()


def test_server_that_never_becomes_healthy_reports_its_log_tail(tmp_path):
    with pytest.raises(ServerStartupError, match="CUDA out of memory while capturing graphs"):
        make_engine(tmp_path, **{"fake-fail-start": "CUDA out of memory while capturing graphs"})


def test_distributed_update_broadcasts_in_announced_order(tmp_path):
    engine = make_engine(tmp_path)
    try:
        push = DistributedWeightPush(bucket_bytes=1024, travel_rules=DEEPSEEK_TRAVEL_RULES)
        group = DistributedGroupSpec("127.0.0.1", free_port(), group_name="sync_test", backend="gloo")
        push.connect(0, engine.spec.url, engine.spec.tp_size, group)
        push.push(iter(weights()), "v3")
        pushed = server_weights(engine)
        assert pushed["version"] == "v3"
        assert pushed["weights"] == {name: digest(tensor) for name, tensor in weights()}
        init = next(c for c in calls(tmp_path) if c["path"] == "/init_weights_update_group")
        assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    finally:
        engine.shutdown()


def test_a_server_that_dies_during_a_push_is_left_out_and_the_others_get_every_weight(tmp_path):
    """One of two servers (the first to get there) dies as its second bucket is announced: the push returns it as
    down (the driver leaves it to the generation that restarts it), and goes on, in time, to push every bucket to the
    other one."""
    engines = [make_engine(tmp_path, **{"fake-die-on-push": 2}) for _ in range(2)]  # only one may die: the marker
    try:
        push = DistributedWeightPush(bucket_bytes=1024, travel_rules=DEEPSEEK_TRAVEL_RULES)
        for key, engine in enumerate(engines):
            group = DistributedGroupSpec("127.0.0.1", free_port(), group_name=f"sync_{key}", backend="gloo")
            push.connect(key, engine.spec.url, engine.spec.tp_size, group)
        started = time.monotonic()
        (died,) = push.push(iter(weights()), "v3")
        assert time.monotonic() - started < 20
        survivor = 1 - died
        assert not engines[died].client.health()  # it did die
        pushed = server_weights(engines[survivor])
        assert pushed["version"] == "v3"
        assert pushed["weights"] == {name: digest(tensor) for name, tensor in weights()}
        assert push.push(iter(weights()), "v4", only=[survivor]) == []  # the survivor's group still serves
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_broadcast_that_fails_on_this_side_fails_the_push_only_once_the_other_servers_have_the_bucket(
        tmp_path, monkeypatch):
    """A failure no server's answer explains (here the broadcast to server 0 refuses to start) is raised, but only
    after every other server of the bucket has received and loaded it: none is left mid-bucket when the push's
    clean-up ends its session and lets it generate."""
    from rlmegatron.rollout.sglang import weight_push

    engines = [make_engine(tmp_path) for _ in range(2)]
    try:
        push = DistributedWeightPush(bucket_bytes=1 << 20, travel_rules=DEEPSEEK_TRAVEL_RULES)
        for key, engine in enumerate(engines):
            push.connect(key, engine.spec.url, engine.spec.tp_size,
                         DistributedGroupSpec("127.0.0.1", free_port(), group_name=f"refused_{key}", backend="gloo"))
        failing = push.servers[0][2]
        broadcast = torch.distributed.broadcast

        def refusing(tensor, group_src, group, async_op):
            if group is failing:
                raise RuntimeError("the broadcast to server 0 could not start")
            return broadcast(tensor, group_src=group_src, group=group, async_op=async_op)

        monkeypatch.setattr(weight_push.torch.distributed, "broadcast", refusing)
        with pytest.raises(RuntimeError, match="could not start"):
            push.push(iter(weights()), "v3")
        pushed = server_weights(engines[1])
        assert pushed["version"] == "v3"  # its whole bucket (one: 1 MiB holds them all), loaded
        assert pushed["weights"] == {name: digest(tensor) for name, tensor in weights()}
    finally:
        for engine in engines:
            engine.shutdown()


def test_an_answer_cut_off_mid_body_is_a_server_gone_not_a_crash():
    """http.client's IncompleteRead is not an OSError: without its mapping it escaped every `except ServerUnavailable`
    and failed the run where a server going away should be left out and restarted."""
    import http.server
    import threading

    class CutOff(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"ok": ')  # then the connection closes, 93 bytes short

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), CutOff)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        with pytest.raises(ServerUnavailable, match="/get_model_info"):
            SGLangClient(f"http://127.0.0.1:{server.server_port}")._call("GET", "/get_model_info")
    finally:
        server.server_close()


def start_spanning_server(directory: Path, load_s: float = 0.0) -> tuple[list[ServerProcess], str]:
    """A TP-2 stand-in server over two nodes (a process per node, one TP rank each), recording what each receives,
    taking `load_s` to load each bucket; started, not waited for (`SGLangClient(url).health`)."""
    directory.mkdir()
    spec = ServerSpec(model_path="fake/model", port=free_port(), python=sys.executable, load_format="dummy",
                      tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}",
                      extra_args={"fake-record": str(directory / "calls.jsonl"), "fake-load-s": load_s},
                      env={"PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)])})
    nodes = [ServerProcess(server_command(spec.for_node(rank)), directory / f"node{rank}.log", spec.env)
             for rank in (0, 1)]
    for node in nodes:
        node.start()
    return nodes, spec.url


def test_a_disaggregated_push_brings_each_tp_rank_the_whole_model_every_server_at_once_as_the_planner_prices(
        tmp_path):
    """planner/memory.weight_sync against what a push does: two TP-2 servers on 4 rollout GPUs, tiny-qwen3's weights
    in bf16, from one trainer node. Each of the 4 receivers gets every tensor whole (its digest is the full tensor's,
    not a TP share), so its bytes are the planner's bytes_per_receiver; and each bucket reaches both servers at once
    (the planner's 2 servers through one link, their loads overlapping), the next only once both have loaded it."""
    import transformers

    from rlmegatron.config import read_architecture
    from rlmegatron.planner.memory import weight_sync
    from rlmegatron.planner.parameters import count_parameters
    from tests.planner.test_memory import _spec

    model_dir = REPO_ROOT / "configs" / "models" / "tiny-qwen3"
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    named = [(name, tensor.detach().to(torch.bfloat16)) for name, tensor in model.named_parameters()]
    spec = _spec("tiny-qwen3", {}, placement={"nnodes": 1, "gpus_per_node": 1, "mode": "disaggregate",
                                              "rollout_nnodes": 2, "rollout_gpus_per_node": 2},
                 rollout={"tensor_parallel_size": 2}, data={"max_prompt_length": 256, "max_response_length": 256})
    planned = weight_sync(spec, count_parameters(read_architecture(model_dir)), link_gbps=400)

    servers = [start_spanning_server(tmp_path / f"server{key}", LOAD_S) for key in range(2)]  # all four at once
    try:
        for nodes, url in servers:
            nodes[0].wait_ready(SGLangClient(url).health, 30)
        push = DistributedWeightPush(bucket_bytes=64 << 10, travel_rules=travel_rules_for(model.config.to_dict()))
        for key, (_, url) in enumerate(servers):
            group = DistributedGroupSpec("127.0.0.1", free_port(), group_name=f"whole_{key}", backend="gloo")
            push.connect(key, url, 2, group)
        assert push.push(iter(named), "v1") == []
    finally:
        for nodes, _ in servers:
            for node in reversed(nodes):
                node.stop()

    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in named}
    full = {name: digest(tensor)[2] for name, tensor in named}
    by_receiver: dict[tuple[int, int], list[dict]] = {}
    for key in range(2):
        for record in calls(tmp_path / f"server{key}"):
            if record["path"] == "/update_weights_from_distributed":
                by_receiver.setdefault((key, record["node_rank"]), []).append(record)
    assert sorted(by_receiver) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for records in by_receiver.values():
        digests = {name: value for record in records for name, value in record["digests"].items()}
        assert digests == full  # every tensor, whole
        assert sum(sizes[name] for record in records for name in record["names"]) == planned.bytes_per_receiver
    assert planned.bytes_per_receiver == planned.total_bytes == sum(sizes.values())

    # Each bucket, both servers at once: their ranks take it while the other's are loading it (each load lasts LOAD_S);
    # the next bucket begins only once both servers have answered (node 0's answer; SGLang's also waits for its other
    # nodes).
    buckets = len(by_receiver[(0, 0)])
    assert buckets > 1 and planned.servers_per_link == 2
    for bucket in range(buckets):
        ranks = [by_receiver[(key, rank)][bucket] for key in range(2) for rank in (0, 1)]
        assert max(r["started"] for r in ranks) < min(r["ended"] for r in ranks)
        if bucket + 1 < buckets:
            assert max(by_receiver[(key, 0)][bucket]["ended"] for key in range(2)) <= min(
                by_receiver[(key, rank)][bucket + 1]["started"] for key in range(2) for rank in (0, 1))


def start_router(tmp_path: Path, legacy: bool = False) -> tuple[ServerProcess, str]:
    port = free_port()
    extra = {"fake-record": str(tmp_path / "router.jsonl"), "fake-legacy": legacy}
    process = ServerProcess(router_command(sys.executable, [], port, extra_args=extra), tmp_path / "router.log",
                            {"PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)])})
    process.start()
    url = f"http://127.0.0.1:{port}"
    process.wait_ready(SGLangClient(url).health, 30)
    return process, url


def test_servers_join_the_router_with_weights_and_leave_it_to_restart(tmp_path):
    router, url = start_router(tmp_path)
    engines = [make_engine(tmp_path, router_url=url) for _ in range(2)]
    workers = RouterClient(url).workers
    try:
        assert workers() == []  # no server serves before it holds trained weights
        for engine in engines:
            engine.update_weights(iter(weights()), "v1")
        assert workers() == [engines[0].spec.url, engines[1].spec.url]
        requests = [GenerationRequest((i, i + 1), SamplingSpec(max_new_tokens=2)) for i in range(6)]
        assert [r.weight_version for r in engines[0].generate(requests)] == ["v1"] * 6
        # The first engine's share went through the router, to both servers.
        served = [json.loads(line) for line in (tmp_path / "router.jsonl").read_text().splitlines()]
        assert {r["worker"] for r in served if r["path"] == "generate"} == set(workers())

        engines[1].process.stop()  # its server dies; its engine notices before sending its share
        with pytest.raises(EngineRestarted):
            engines[1].generate(requests)
        assert workers() == [engines[0].spec.url] and engines[1].restarts == 1
        assert [r.weight_version for r in engines[0].generate(requests)] == ["v1"] * 6  # the router skips it
        engines[1].update_weights(iter(weights()), "v1")
        assert workers() == [engines[0].spec.url, engines[1].spec.url]
        assert len(engines[1].generate(requests)) == 6
    finally:
        for engine in engines:
            engine.shutdown()
        assert workers() == []
        router.stop()


def test_a_router_with_the_older_worker_api_is_joined_and_left(tmp_path):
    router, url = start_router(tmp_path, legacy=True)
    engine = make_engine(tmp_path, router_url=url)
    try:
        engine.update_weights(iter(weights()), "v1")
        assert len(engine.generate([GenerationRequest((1, 2), SamplingSpec(n=2, max_new_tokens=2))])) == 2
    finally:
        engine.shutdown()
        router.stop()
    calls = [json.loads(line) for line in (tmp_path / "router.jsonl").read_text().splitlines()]
    assert [c["path"] for c in calls] == ["add", "generate", "generate", "remove"]
    assert {c.get("url", c.get("worker")) for c in calls} == {engine.spec.url}


def test_a_lora_adapter_is_loaded_sampled_with_and_replaced_by_the_next(tmp_path):
    """Adapter sync against the loopback server: the PEFT files load under the version's name, generation names the
    adapter, the next version replaces it."""
    from safetensors.torch import load_file, save_file

    adapters = {}
    for version, seed in (("step_1", 1), ("step_2", 2)):
        generator = torch.Generator().manual_seed(seed)
        path = tmp_path / version
        path.mkdir()
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        tensors = {f"{prefix}.lora_A.weight": torch.randn(4, 16, generator=generator),
                   f"{prefix}.lora_B.weight": torch.randn(16, 4, generator=generator)}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
        adapters[version] = str(path)
    engine = make_engine(tmp_path, **{"enable-lora": True, "max-lora-rank": 4, "lora-target-modules": "all"})
    request = [GenerationRequest((1, 2, 3), SamplingSpec(max_new_tokens=2))]
    try:
        engine.generate(request)
        engine.load_adapter("step_1", adapters["step_1"], "step_1")
        engine.generate(request)
        engine.load_adapter("step_2", adapters["step_2"], "step_2")
        engine.generate(request)
    finally:
        engine.shutdown()
    record = [(c["path"], c.get("lora_name") or c.get("lora_path")) for c in calls(tmp_path)
              if c["path"] in ("/generate", "/load_lora_adapter", "/unload_lora_adapter")]
    assert record == [("/generate", None), ("/load_lora_adapter", "step_1"), ("/generate", "step_1"),
                      ("/load_lora_adapter", "step_2"), ("/unload_lora_adapter", "step_1"), ("/generate", "step_2")]
    loaded = [c["tensors"] for c in calls(tmp_path) if c["path"] == "/load_lora_adapter"]
    for tensors, version in zip(loaded, ("step_1", "step_2")):
        on_disk = load_file(str(Path(adapters[version]) / "adapter_model.safetensors"))
        assert tensors == {name: json.loads(json.dumps(digest(t))) for name, t in on_disk.items()}


def test_a_sleeping_engine_whose_server_restarted_wakes_without_resuming_what_the_new_server_holds(tmp_path):
    """LoRA mode releases kv_cache and cuda_graph only; a server restarted meanwhile released nothing. Resuming a tag
    a server never released ends SGLang's scheduler (the fake dies alike: test_sglang_conformance compares them)."""
    engine = make_engine(tmp_path)
    try:
        engine.release_memory(("kv_cache", "cuda_graph"))
        engine.wake_up_with_weights(iter(weights()), "v1")
        assert engine.process.alive and engine.released == set()
        engine.release_memory(("kv_cache", "cuda_graph"))
        engine.process.stop()
        engine.relaunch()
        engine.wake_up_with_weights(iter(weights()), "v2")
        assert engine.process.alive and engine.health() and server_weights(engine)["version"] == "v2"
        assert [c["path"] for c in calls(tmp_path) if "memory" in c["path"]] == [
            "/release_memory_occupation", "/resume_memory_occupation", "/release_memory_occupation"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("version", ["0.5.9", "0.5.24"])
def test_a_server_outside_the_supported_versions_is_refused_in_one_line(tmp_path, version):
    import re

    from rlmegatron.errors import UserError

    with pytest.raises(UserError) as refused:
        make_engine(tmp_path, **{"fake-version": version})
    assert re.fullmatch(rf"the SGLang server at http://127\.0\.0\.1:\d+ runs version {re.escape(version)}; rlmegatron "
                        r"supports SGLang 0\.5\.10 to 0\.5\.23: install one of those \(pip install "
                        r"'sglang>=0\.5\.10,<=0\.5\.23'\) in the interpreter rollout\.sglang\.python names",
                        str(refused.value)), refused.value


def test_buckets_align_each_tensor_to_its_dtype_so_every_view_works():
    """An odd-length bf16 tensor before an fp32 one: packed back to back, the fp32 one would start 2 bytes off its
    alignment and .view(float32) would fail, in SGLang's FlattenedTensorBucket and in named_tensors() alike."""
    from rlmegatron.rollout.buckets import Bucketer

    tensors = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.arange(5, dtype=torch.float32)),
               ("c", torch.arange(3, dtype=torch.int8)), ("d", torch.arange(2, dtype=torch.float64))]
    (bucket,) = Bucketer(1 << 20, ()).buckets(iter(tensors))
    assert [(name, tensor.dtype, tensor.tolist()) for name, tensor in bucket.named_tensors()] == [
        (name, tensor.dtype, tensor.tolist()) for name, tensor in tensors]
    for meta in bucket.metadata:
        assert meta.start_idx % meta.dtype.itemsize == 0, meta


def test_an_answer_without_the_experts_it_was_asked_for_names_the_sample():
    """A request that ran and carries no experts: the server does not record them (its launch flag). One aborted in
    SGLang's waiting queue (a pause) carries none either, nor its prompt_tokens: it never started, and comes back
    empty for the engine to send again."""
    from rlmegatron.rollout.sglang.client import SGLangRequestError, parse_generate_response
    from rlmegatron.rollout.sglang.protocol import RoutedExpertsLayout

    layout = RoutedExpertsLayout(2, (1,), 2)
    answer = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"},
                                               "output_token_logprobs": [[-0.5, 7, None]]}}
    with pytest.raises(SGLangRequestError, match=r"^the answer to sample 3/1 \(1 tokens, finish reason length\) "
                                                 r"carries no routed_experts though they were asked for: the server "
                                                 r"does not record them; launch it with "
                                                 r"--enable-return-routed-experts$"):
        parse_generate_response(answer, 3, 1, layout)
    assert parse_generate_response(answer, 3, 1).routed_experts is None
    # What SGLang 0.5.23's tokenizer manager answers for a request aborted before it started (_handle_abort_req).
    waiting = {"text": "", "output_ids": [], "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "weight_version": "v3",
        "e2e_latency": 0.1, "input_token_logprobs": [], "output_token_logprobs": [], "completion_tokens": 0}}
    result = parse_generate_response(waiting, 3, 1, layout)
    assert (result.finish_reason, result.output_token_ids, result.routed_experts) == ("abort", (), None)


def test_a_sample_continued_after_a_pause_keeps_each_tokens_first_routing():
    """Partial rollout: piece 1 ran the prompt (3 tokens) and its 2 tokens but the last; piece 2 ran all 5 again
    (with the new weights) and its 2 tokens but the last. Each token keeps the routing of the piece that ran it
    first: rows 0-3 from piece 1, rows 4-5 from piece 2."""
    from rlmegatron.rollout.engine import GenerationResult
    from rlmegatron.rollout.sglang.client import joined

    def piece(tokens, rows, fill):
        return GenerationResult(0, 0, tokens, (-0.1,) * len(tokens), "abort",
                                routed_experts=torch.full((rows, 1, 2), fill, dtype=torch.int16))

    sample = joined([piece((10, 11), 3 + 2 - 1, 1), piece((12, 13), 5 + 2 - 1, 2)])
    assert sample.output_token_ids == (10, 11, 12, 13)
    assert sample.routed_experts[:, 0, 0].tolist() == [1, 1, 1, 1, 2, 2]  # prompt + 4 outputs - 1 rows


def test_every_router_flag_the_project_emits_parses_with_sglang_routers_own_parser():
    """router_command for the router rlm train starts (rollout.sglang.router with router_args), through the parser
    of sglang_router 0.3.2 (the test extra installs it), which exits 2 on an unknown flag."""
    from sglang_router.launch_router import parse_router_args

    from rlmegatron.rollout.sglang.server import router_command

    for command in (router_command("py", [], port=8000),
                    router_command("py", ["http://a:1", "http://b:2"], port=8000, host="0.0.0.0",
                                   extra_args={"policy": "round_robin", "cache-threshold": 0.5,
                                               "worker-startup-timeout-secs": 600})):
        parsed = parse_router_args(command[3:])
        assert (parsed.host, parsed.port) == (command[command.index("--host") + 1], 8000)
    assert parsed.worker_urls == ["http://a:1", "http://b:2"] and parsed.policy == "round_robin"
    with pytest.raises(SystemExit):  # what a flag the router does not know gets
        parse_router_args(router_command("py", [], port=8000, extra_args={"no-such-flag": 1})[3:])


def test_fp8_rollout_launches_servers_that_hold_block_wise_fp8_weights():
    """SGLang reads the format its weights are held in from the model's quantization_config: the launch gives it the
    one the sync quantises to."""
    from rlmegatron.models.fp8 import DEFAULT_CONFIG

    command = server_command(server_spec(RolloutConfig(quantization="fp8"), "/ckpt/hf", port=30000))
    assert command[command.index("--quantization") + 1] == "fp8"
    override = json.loads(command[command.index("--json-model-override-args") + 1])
    assert override == {"quantization_config": DEFAULT_CONFIG}
    plain = server_command(server_spec(RolloutConfig(), "/ckpt/hf", port=30000))
    assert "--quantization" not in plain and "--json-model-override-args" not in plain


def test_a_prompts_images_reach_the_server_as_sglang_takes_them(tmp_path):
    """image_data: one base64 image per placeholder, the prompt's placeholder runs collapsed to one token each (the
    server expands them to the grids); the fake refuses an expanded run or an image that does not decode, as
    SGLang's processor would fail on them."""
    from rlmegatron.data.images import PromptImages
    from tests.data.vision_assets import png

    pad = 151655
    images = PromptImages((png("r"), png("b", (16, 8))), ((1, 2, 2), (1, 2, 4)), pad)
    prompt = (1, 2, 151652, pad, 151653, 3, 151652, pad, pad, 151653, 4)
    engine = make_engine(tmp_path)
    try:
        (result,) = engine.generate([GenerationRequest(prompt, SamplingSpec(max_new_tokens=2), images=images)])
        sent = calls(tmp_path)[-1]
        assert sent["images"] == 2 and sent["input_ids"] == [1, 2, 151652, pad, 151653, 3, 151652, pad, 151653, 4]
        assert len(result.output_token_ids) == 2
        with pytest.raises(SGLangRequestError, match="3 image placeholder tokens in input_ids for 2 images"):
            engine.generation_client.generate(list(prompt), {"max_new_tokens": 1}, image_data=[
                base64.b64encode(data).decode() for data in images.data])
        with pytest.raises(SGLangRequestError, match="does not decode"):
            engine.generation_client.generate([1, pad, 2], {"max_new_tokens": 1}, image_data=["bm90IGFuIGltYWdl"])
    finally:
        engine.shutdown()
