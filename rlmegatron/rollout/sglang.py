"""SGLang rollout engine: HTTP client for the server's generation/weight/memory endpoints, and the engine that
launches, supervises, restarts and re-syncs a server."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from packaging.version import InvalidVersion, Version

from rlmegatron.errors import Divergence, UserError
from rlmegatron.rollout.buckets import Bucketer, TravelRule
from rlmegatron.rollout.engine import (
    INITIAL_VERSION,
    MEMORY_TAGS,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingSpec,
    WeightStream,
    check_memory_tags,
)
from rlmegatron.rollout.sglang_protocol import (
    RoutedExpertsLayout,
    init_custom_process_group,
    on_the_wire,
    serialize_flattened_bucket,
)
from rlmegatron.rollout.sglang_server import ServerSpec, launch_node
from rlmegatron.tracking.progress import Progress, report


class ServerUnavailable(ConnectionError):
    """The server did not answer (refused, reset, timed out or 5xx): worth a restart and a retry."""


class SGLangRequestError(RuntimeError):
    """The server answered and refused the request (4xx or success=false): retrying will not help."""


SUPPORTED_SGLANG = (Version("0.5.10"), Version("0.5.23"))
"""The SGLang versions whose protocol this client speaks (setup.py's `gpu` extra pins the same range); 0.5.23 is the one
the conformance tests run (tests/rollout/test_sglang_conformance.py)."""
WEIGHT_UPDATE_SESSION_SINCE = Version("0.5.21")
"""From this version, update_weights_from_tensor/_from_distributed are refused outside a begin/end_weight_update
session."""


class UnsupportedServer(UserError):
    """The server runs an SGLang version outside SUPPORTED_SGLANG."""


class EngineRestarted(RuntimeError):
    """The server was restarted and has no trained weights (no `resync`): sync it, then send the requests again."""


def sampling_params(spec: SamplingSpec, seeded: bool = False) -> dict[str, Any]:
    """SGLang `sampling_params` for one sample (n is expanded client-side so each sample retries alone). `seeded`: the
    server runs with --enable-deterministic-inference, the only mode in which SGLang samples by `sampling_seed`;
    elsewhere it ignores the seed, so none is sent."""
    params: dict[str, Any] = {
        "n": 1,
        "max_new_tokens": spec.max_new_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
        "stop_token_ids": list(spec.stop_token_ids),
    }
    if seeded and spec.seed is not None:
        params["sampling_seed"] = spec.seed
    return params


class SGLangClient:
    """Endpoints of `sglang/srt/entrypoints/http_server.py`, with field names from `managers/io_struct.py`."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.version: Version | None = None
        """The server's SGLang version, once `check_version` read it."""

    def _call(self, method: str, path: str, payload: dict | None = None, timeout_s: float | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            if error.code >= 500:
                raise ServerUnavailable(f"{path}: HTTP {error.code} {detail}") from error
            raise SGLangRequestError(f"{path}: HTTP {error.code} {detail}") from error
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            raise ServerUnavailable(f"{path}: {error}") from error
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def _post_checked(self, path: str, payload: dict, timeout_s: float | None = None) -> dict:
        answer = self._call("POST", path, payload, timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SGLangRequestError(f"{path} failed: {answer.get('message')}")
        return answer

    def generate(self, input_ids: list[int], params: dict[str, Any], lora_name: str | None = None,
                 return_routed_experts: bool = False) -> dict:
        """`lora_name`: the loaded LoRA adapter to sample with (SGLang's `lora_path` names it); None: the base.
        `return_routed_experts`: the answer carries each token's experts (a server launched to record them)."""
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
        if lora_name is not None:
            body["lora_path"] = lora_name
        if return_routed_experts:
            body["return_routed_experts"] = True
        return self._call("POST", "/generate", body)

    def load_lora_adapter(self, name: str, path: str) -> dict:
        return self._post_checked("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> dict:
        return self._post_checked("/unload_lora_adapter", {"lora_name": name})

    def check_version(self) -> Version:
        """Reads the server's version (`/server_info`) and refuses one outside SUPPORTED_SGLANG."""
        answer = self._call("GET", "/server_info", timeout_s=30)
        reported = answer.get("version") if isinstance(answer, dict) else None
        low, high = SUPPORTED_SGLANG
        try:
            version = Version(str(reported))
        except InvalidVersion:
            version = None
        if version is None or not low <= version <= high:
            raise UnsupportedServer(f"the SGLang server at {self.base_url} runs version {reported}; rlmegatron "
                                    f"supports SGLang {low} to {high}: install one of those (pip install "
                                    f"'sglang>={low},<={high}') in the interpreter rollout.sglang.python names")
        self.version = version
        return version

    def begin_weight_update(self) -> None:
        """SGLang 0.5.21+ refuses update_weights_from_tensor/_from_distributed outside a session this opens; older
        versions have no session, and nothing is sent."""
        if self._has_sessions():
            self._post_checked("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        if self._has_sessions():
            self._post_checked("/end_weight_update", {})

    def _has_sessions(self) -> bool:
        if self.version is None:
            raise RuntimeError(f"{self.base_url}: check_version first, so the weight-update protocol is known")
        return self.version >= WEIGHT_UPDATE_SESSION_SINCE

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str | None, flush_cache: bool = False
    ) -> dict:
        return self._post_checked("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        })

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> dict:
        return self._post_checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str | None, flush_cache: bool = False,
    ) -> dict:
        return self._post_checked("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version,
        })

    def release_memory_occupation(self, tags: Sequence[str]) -> dict:
        return self._post_checked("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str]) -> dict:
        return self._post_checked("/resume_memory_occupation", {"tags": list(tags)})

    def pause_generation(self) -> None:
        self._call("POST", "/pause_generation", {})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    def flush_cache(self) -> bool:
        """Drops the prefix cache the old weights computed. False: SGLang refused (HTTP 400) because requests are
        running or queued; it flushes nothing then, and those requests finish on the new weights."""
        try:
            self._call("POST", "/flush_cache", {})
        except SGLangRequestError as error:
            if "HTTP 400" not in str(error):
                raise
            return False
        return True

    def health(self, timeout_s: float = 5.0) -> bool:
        """Readiness: `/health` runs a one-token generation through the scheduler (503 while the server starts).
        It waits while generation is paused, so it is no liveness probe: that is `alive`."""
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except (ServerUnavailable, SGLangRequestError):
            return False

    def alive(self, timeout_s: float = 5.0) -> bool:
        """Liveness: `/ping` answers from the HTTP process without generating, also while generation is paused
        (SGLang 0.5.10-0.5.23)."""
        try:
            self._call("GET", "/ping", timeout_s=timeout_s)
            return True
        except (ServerUnavailable, SGLangRequestError):
            return False

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        """Runs a one-token generation inside the server: proves the scheduler, not only the HTTP thread, lives."""
        try:
            self._call("GET", "/health_generate", timeout_s=timeout_s)
            return True
        except (ServerUnavailable, SGLangRequestError):
            return False


class RouterClient:
    """Worker registration at an sglang_router: the current `/workers` API, or the `/add_worker`/`/remove_worker`
    one of routers up to 0.2.x where `/workers` does not exist. Generation goes through `client`."""

    def __init__(self, url: str, timeout_s: float = 600.0, join_timeout_s: float = 60.0) -> None:
        self.client = SGLangClient(url, timeout_s)
        self.join_timeout_s = join_timeout_s

    def workers(self) -> list[str]:
        return [worker["url"] for worker in self.client._call("GET", "/workers")["workers"]]

    def add_worker(self, url: str) -> None:
        try:
            self.client._call("POST", "/workers", {"url": url, "worker_type": "regular"})
        except SGLangRequestError as error:
            if "HTTP 404" not in str(error) and "HTTP 405" not in str(error):
                raise
            self.client._call("POST", f"/add_worker?url={urllib.parse.quote(url, safe=':/')}")
            return
        # The current API queues the registration: wait until the worker is listed, so requests find it.
        deadline = time.monotonic() + self.join_timeout_s
        while url not in self.workers():
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"the router at {self.client.base_url} did not list {url} "
                                        f"within {self.join_timeout_s:.0f}s")
            time.sleep(0.05)

    def remove_worker(self, url: str) -> None:
        try:
            self.client._call("DELETE", f"/workers/{urllib.parse.quote(url, safe='')}")
        except SGLangRequestError as error:
            if "HTTP 404" not in str(error) and "HTTP 405" not in str(error):
                raise
            self.client._call("POST", f"/remove_worker?url={urllib.parse.quote(url, safe=':/')}")


def parse_generate_response(answer: dict, request_index: int, sample_index: int,
                            routing: RoutedExpertsLayout | None = None) -> GenerationResult:
    """`routing`: the model's layout of the routed experts the answer must carry (none asked for: None)."""
    meta = answer["meta_info"]
    output_ids = [int(token) for token in answer["output_ids"]]
    triples = meta["output_token_logprobs"]  # [logprob, token_id, text-or-None] per output token
    if [int(token) for _, token, *_ in triples] != output_ids:
        raise SGLangRequestError("output_token_logprobs does not follow output_ids")
    reason = meta["finish_reason"]["type"]
    if reason not in ("stop", "length", "abort"):
        raise SGLangRequestError(f"unknown finish reason {reason!r}")
    # The server samples from NaN or inf logits without complaint; their log-probs show it (NaN, or null where
    # the server's JSON encoder has no NaN).
    logprobs = tuple(math.nan if logprob is None else float(logprob) for logprob, *_ in triples)
    if not all(map(math.isfinite, logprobs)):
        position = next(k for k, logprob in enumerate(logprobs) if not math.isfinite(logprob))
        raise Divergence(f"rollout logits: the server's log-prob of response token {position + 1} of sample "
                         f"{request_index}/{sample_index} is {logprobs[position]}; the rollout model's weights "
                         "are not usable")
    routed = None
    if routing is not None:
        if not meta.get("routed_experts"):
            raise SGLangRequestError(f"the answer to sample {request_index}/{sample_index} carries no routed_experts "
                                     "though they were asked for; launch the server with --enable-return-routed-experts")
        routed = routing.decode(meta["routed_experts"])
    return GenerationResult(
        request_index=request_index,
        sample_index=sample_index,
        output_token_ids=tuple(output_ids),
        output_token_logprobs=logprobs,
        finish_reason=reason,
        weight_version=meta.get("weight_version"),
        routed_experts=routed,
    )


def joined(parts: Sequence[GenerationResult]) -> GenerationResult:
    """One sample from the pieces partial rollout generated it in, each piece's tokens tagged with its weights."""
    if len(parts) == 1:
        return parts[0]
    routed = None
    if parts[0].routed_experts is not None:
        # Each piece's record covers its whole input (the prompt and the tokens before it, prefilled again) and its
        # own tokens but the last. A token keeps the routing of the piece that ran it first: the piece that
        # sampled it, or, for a piece's last token, the next piece's prefill.
        routed, kept = parts[0].routed_experts, parts[0].routed_experts.shape[0]
        for part in parts[1:]:
            routed = torch.cat([routed, part.routed_experts[kept:]])
            kept = routed.shape[0]
    return GenerationResult(
        request_index=parts[0].request_index,
        sample_index=parts[0].sample_index,
        output_token_ids=tuple(token for part in parts for token in part.output_token_ids),
        output_token_logprobs=tuple(logprob for part in parts for logprob in part.output_token_logprobs),
        finish_reason=parts[-1].finish_reason,
        weight_version=parts[-1].weight_version,
        token_weight_versions=tuple(part.weight_version for part in parts for _ in part.output_token_ids),
        routed_experts=routed,
    )


WeightResync = Callable[[], tuple[WeightStream, str]]
"""Returns a fresh stream of the latest weights and their version (the trainer re-exports them)."""


@dataclass(frozen=True)
class DistributedGroupSpec:
    """Where the trainer (rank 0) and the server's TP ranks (1..tp_size) meet for broadcasts."""

    master_address: str
    master_port: int
    group_name: str = "rlmegatron_weight_sync"
    backend: str = "nccl"


class SGLangEngine(RolloutEngine):
    """One SGLang server (one TP group) launched and supervised by this engine.

    A server that stops answering is restarted, re-synced through `resync`, and the samples that were in
    flight are sent again, so `generate` loses none; at most `max_restarts` restarts per engine. Without
    `resync` (colocated: only a collective export has the weights) the engine turns `stale` and `generate`
    raises `EngineRestarted` until the caller has pushed weights; the caller then sends the requests again. Samples
    the server itself aborted come back with finish reason `abort` for the caller to drop or resubmit.
    """

    def __init__(
        self,
        spec: ServerSpec,
        log_dir: str,
        bucket_bytes: int,
        travel_rules: Sequence[TravelRule] = (),
        resync: WeightResync | None = None,
        router_url: str | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        max_concurrency: int = 64,
        max_restarts: int = 3,
        ipc_group: torch.distributed.ProcessGroup | None = None,
        lora_adapters: bool = False,
        partial_rollout: bool = False,
        routing: RoutedExpertsLayout | None = None,
    ) -> None:
        """`router_url`: the sglang_router in front of several servers; generation goes through it, and this
        server is one of its workers exactly while it holds trained weights. `ipc_group`: the trainer ranks on this server's GPUs, this one first; each shares its own copy of every
        bucket (`share_buckets`). Without it this process shares one copy with every server TP rank.
        `partial_rollout`: a sample aborted by `pause_generation` (new weights on the way) is sent again as the
        prompt plus the tokens it has, and goes on from there once the server continues (`_generate_one`).
        `routing`: the model's routed-experts layout, for a server launched to return them
        (--enable-return-routed-experts): requests that ask for them get them."""
        self.spec = spec
        self.process = launch_node(spec, log_dir, start=False)
        self.ipc_group = ipc_group
        self.client = SGLangClient(spec.url, request_timeout_s)
        self.router = RouterClient(router_url, request_timeout_s) if router_url else None
        self.generation_client = self.router.client if self.router else self.client
        self.in_router = False
        self.bucket_bytes = bucket_bytes
        self.travel_rules = tuple(travel_rules)
        self.resync = resync
        self.startup_timeout_s = startup_timeout_s
        self.max_concurrency = max_concurrency
        self.max_restarts = max_restarts
        self.partial_rollout = partial_rollout
        self.restarts = 0
        self._epoch = 0
        self._recovery_lock = threading.Lock()
        self.weight_version: str | None = None
        self.lora_adapters = lora_adapters
        """The trained policy is the base weights plus a LoRA adapter named by its version (actor.lora.weight_sync
        `adapter`); `adapter` is the one the server holds, None until the first is loaded."""
        self.adapter: str | None = None
        self.seeded = bool(spec.extra_args.get("enable-deterministic-inference"))
        """SGLang samples by the requests' seeds only in deterministic-inference mode (`sampling_params`)."""
        self.released: set[str] = set()
        """The memory tags the server has released: SGLang's scheduler dies on a resume of any other."""
        self.routing = routing
        try:
            self.relaunch()
        except BaseException:
            self.process.stop()  # a server that never became healthy is not left running
            raise

    # Generation --------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest], progress: Progress = None) -> list[GenerationResult]:
        if self.router is not None and not self.health():
            # Behind a router this engine's own requests may all be served elsewhere: look at its server itself.
            self._recover(self._epoch)
        samples = [(i, s, request) for i, request in enumerate(requests) for s in range(request.sampling.n)]

        def one(sample) -> GenerationResult:
            result = self.generate_one(*sample)
            report(progress)
            return result

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(samples)))) as pool:
            return list(pool.map(one, samples))

    def generate_one(self, request_index: int, sample_index: int, request: GenerationRequest) -> GenerationResult:
        """Sample `sample_index` of a request; safe to call from many threads at once (the agent loop does)."""
        spec = request.sampling
        if spec.seed is not None:
            # Distinct but reproducible seeds for the n samples of one request.
            spec = SamplingSpec(**{**spec.__dict__, "seed": spec.seed * 1_000_003 + sample_index})
        routing = None
        if request.return_routed_experts:
            if self.routing is None:
                raise ValueError(f"server {self.spec.url} was not launched to return routed experts")
            routing = self.routing
        result = self._request(request_index, sample_index, request.prompt_token_ids, spec, routing)
        if not self.partial_rollout:
            return result
        # Partial rollout: an abort is the server making way for new weights. The sample goes on from its tokens
        # (and keeps their log-probs and versions); the server holds the request until it continues.
        produced = [result]
        while result.finish_reason == "abort" and sum(len(r.output_token_ids) for r in produced) < spec.max_new_tokens:
            tokens = [token for part in produced for token in part.output_token_ids]
            rest = SamplingSpec(**{**spec.__dict__, "max_new_tokens": spec.max_new_tokens - len(tokens),
                                   "seed": None if spec.seed is None else spec.seed + len(tokens)})
            result = self._request(request_index, sample_index, (*request.prompt_token_ids, *tokens), rest, routing)
            produced.append(result)
        return joined(produced)

    def _request(self, request_index: int, sample_index: int, input_ids: Sequence[int],
                 spec: SamplingSpec, routing: RoutedExpertsLayout | None = None) -> GenerationResult:
        # Each failure either restarts the server (bounded by max_restarts) or retries a healthy one; the
        # attempt bound stops a server that stays healthy but keeps failing this request.
        for attempt in range(self.max_restarts + 3):
            epoch = self._epoch
            if self.stale:
                raise EngineRestarted(f"server {self.spec.url} was restarted and waits for the trained weights")
            try:
                answer = self.generation_client.generate(list(input_ids), sampling_params(spec, self.seeded),
                                                         self.adapter, return_routed_experts=routing is not None)
                result = parse_generate_response(answer, request_index, sample_index, routing)
                # With adapter sync the server's own version stays its base weights'; the adapter sampled with is
                # the trained version that produced the tokens.
                return result if self.adapter is None else dataclasses.replace(result, weight_version=self.adapter)
            except ServerUnavailable as error:
                last_error = error
                self._recover(epoch)
        raise ServerUnavailable(f"sample {request_index}/{sample_index} failed {attempt + 1} times: {last_error}")

    # Weights -----------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: WeightStream, version: str) -> None:
        """Colocated: each bucket travels as a shared-memory/IPC handle, one per server TP rank."""
        self.client.begin_weight_update()
        share_buckets(named_tensors, self.bucket_bytes, self.travel_rules, self.spec.tp_size, self.ipc_group,
                      post=lambda payloads: self.client.update_weights_from_tensor(payloads, weight_version=version))
        self.client.end_weight_update()
        self.client.flush_cache()  # refused only while requests run, which finish on the new weights
        self.mark_synced(version)

    def load_adapter(self, name: str, path: str, version: str) -> None:
        """Colocated, adapter sync: the PEFT adapter at `path` in as `name`, the one before it out."""
        self.client.load_lora_adapter(name, path)
        if self.adapter is not None and self.adapter != name:
            self.client.unload_lora_adapter(self.adapter)
        self.client.flush_cache()  # refused only while requests run, which finish on the new adapter
        self.mark_synced(version)
        self.adapter = name

    def mark_synced(self, version: str) -> None:
        """The server holds `version` (pushed here, or broadcast around this engine): it may serve, and join the
        router if it is not one of its workers. With adapter sync, a trained version is an adapter of its name."""
        if self.lora_adapters:
            self.adapter = None if version == INITIAL_VERSION else version
        self.weight_version = version
        self.stale = False
        if self.router is not None and not self.in_router:
            self.router.add_worker(self.spec.url)
            self.in_router = True

    # Memory and control ------------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """A server without the memory saver cannot release anything, so it keeps its memory."""
        held = [tag for tag in check_memory_tags(tags) if tag not in self.released]
        if self.spec.enable_memory_saver and held:
            self.client.release_memory_occupation(held)
            self.released.update(held)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Only tags the server released: resuming another raises in SGLang's scheduler, which ends the server (a
        sleeping engine in LoRA mode released no weights; a restarted one released nothing)."""
        released = [tag for tag in check_memory_tags(tags) if tag in self.released]
        if self.spec.enable_memory_saver and released:
            self.client.resume_memory_occupation(released)
            self.released.difference_update(released)

    def pause_generation(self) -> None:
        self.client.pause_generation()

    def continue_generation(self) -> None:
        self.client.continue_generation()

    def health(self) -> bool:
        """Liveness, which holds while generation is paused (`SGLangClient.alive`)."""
        return self.process.alive and self.client.alive()

    def relaunch(self) -> None:
        """After a multi-node restart, once the caller started the other nodes: this node up, the server ready."""
        if not self.process.alive:
            self.process.start()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """A fresh server: ready to generate (its `/health`), of a supported version, holding all its memory."""
        self.process.wait_ready(self.client.health, self.startup_timeout_s)
        self.client.check_version()
        self.released = set()

    def shutdown(self) -> None:
        if self.in_router:
            with contextlib.suppress(ServerUnavailable, SGLangRequestError):  # the router may be gone already
                self.router.remove_worker(self.spec.url)
            self.in_router = False
        self.process.stop()

    # Failure -----------------------------------------------------------------------------------------

    def _recover(self, failed_epoch: int) -> None:
        """Restart once per failure, however many samples saw it: those that failed in an older epoch
        just retry against the restarted server."""
        with self._recovery_lock:
            if self._epoch != failed_epoch:
                return
            if self.process.alive and self.client.alive():
                # A transient error on a healthy server: retry without a restart.
                self._epoch += 1
                return
            if self.restarts >= self.max_restarts:
                raise ServerUnavailable(f"server {self.spec.url} failed again after {self.restarts} restarts")
            self.restarts += 1
            if self.resync is None:
                # Unusable from here until the caller pushes the trained weights, also while the new server comes
                # up healthy: a push to every engine beside this recovery (one_step_off, async) must leave it out
                # (`EngineHost.takes_weights`), as the server is outside the weight-update group it pushes over.
                self.stale = True
            if self.in_router:
                # Until it holds the trained weights again, the router must not send it anything.
                self.router.remove_worker(self.spec.url)
                self.in_router = False
            self.process.stop()
            if self.spec.nnodes > 1:
                # The other nodes' processes belong to other hosts: the caller restarts all of them together
                # (`relaunch` here) before it pushes the weights.
                self.stale = True
                self._epoch += 1
                return
            self.process.start()
            self._wait_ready()
            self.adapter = None  # a restarted server holds none
            if self.resync is not None:
                stream, version = self.resync()
                self.update_weights(stream, version)
            # Else the weights live in the trainer, whose export is collective: the caller syncs (it is stale).
            self._epoch += 1


def share_buckets(named_tensors: WeightStream, bucket_bytes: int, travel_rules: Sequence[TravelRule], tp_size: int,
                  group: torch.distributed.ProcessGroup | None, post: Callable[[list[str]], Any] | None) -> None:
    """Colocated push, run by every rank of `group` on the same stream (the export yields it on every rank).

    Each rank shares its own copy of each bucket, so server TP rank i opens memory of trainer rank i, which sits on
    its GPU and its node: no cross-device reads, and a server spanning nodes works. The group's first rank, which
    gets `post`, sends the tp_size handles in one request. Without a group, one copy serves every TP rank.
    """
    bucketer = Bucketer(bucket_bytes, travel_rules, reuse_buffer=True, shared_memory=True)
    for bucket in bucketer.buckets(named_tensors):
        payload = serialize_flattened_bucket(bucket)
        if group is None:
            payloads = [payload] * tp_size
        else:
            payloads = [None] * group.size() if post is not None else None
            torch.distributed.gather_object(payload, payloads, group_dst=0, group=group)
        if post is not None:
            post(payloads)  # returns once the server loaded the bucket
        if group is not None:
            torch.distributed.barrier(group=group)  # ...so every rank may reuse its buffer
        if bucket.flattened_tensor.is_cuda:
            torch.cuda.ipc_collect()


class DistributedWeightPush:
    """Trainer side of disaggregated sync (run on one trainer rank): one process group per server, with this
    process as rank 0 and the server's TP ranks as 1..tp, built exactly as SGLang's `init_weights_update_group`
    does; one bucketed pass over the weight stream, each bucket broadcast to every server in turn."""

    def __init__(self, bucket_bytes: int, travel_rules: Sequence[TravelRule] = (), timeout_s: float = 600.0) -> None:
        self.bucket_bytes = bucket_bytes
        self.travel_rules = tuple(travel_rules)
        self.timeout_s = timeout_s
        self.servers: dict[int, tuple[SGLangClient, DistributedGroupSpec, torch.distributed.ProcessGroup]] = {}

    def connect(self, key: int, url: str, tp_size: int, group: DistributedGroupSpec) -> None:
        """Joins a group with server `key`; a restarted server gets a new group (its old members are gone)."""
        client = SGLangClient(url, self.timeout_s)
        client.check_version()
        world_size = 1 + tp_size  # tp_size counts the server's ranks on all its nodes
        pending = _in_thread(lambda: client.init_weights_update_group(
            group.master_address, group.master_port, 1, world_size, group.group_name, group.backend
        ))
        process_group = init_custom_process_group(
            group.backend, f"tcp://{group.master_address}:{group.master_port}", world_size, 0, group.group_name
        )
        pending.result()
        self.servers[key] = (client, group, process_group)

    def push(self, named_tensors: WeightStream, version: str, only: Sequence[int] | None = None) -> list[int]:
        """Per bucket and server: announce names/dtypes/shapes, then broadcast in exactly that order while the
        server's request is pending. `only` limits the push to those servers (restarted ones). Returns the servers
        that went down during the push (ServerUnavailable): the others get every bucket all the same, and the stream
        is walked whole, as the other trainer ranks export it collectively; a server left out is restarted by the
        generation that next meets it, and joins a new group."""
        keys = list(self.servers if only is None else only)
        down: list[int] = []
        for key in keys:
            try:
                self.servers[key][0].begin_weight_update()
            except ServerUnavailable:
                down.append(key)
        self._broadcast(named_tensors, version, keys, down)
        for key in keys:
            if key not in down:
                try:
                    self.servers[key][0].end_weight_update()
                    self.servers[key][0].flush_cache()  # refused only while requests run: they finish on the new weights
                except ServerUnavailable:
                    down.append(key)
        return down

    def _broadcast(self, named_tensors: WeightStream, version: str, keys: list[int], down: list[int]) -> None:
        for bucket in Bucketer(self.bucket_bytes, self.travel_rules, reuse_buffer=True).buckets(named_tensors):
            pairs = bucket.named_tensors()
            for key in keys:
                if key in down:
                    continue
                client, group, process_group = self.servers[key]
                announce = _in_thread(lambda: client.update_weights_from_distributed(
                    names=[name for name, _ in pairs],
                    dtypes=[str(tensor.dtype).removeprefix("torch.") for _, tensor in pairs],
                    shapes=[list(tensor.shape) for _, tensor in pairs],
                    group_name=group.group_name,
                    weight_version=version,
                ))
                # Queued, not waited on one by one: a server that refuses the announcement (and so never joins)
                # fails the push with its answer instead of leaving this rank in a broadcast for ever.
                sent = [torch.distributed.broadcast(on_the_wire(tensor, group.backend), group_src=0,
                                                    group=process_group, async_op=True) for _, tensor in pairs]
                try:
                    announce.result()
                except ServerUnavailable:
                    down.append(key)  # its broadcasts go with its group, which is never used again
                    continue
                for work in sent:
                    work.wait()


def _in_thread(call: Callable[[], Any]) -> Future:
    """An HTTP call that blocks server-side until this process joins a collective, run alongside it."""
    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(call)
    executor.shutdown(wait=False)
    return future
