"""The local engine in a process of its own, behind the part of SGLang's HTTP API rlmegatron uses: what lets
`rollout.engine=local` run disaggregated (placement.mode=disaggregate), on CPU too, with every piece of the
disaggregated path (a supervised server, weights broadcast from a trainer rank over a weight-update group, pause and
continue for partial rollout) the same as with SGLang.

    python -m rlmegatron.rollout.local_server --model-path DIR --host H --port P [--dtype bfloat16] [--device cpu]

SGLang flags it has no use for are accepted and ignored, so the launch command is SGLang's. The model starts from
random weights: the trainer pushes its own before the first request. Requests are batched: each batch takes every
request waiting when it starts. A weight push (`/update_weights_from_distributed` ... `/flush_cache`) waits for the
running batch and holds the next until it ends, so no sample mixes two versions within one request;
`/pause_generation` instead ends the running batch at its next token, each unfinished sample returning what it has
with finish reason `abort`, and holds new requests until `/continue_generation`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import threading
import traceback
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Sequence

import torch

from rlmegatron.errors import Divergence
from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, SamplingSpec
from rlmegatron.rollout.local import LocalEngine, causal_lm_from_config, image_processor_at
from rlmegatron.rollout.sglang.protocol import (RoutedExpertsLayout, deserialize_records, init_custom_process_group,
                                                on_the_wire)
from rlmegatron.rollout.sglang.server import RETURN_ROUTED_EXPERTS

PROTOCOL_VERSION = "0.5.20"
"""The SGLang version whose protocol this server speaks, as its /server_info reports it: the last without weight-update
sessions, which a server that applies each update whole does not need."""

WEIGHT_DIGESTS = "/rlm/weight_digests"
"""The local server's own route: the checksum of each weight it holds (trainer.check_sync_every)."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Scheduler:
    """Batches the waiting requests on one thread; holds ("pause", "update") keep new batches from starting."""

    def __init__(self, engine: LocalEngine, max_batch_size: int = 64) -> None:
        self.engine, self.max_batch_size = engine, max_batch_size
        self.cond = threading.Condition()
        self.pending: list[tuple[GenerationRequest, Future]] = []
        self.running = False
        self.holds: set[str] = set()
        self.abort = False
        threading.Thread(target=self._serve, daemon=True).start()

    def generate(self, request: GenerationRequest) -> GenerationResult:
        future: Future = Future()
        with self.cond:
            self.pending.append((request, future))
            self.cond.notify_all()
        return future.result()

    def hold(self, reason: str, abort: bool = False) -> None:
        """No new batch until `release(reason)`; returns once none runs (`abort`: the running one ends now)."""
        with self.cond:
            self.holds.add(reason)
            self.abort = self.abort or abort
            self.cond.wait_for(lambda: not self.running)

    def release(self, reason: str) -> None:
        with self.cond:
            self.holds.discard(reason)
            self.abort = self.abort and bool(self.holds)
            self.cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending and not self.holds)
                batch, self.pending = self.pending[: self.max_batch_size], self.pending[self.max_batch_size :]
                self.running = True
            try:
                results = self.engine.generate([request for request, _ in batch], interrupted=lambda: self.abort)
                for (_, future), result in zip(batch, results):
                    future.set_result(result)
            except BaseException as error:  # the requests' handlers report it; the scheduler serves on
                for _, future in batch:
                    future.set_exception(error)
            finally:
                with self.cond:
                    self.running = False
                    self.cond.notify_all()


class _Loading:
    """What a custom weight loader is handed as the model, the same object every time (as SGLang's model is: a loader
    may keep state per model): `load_weights` loads into the engine, labelled with the version of the push."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.version = engine, None

    def load_weights(self, named_tensors) -> None:
        self.engine.update_weights(named_tensors, self.version)


class LocalServer:
    def __init__(self, engine: LocalEngine, return_routed_experts: bool = False,
                 custom_weight_loaders: Sequence[str] = ()) -> None:
        """`return_routed_experts`: as SGLang's --enable-return-routed-experts, requests that ask get each token's
        experts, in SGLang's format; `custom_weight_loaders`: the import paths /update_weights_from_tensor may name
        as its load_format, as SGLang's --custom-weight-loader."""
        self.engine = engine
        self.custom_weight_loaders = list(custom_weight_loaders)
        self.loading = _Loading(engine)
        self.scheduler = Scheduler(engine)
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.routing = RoutedExpertsLayout.of(engine.model.config) if return_routed_experts else None

    def generate(self, body: dict) -> dict:
        params = body["sampling_params"]
        sampling = SamplingSpec(n=1, temperature=params["temperature"], top_p=params["top_p"], top_k=params["top_k"],
                                max_new_tokens=params["max_new_tokens"],
                                stop_token_ids=tuple(params.get("stop_token_ids", ())),
                                seed=params.get("sampling_seed"))
        if body.get("image_data"):
            # Its prompts come with one placeholder per image, which SGLang's processor expands; this server has no
            # such step, and generating from the unexpanded ids would silently drop the images.
            raise ValueError("the local server does not take image_data yet; run a vision-language model's local "
                             "engine colocated (placement.mode=colocate) or on SGLang")
        routed = bool(body.get("return_routed_experts"))
        if routed and self.routing is None:
            raise ValueError("return_routed_experts needs a server launched with --enable-return-routed-experts")
        try:
            result = self.scheduler.generate(GenerationRequest(tuple(body["input_ids"]), sampling,
                                                               return_routed_experts=routed))
        except Divergence:
            # As from SGLang, which samples from such logits: the log-prob says it (the client raises Divergence).
            return {"output_ids": [0], "meta_info": {"finish_reason": {"type": "length"},
                                                     "output_token_logprobs": [[math.nan, 0, None]],
                                                     "weight_version": self.engine.weight_version}}
        meta = {"finish_reason": {"type": result.finish_reason},
                "output_token_logprobs": [[logprob, token, None] for logprob, token in
                                          zip(result.output_token_logprobs, result.output_token_ids)],
                "weight_version": result.weight_version}
        if routed:
            meta["routed_experts"] = self.routing.encode(result.routed_experts)
        if result.spec_verify_ct:  # speculative decoding's counts, under SGLang's meta_info names
            meta.update(spec_verify_ct=result.spec_verify_ct, spec_num_correct_drafts=result.spec_num_correct_drafts,
                        spec_num_proposed_drafts=result.spec_num_proposed_drafts)
        return {"output_ids": list(result.output_token_ids), "meta_info": meta}

    def init_weights_update_group(self, body: dict) -> dict:
        self.groups[body["group_name"]] = body["backend"], init_custom_process_group(
            body["backend"], f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
            body["rank_offset"], body["group_name"])
        # In SGLang's words, so one grep finds which trainer process sends weights to either server.
        print(f"init custom process group: master_address={body['master_address']}, master_port="
              f"{body['master_port']}, group_name={body['group_name']}", flush=True)
        return {"success": True, "message": ""}

    def update_weights_from_distributed(self, body: dict) -> dict:
        """One bucket of a push; the push ends with /flush_cache, which lets generation go on."""
        self.scheduler.hold("update")
        backend, group = self.groups[body["group_name"]]
        tensors = []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.engine.device)
            torch.distributed.broadcast(on_the_wire(tensor, backend), group_src=0, group=group)
            tensors.append((name, tensor))
        self.engine.update_weights(tensors, body["weight_version"])
        return {"success": True, "message": ""}

    def update_weights_from_tensor(self, body: dict) -> dict:
        """One bucket of a push in the body, handed to the custom weight loader it names, which the server was
        launched with (--custom-weight-loader), as SGLang does: delta sync's records (rollout/delta.py)."""
        if body["load_format"] not in self.custom_weight_loaders:
            raise ValueError(f"Unknown load_format={body['load_format']}: this server was launched with custom "
                             f"weight loaders {self.custom_weight_loaders}")
        self.scheduler.hold("update")
        module, _, function = body["load_format"].rpartition(".")
        loader = getattr(importlib.import_module(module), function)
        self.loading.version = body["weight_version"]
        loader(self.loading, deserialize_records(body["serialized_named_tensors"][0]))
        return {"success": True, "message": ""}

    def weight_digests(self, body: dict) -> dict[str, str]:
        """The checksum of each weight named (trainer.check_sync_every): rlmegatron's own route, not SGLang's."""
        return self.engine.weight_digests(body["names"])

    def flush_cache(self, body: dict) -> None:
        self.scheduler.release("update")

    def pause_generation(self, body: dict) -> None:
        self.scheduler.hold("pause", abort=True)

    def continue_generation(self, body: dict) -> None:
        self.scheduler.release("pause")

    def memory(self, release: bool) -> Callable[[dict], dict]:
        def call(body: dict) -> dict:
            (self.engine.release_memory if release else self.engine.resume_memory)(body["tags"])
            return {"success": True, "message": ""}
        return call

    def routes(self) -> dict[str, Callable[[dict], Any]]:
        return {
            "/generate": self.generate,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
            WEIGHT_DIGESTS: self.weight_digests,
            "/flush_cache": self.flush_cache,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/release_memory_occupation": self.memory(release=True),
            "/resume_memory_occupation": self.memory(release=False),
        }


def handler_for(server: LocalServer) -> type[BaseHTTPRequestHandler]:
    routes = server.routes()

    class Handler(BaseHTTPRequestHandler):
        # Headers and body leave in two writes: with Nagle's algorithm each small reply waits out a delayed ACK.
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:  # one line per request would drown the log
            pass

        def reply(self, code: int, payload: Any = None) -> None:
            body = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/server_info":
                self.reply(200, {"version": PROTOCOL_VERSION})
            else:
                self.reply(200 if self.path in ("/health", "/health_generate", "/ping") else 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            # A query (SGLang's /flush_cache?timeout=) means nothing here: a flush never waits on this server.
            path = self.path.split("?", 1)[0]
            if path not in routes:
                self.reply(404, {"error": path})
                return
            try:
                self.reply(200, routes[path](body))
            except Exception as error:  # the client raises it; the log keeps the trace
                traceback.print_exc()
                self.reply(400, {"success": False, "message": f"{self.path}: {type(error).__name__}: {error}"})

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # an engine sends up to 64 requests at once; socketserver's 5 drops connections


def build_engine(model_path: str, dtype: str, device: str, trust_remote_code: bool, quantization: str | None = None,
                 num_draft_tokens: int = 0) -> LocalEngine:
    """`quantization` fp8 (SGLang's --quantization, rollout.quantization): weight updates come block-wise FP8.
    `num_draft_tokens` (SGLang's --speculative-num-steps with --speculative-algorithm NEXTN, rollout.speculative): the
    model's MTP layer drafts that many tokens per verification."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = causal_lm_from_config(config, DTYPES.get(dtype, torch.float32), trust_remote_code).to(device)
    eos = config.eos_token_id
    return LocalEngine(model, pad_token_id=config.pad_token_id or 0,
                       eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [],
                       weight_format=FP8_ROLLOUT if quantization == "fp8" else None,
                       image_processor=image_processor_at(model_path), num_draft_tokens=num_draft_tokens)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of SGLang's launch command this server reads (servers.launch_spec builds them for both)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda")  # SGLang's default: the launch command names only cpu
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--quantization", default=None)
    parser.add_argument(f"--{RETURN_ROUTED_EXPERTS}", dest="return_routed_experts", action="store_true")
    parser.add_argument("--custom-weight-loader", nargs="*", default=[])
    parser.add_argument("--speculative-algorithm", default=None, choices=["NEXTN"])  # the MTP layer drafts
    parser.add_argument("--speculative-num-steps", type=int, default=0)
    args, _ = parser.parse_known_args(argv)  # SGLang's other flags mean nothing to this engine
    return args


def engine_for(args: argparse.Namespace) -> LocalEngine:
    return build_engine(args.model_path, args.dtype, args.device, args.trust_remote_code, args.quantization,
                        args.speculative_num_steps if args.speculative_algorithm else 0)


def main() -> None:
    args = parse_arguments()
    torch.set_num_threads(1)  # one core, like each CPU trainer rank: on a shared machine more only contend
    httpd = Server((args.host, args.port),
                   handler_for(LocalServer(engine_for(args), args.return_routed_experts, args.custom_weight_loader)))
    print(f"local engine serving {args.model_path} at http://{args.host}:{args.port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
