"""One SGLang server as a rollout engine: launched, supervised and restarted by this process, synced by its caller."""
from __future__ import annotations

import base64

import contextlib
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from rlmegatron.rollout.buckets import TravelRule
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
from rlmegatron.rollout.sglang.client import (
    RouterClient,
    SGLangClient,
    SGLangRequestError,
    ServerUnavailable,
    joined,
    parse_generate_response,
    sampling_params,
)
from rlmegatron.rollout.sglang.protocol import RoutedExpertsLayout
from rlmegatron.rollout.sglang.server import ServerSpec, launch_node
from rlmegatron.rollout.sglang.weight_push import share_buckets
from rlmegatron.tracking.progress import Progress, report


class Gate:
    """Requests pass while it is open; `close` waits (up to its timeout) until none is in flight and lets no new one
    through until `open`."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.in_flight = 0
        self.closed = False

    def __enter__(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.closed)
            self.in_flight += 1

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()

    def close(self, timeout_s: float) -> None:
        with self.cond:
            self.closed = True
            if not self.cond.wait_for(lambda: self.in_flight == 0, timeout_s):
                self.closed = False
                self.cond.notify_all()
                raise ServerUnavailable(f"{self.in_flight} requests still in flight after {timeout_s:.0f} s")

    def open(self) -> None:
        with self.cond:
            self.closed = False
            self.cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Waits, without closing, until no request is in flight; False if some still are after `timeout_s`."""
        with self.cond:
            return self.cond.wait_for(lambda: self.in_flight == 0, timeout_s)


class EngineRestarted(RuntimeError):
    """The server was restarted and has no trained weights: sync it, then send the requests again."""


class SGLangEngine(RolloutEngine):
    """One SGLang server (one TP group) launched and supervised by this engine.

    A server that stops answering is restarted (at most `max_restarts` times per engine). The trained weights live
    in the trainer, whose export is collective, so the engine turns `stale` and `generate` raises `EngineRestarted`
    until the caller has pushed them; the caller then sends the requests again, and loses none. Samples the server
    itself aborted come back with finish reason `abort` for the caller to drop or resubmit.
    """

    def __init__(
        self,
        spec: ServerSpec,
        log_dir: str,
        bucket_bytes: int,
        travel_rules: Sequence[TravelRule] = (),
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
        self.startup_timeout_s = startup_timeout_s
        self.max_concurrency = max_concurrency
        self.max_restarts = max_restarts
        self.partial_rollout = partial_rollout
        self.request_timeout_s = request_timeout_s
        self.gate = Gate()
        """Holds this engine's new requests while a push waits for those in flight (`pause_generation`)."""
        self.restarts = 0
        self.push_target = 0
        """The restart count of the server the push under way goes to (set as a push starts, and as a restarted
        server is relaunched for its first): `mark_synced` holds for that server only. A push that ends after the
        server restarted (one_step_off and async generate beside it) leaves the new one stale."""
        self._epoch = 0
        self._recovery_lock = threading.Lock()
        """Held by a restart, and by `mark_synced`'s check of it."""
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
        prompt, image_data = request.prompt_token_ids, None
        if request.images is not None and request.images.data:
            # SGLang takes a prompt's images with one placeholder each and expands them itself, as transformers'
            # processor did for the prompt's ids; the images travel base64-encoded (its load_image decodes them).
            prompt = tuple(request.images.collapsed(prompt))
            image_data = [base64.b64encode(data).decode("ascii") for data in request.images.data]
        result = self._request(request_index, sample_index, prompt, spec, routing, image_data)
        if not self.partial_rollout:
            # The push waited for this engine's samples (`pause_generation`): an abort here is one the server
            # held before it started (its waiting queue), sent again whole.
            while result.finish_reason == "abort" and not result.output_token_ids:
                result = self._request(request_index, sample_index, prompt, spec, routing, image_data)
            return result
        # Partial rollout: an abort is the server making way for new weights. The sample goes on from its tokens
        # (and keeps their log-probs and versions); the server holds the request until it continues.
        produced = [result]
        while result.finish_reason == "abort" and sum(len(r.output_token_ids) for r in produced) < spec.max_new_tokens:
            tokens = [token for part in produced for token in part.output_token_ids]
            rest = SamplingSpec(**{**spec.__dict__, "max_new_tokens": spec.max_new_tokens - len(tokens),
                                   "seed": None if spec.seed is None else spec.seed + len(tokens)})
            result = self._request(request_index, sample_index, (*prompt, *tokens), rest, routing, image_data)
            produced.append(result)
        return joined(produced)

    def _request(self, request_index: int, sample_index: int, input_ids: Sequence[int],
                 spec: SamplingSpec, routing: RoutedExpertsLayout | None = None,
                 image_data: list[str] | None = None) -> GenerationResult:
        # Each failure either restarts the server (bounded by max_restarts) or retries a healthy one; the
        # attempt bound stops a server that stays healthy but keeps failing this request.
        for attempt in range(self.max_restarts + 3):
            try:
                with self.gate:
                    # Read once through the gate: a sample that waited there (a push paused the engine) while
                    # another restarted the server must not go to the new one before it holds the weights.
                    epoch, restarts = self._epoch, self.restarts
                    if self.stale:
                        raise EngineRestarted(f"server {self.spec.url} was restarted and waits for the trained "
                                              "weights")
                    answer = self.generation_client.generate(list(input_ids), sampling_params(spec, self.seeded),
                                                             self.adapter, return_routed_experts=routing is not None,
                                                             image_data=image_data)
            except ServerUnavailable as error:
                last_error = error
                self._recover(epoch)
                continue
            if self.restarts != restarts:
                # Another sample restarted the server while this one was on its way: the new server may have
                # answered it before it held the trained weights. Asked again, it meets the restart's outcome:
                # the engine stale, or (once the caller pushed) the weights.
                last_error = ServerUnavailable(f"server {self.spec.url} was restarted while the sample was sent")
                continue
            result = parse_generate_response(answer, request_index, sample_index, routing)
            # With adapter sync the server's own version stays its base weights'; the adapter sampled with is the
            # trained version that produced the tokens.
            return result if self.adapter is None else dataclasses.replace(result, weight_version=self.adapter)
        raise ServerUnavailable(f"sample {request_index}/{sample_index} failed {attempt + 1} times: {last_error}")

    # Weights -----------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: WeightStream, version: str) -> None:
        """Colocated: each bucket travels as a shared-memory/IPC handle, one per server TP rank."""
        self.push_target = self.restarts
        self.client.begin_weight_update()
        try:
            share_buckets(named_tensors, self.bucket_bytes, self.travel_rules, self.spec.tp_size, self.ipc_group,
                          post=lambda payloads: self.client.update_weights_from_tensor(payloads, weight_version=version))
        finally:
            self.client.end_weight_update()  # whatever failed: a session left open refuses the next
        self.client.flush_cache()  # none runs here: generation and the push take turns in the trainer ranks
        self.mark_synced(version)

    def load_adapter(self, name: str, path: str, version: str) -> None:
        """Colocated, adapter sync: the PEFT adapter at `path` in as `name`, the one before it out."""
        self.push_target = self.restarts
        self.client.load_lora_adapter(name, path)
        if self.adapter is not None and self.adapter != name:
            self.client.unload_lora_adapter(self.adapter)
        self.client.flush_cache()  # refused only while requests run, which finish on the new adapter
        self.mark_synced(version)
        self.adapter = name

    def mark_synced(self, version: str) -> None:
        """The server holds `version` (pushed here, or broadcast around this engine): it may serve, and join the
        router if it is not one of its workers. With adapter sync, a trained version is an adapter of its name. Not a
        server that restarted since the push started (`push_target`): it holds none of it, and stays stale. A restart
        under way is waited for (its lock), as it may be the very server the push went to."""
        with self._recovery_lock:  # a restart between the check and the rest would be marked synced
            if self.restarts != self.push_target:
                return
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
        """Before a disaggregated push (its trainer rank broadcasts the buckets, one update call each): the server
        holds every request that arrives until `continue_generation`, so none runs on half-updated weights (SGLang
        takes its writer lock per call, and would label such a request with the new version). With partial rollout
        the samples in flight are aborted and go on from their tokens once it continues; without, this engine first
        lets its own samples in flight finish on the old weights and sends no new one until then."""
        self.push_target = self.restarts
        if not self.partial_rollout:
            self.gate.close(self.request_timeout_s)
        self.client.pause_generation()

    def continue_generation(self) -> None:
        try:
            self.client.continue_generation()
        finally:
            self.gate.open()

    def health(self) -> bool:
        """Liveness: `/ping`, which answers from the HTTP process, also while generation is paused. But a `/health`
        (a router's: a one-token generation) that waits out SGLang's timeout during a pause marks the server
        unhealthy, and `/ping` says 503 from then until a `/health` succeeds, for a server that is fine. So a 503
        is checked with the scheduler itself: its answer to a control request (`/server_info`), which it runs
        while paused too."""
        if not self.process.alive:
            return False
        if self.client.alive():
            return True
        try:
            self.client.server_info()
        except (ServerUnavailable, SGLangRequestError):
            return False
        return True

    def relaunch(self) -> None:
        """After a multi-node restart, once the caller started the other nodes: this node up, the server ready."""
        if not self.process.alive:
            self.process.start()
        self._wait_ready()
        self.push_target = self.restarts

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
            if self.health():
                # A transient error on a healthy server: retry without a restart.
                self._epoch += 1
                return
            if self.restarts >= self.max_restarts:
                raise ServerUnavailable(f"server {self.spec.url} failed again after {self.restarts} restarts")
            # Unusable from here until the caller pushes the trained weights, also while the new server comes up
            # healthy: a push to every engine beside this recovery (one_step_off, async) must leave it out
            # (`EngineHost.takes_weights`), as the server is outside the weight-update group it pushes over. Stale
            # before the count moves: a sample that reads the new count finds it stale.
            self.stale = True
            self.restarts += 1
            if self.in_router:
                # Until it holds the trained weights again, the router must not send it anything.
                self.router.remove_worker(self.spec.url)
                self.in_router = False
            self.process.stop()
            if self.router is None:
                # Sent to directly (behind a router the server left it above, and rejoins only once it holds the
                # weights), a sample that passed the gate's checks before this restart may be on its way to the
                # port: it must meet the stopped server (and fail), not the new one, which would answer it without
                # the trained weights. Those that pass the gate from here on find the engine stale. (Should one
                # still come late, the restart count it read drops its answer: `_request`.)
                self.gate.drain(self.request_timeout_s)
            if self.spec.nnodes > 1:
                # The other nodes' processes belong to other hosts: the caller restarts all of them together
                # (`relaunch` here) before it pushes the weights.
                self._epoch += 1
                return
            self.process.start()
            self._wait_ready()
            self.adapter = None  # a restarted server holds none
            self._epoch += 1

