"""Fake `sglang.launch_server`: a loopback HTTP server with SGLang's documented request/response schemas.

It validates field names and types strictly (400 on anything unexpected), really unpickles the weight
buckets and joins the weight-update process group, records every call to a JSONL file the tests read,
takes `--fake-token-delay` seconds per token if asked (so `/pause_generation` finds requests in flight: as SGLang's
default abort mode does, it ends them with what they have and finish reason abort), and can crash on purpose (on its
Nth request, `--fake-die-after-generates`, or its Nth weight bucket, `--fake-die-on-push`), fail to start
(`--fake-fail-start`) or take its time (`--fake-slow-start SECONDS`).

It is no more lenient than SGLang 0.5.23 (tests/rollout/test_sglang_conformance.py runs the same scenario against
both): weight updates outside a /begin_weight_update../end_weight_update session are refused (400; not before
`--fake-version` 0.5.21), and one while generation is not paused waits for the requests in flight (SGLang's writer
lock, which a request holds as a reader); a bucket unpickles only through SGLang's SafeUnpickler allowlist
(safe_unpickling.py); /flush_cache is refused (400) while a request runs, unless `?timeout=` lets it wait for them;
/health generates (so it waits while generation is paused, 503 after SGLANG_HEALTH_CHECK_TIMEOUT, 20 s, and counts as
a request in flight meanwhile), and a /health that timed out marks the server unhealthy, which /ping then says (503)
until a /health succeeds; /ping answers at once otherwise; a release of memory while any request is in flight ends
the server, and a resume of a memory tag that was not released ends the server, as the KeyError in SGLang's
scheduler does. `--fake-max-running N` runs N requests at once, the others wait in a queue, and a pause answers those
as SGLang answers a waiting-queue abort: no tokens, no prompt_tokens, no routed experts. With
--enable-return-routed-experts, a request that asks gets each token's experts in SGLang's encoding.

Spanning nodes (`--nnodes`), it behaves as SGLang does: node 0 listens on `--dist-init-addr` and is healthy only
once every other node joined; other nodes serve no HTTP; losing any node ends the whole server; and every node takes
part in a weight update (node 0 hands each call on to the others, as SGLang's tokenizer manager does to the
schedulers of every node): each node's ranks join the weight-update group, at rank_offset plus the node's first TP
rank, and receive every broadcast, which each node records with its node rank and the digests of what it received.
One process stands for a node, so a server spanning nodes has one TP rank per node (--tp-size = --nnodes).
"""
import argparse
import base64
import contextlib
import hashlib
import io
import json
import os
import pickle
import socket
import sys
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer

import torch
from fake_http import JSONHandler
from safe_unpickling import SafeUnpickler

HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # SGLang's own knob

SAMPLING_KEYS = {"n": int, "max_new_tokens": int, "temperature": (int, float), "top_p": (int, float),
                 "top_k": int, "stop_token_ids": list, "sampling_seed": int}
TAGS = {"weights", "kv_cache", "cuda_graph"}


class BadRequest(Exception):
    pass


class NotFound(Exception):
    pass


def expect(body, schema):
    """`schema`: {field: type or tuple of types}; every field required, no others allowed."""
    if not isinstance(body, dict) or set(body) != set(schema):
        raise BadRequest(f"fields {sorted(body) if isinstance(body, dict) else body} != {sorted(schema)}")
    for key, kind in schema.items():
        if not isinstance(body[key], kind) or (kind is int and isinstance(body[key], bool)):
            raise BadRequest(f"{key} has type {type(body[key]).__name__}")


def accept_device_uuids():
    """As SGLang does before it unpickles weights: CUDA handles name their device by UUID."""
    from torch.multiprocessing import reductions

    original = reductions.rebuild_cuda_tensor

    def rebuild_cuda_tensor(*args):
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if not isinstance(args[6], str) or args[6] not in uuids:
            raise BadRequest(f"CUDA tensor device {args[6]!r} is not the UUID of one of this server's GPUs")
        return original(*args[:6], uuids.index(args[6]), *args[7:])

    reductions.rebuild_cuda_tensor = rebuild_cuda_tensor


def tensor_digest(tensor):
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
            hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]


class FakeServer:
    def __init__(self, args):
        self.args = args
        self.weights = {}
        self.adapters = {}
        self.weight_version = "default"
        self.released = set()
        self.generates = 0
        self.pushes = 0
        self.lock = threading.Lock()
        self.groups = {}
        self.session = False
        self.has_sessions = tuple(map(int, args.fake_version.split("."))) >= (0, 5, 21)
        self.nodes_joined = threading.Event()
        self.unhealthy = False  # a /health timed out: /ping says 503 until one succeeds, as SGLang's server_status
        self.updating = False  # a weight update holds the model-update lock as its writer
        self.queued = []  # the requests in arrival order: the first --fake-max-running run, the others wait
        self.peers = []  # node 0 of a server spanning nodes: a socket to each other node
        self.unpaused = threading.Event()  # /pause_generation holds new requests until /continue_generation
        self.unpaused.set()
        self.aborting = False  # ... and aborts those in flight
        self.tokens_generated = 0  # GET /fake/progress: a test can pause once generation is under way
        self.in_flight = 0
        self.waiting_health = 0  # /health generations waiting for /continue_generation
        self.settled = threading.Condition()  # /pause_generation answers once no request is in flight
        config = os.path.join(args.model_path, "config.json")
        # Token ids stay inside a real model's vocabulary, so a trainer can consume the samples.
        self.vocab = json.load(open(config))["vocab_size"] if os.path.exists(config) else 1000
        # A vision-language model's image placeholder (Qwen2.5-VL's unless config.json says otherwise).
        self.image_token = json.load(open(config)).get("image_token_id", 151655) if os.path.exists(config) \
            else 151655
        shape = json.load(open(config)) if os.path.exists(config) else {}
        self.routing = (shape.get("num_hidden_layers", 2), shape.get("num_experts_per_tok", 2),
                        shape.get("num_experts", 8))
        """Layers, top-k and experts of the routing a request that asks gets back."""

    @contextlib.contextmanager
    def model_update(self):
        """SGLang's model-update lock: an update waits for the requests in flight and holds new ones, unless
        generation is paused, when it takes no lock (whoever paused holds it)."""
        if not self.unpaused.is_set():
            yield
            return
        with self.settled:
            self.settled.wait_for(lambda: not self.in_flight and not self.updating)
            self.updating = True
        try:
            yield
        finally:
            with self.settled:
                self.updating = False
                self.settled.notify_all()

    def first_to_die(self):
        """Only one server of a run dies: the one that creates the marker (atomically: servers race for it)."""
        try:
            os.close(os.open(self.args.fake_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def record(self, path, **details):
        with self.lock, open(self.args.fake_record, "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "path": path, **details}) + "\n")

    def generate(self, body):
        lora = body.pop("lora_path", None)
        if lora is not None and lora not in self.adapters:
            raise BadRequest(f"no LoRA adapter {lora!r} is loaded")
        images = body.pop("image_data", None)
        routed = body.pop("return_routed_experts", False)
        if routed and not self.args.enable_return_routed_experts:
            raise BadRequest("return_routed_experts needs --enable-return-routed-experts")
        expect(body, {"input_ids": list, "sampling_params": dict, "return_logprob": bool})
        if images is not None:
            self.check_images(images, body["input_ids"])
        body["images"] = len(images or [])  # for the record
        params = body["sampling_params"]
        unknown = set(params) - set(SAMPLING_KEYS)
        if unknown or not all(isinstance(params[k], SAMPLING_KEYS[k]) for k in params):
            raise BadRequest(f"bad sampling_params {params}")
        if "kv_cache" in self.released or "weights" in self.released:
            raise BadRequest("memory is released")
        self.unpaused.wait()
        with self.settled:  # one count of the requests in flight: what /pause_generation waits on
            self.settled.wait_for(lambda: not self.updating)  # SGLang's model-update lock: a reader per request
            self.generates += 1
            count = self.generates
            self.in_flight += 1
            in_flight = self.in_flight
            self.queued.append(count)
            self.settled.notify_all()  # a count the requests held for the fatal one wait on (_generate)
        try:
            limit = self.args.fake_max_running
            with self.settled:
                self.settled.wait_for(lambda: not limit or self.queued.index(count) < limit or self.aborting)
                started = not limit or not self.aborting  # a pause came first: still in the queue
            if not started:  # aborted in the waiting queue, as SGLang's tokenizer manager answers it
                return {"text": "", "output_ids": [], "meta_info": {
                    "id": f"{os.getpid()}-{count}", "finish_reason": {"type": "abort",
                                                                       "message": "Abort in waiting queue"},
                    "weight_version": self.weight_version, "e2e_latency": 0.0, "input_token_logprobs": [],
                    "output_token_logprobs": [], "completion_tokens": 0}}
            answer = self._generate(body, params, count, in_flight, lora)
            if routed:
                answer["meta_info"]["routed_experts"] = self.routed_experts(body["input_ids"], answer["output_ids"])
            return answer
        finally:
            with self.settled:
                self.in_flight -= 1
                self.queued.remove(count)
                self.settled.notify_all()

    def routed_experts(self, input_ids, output_ids):
        """SGLang's encoding: base64 of int32 [prompt + output - 1 tokens, layers, top-k], an expert per slot that
        follows from the token, the layer and the slot."""
        seen = [*input_ids, *output_ids][:-1]
        layers, topk, experts = self.routing
        table = torch.tensor([[[(token * 7 + layer * 3 + slot) % experts for slot in range(topk)]
                               for layer in range(layers)] for token in seen], dtype=torch.int32)
        return base64.b64encode(table.numpy().tobytes()).decode("ascii")

    def _generate(self, body, params, count, in_flight, lora):
        dies_at = self.args.fake_die_after_generates
        if 0 < count < dies_at and not os.path.exists(self.args.fake_marker):
            # A server that may die does so with its earlier requests still in flight, however slowly a loaded machine
            # delivers the batch: they wait for the fatal request (bounded, for a batch that never gets that far).
            with self.settled:
                self.settled.wait_for(lambda: self.generates >= dies_at, timeout=10)
        if count == dies_at and self.first_to_die():
            os._exit(3)  # mid-batch: the other requests in flight get their connections reset
        time.sleep(0.02)
        checksum = int(sum(float(t.double().sum()) for t in self.weights.values()) * 1000) % 997
        version = self.weight_version
        output_ids, finish = self.tokens(body, params, checksum)
        logprobs = [[-0.01 * (i + 1), token, None] for i, token in enumerate(output_ids)]
        # in_flight: the requests this server held at once when this one arrived (the agent loop sends many).
        self.record("/generate", input_ids=body["input_ids"], output_ids=output_ids, in_flight=in_flight,
                    lora_path=lora, images=body["images"])
        return {"output_ids": output_ids, "meta_info": {
            "id": f"{os.getpid()}-{count}", "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(output_ids), "output_token_logprobs": logprobs,
            "weight_version": version}}

    def check_images(self, images, input_ids):
        """As SGLang: image_data is a list of images (here base64 strings, what its load_image decodes without a
        file or URL), and its processor expands each image placeholder of input_ids into the image's grid, so there
        is exactly one placeholder per image: an expanded run would be read as one image per token."""
        import base64
        import binascii
        import io

        from PIL import Image

        if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
            raise BadRequest(f"image_data must be a list of base64 strings, got {type(images).__name__}")
        for image in images:
            try:
                Image.open(io.BytesIO(base64.b64decode(image, validate=True))).load()
            except (binascii.Error, OSError) as err:
                raise BadRequest(f"image_data holds an image that does not decode: {err}")
        placeholders = sum(token == self.image_token for token in input_ids)
        if placeholders != len(images):
            raise BadRequest(f"{placeholders} image placeholder tokens in input_ids for {len(images)} images")

    def tokens(self, body, params, checksum):
        output_ids, finish = [], {"type": "length", "length": params["max_new_tokens"]}
        for step in range(params["max_new_tokens"]):
            time.sleep(self.args.fake_token_delay)
            if self.aborting:
                finish = {"type": "abort", "message": "paused"}
                break
            # As SGLang, a request's seed counts only in deterministic-inference mode.
            seed = params.get("sampling_seed", 0) if self.args.enable_deterministic_inference else 0
            token = (sum(body["input_ids"]) + 31 * step + checksum + seed) % self.vocab
            self.tokens_generated += 1
            output_ids.append(token)
            if token in params["stop_token_ids"]:
                finish = {"type": "stop", "matched": token}
                break
        return output_ids, finish

    def pause(self):
        self.aborting = True
        self.unpaused.clear()
        with self.settled:
            self.settled.wait_for(lambda: self.in_flight == 0)

    def update_weights_from_tensor(self, body):
        with self.model_update():
            return self._update_weights_from_tensor(body)

    def _update_weights_from_tensor(self, body):
        expect(body, {"serialized_named_tensors": list, "load_format": str, "flush_cache": bool,
                      "weight_version": (str, type(None))})
        self.require_session("update_weights_from_tensor")
        if body["load_format"] != "flattened_bucket" or len(body["serialized_named_tensors"]) != self.args.tp_size:
            raise BadRequest("expected one flattened bucket per TP rank")
        if "weights" in self.released:
            raise BadRequest("weights are released; resume them before pushing weights")
        received = []
        for payload in body["serialized_named_tensors"]:  # what TP rank i would open (on its own node)
            try:
                bucket = SafeUnpickler(io.BytesIO(base64.b64decode(payload))).load()
            except pickle.UnpicklingError as error:
                print(f"scheduler: {error}", flush=True)
                os._exit(1)  # as SGLang's scheduler, which the error ends, and the server with it
            flat = bucket["flattened_tensor"]
            if flat.dim() != 1 or flat.dtype != torch.uint8:
                raise BadRequest("flattened_tensor must be 1-D uint8")
            received.append({m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).cpu().clone()
                             for m in bucket["metadata"]})
        if any(names.keys() != received[0].keys() or any(not torch.equal(names[n], received[0][n]) for n in names)
               for names in received):
            raise BadRequest("the TP ranks' copies of a bucket differ")
        for name, tensor in received[0].items():
            self.weights[name] = tensor
        time.sleep(self.args.fake_load_s)  # the model's load of the bucket, which SGLang answers after
        if body["weight_version"] is not None:
            self.weight_version = body["weight_version"]
        self.record("/update_weights_from_tensor", names=list(received[0]),
                    distinct_payloads=len(set(body["serialized_named_tensors"])),
                    modules=sorted({type(m).__module__ for m in bucket["metadata"]}))
        return {"success": True, "message": "Succeeded to update model weights."}

    def require_session(self, what):
        if self.has_sessions and not self.session:
            raise BadRequest(f"{what} must run between begin_weight_update() and end_weight_update()")

    def weight_update_session(self, path, body):
        if not self.has_sessions:
            raise NotFound(path)
        opening = path == "/begin_weight_update"
        if self.session == opening:
            raise BadRequest("a weight-update session is already open" if opening else "no weight-update session")
        self.session = opening
        self.record(path)
        return {"success": True, "message": "Success"}

    def flush_cache(self, timeout_s=0.0):
        """As SGLang's: refused while a request is in flight; with `?timeout=` it first waits that long for none."""
        with self.settled:
            if not self.settled.wait_for(lambda: not self.in_flight, timeout_s):
                raise BadRequest("Cache not flushed because there are pending requests")
        self.record("/flush_cache")

    def health_generate(self):
        """SGLang's /health: a one-token generation, which waits while generation is paused, and is a request in
        flight meanwhile (it keeps the server from being idle, even after its client gave up)."""
        if not self.nodes_joined.is_set():
            return 503
        with self.settled:
            self.waiting_health += 1
        try:
            healthy = self.unpaused.wait(timeout=HEALTH_CHECK_TIMEOUT_S)
            self.unhealthy = not healthy
            return 200 if healthy else 503
        finally:
            with self.settled:
                self.waiting_health -= 1

    def relay(self, path, body):
        """Node 0: the call to every other node, which takes its part in it meanwhile (follow_node_zero)."""
        for peer in self.peers:
            peer.sendall((json.dumps({"path": path, "body": body}) + "\n").encode())

    def init_weights_update_group(self, body):
        expect(body, {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
                      "group_name": str, "backend": str})
        self.relay("/init_weights_update_group", body)
        self.join_group(body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def join_group(self, body):
        """This node's TP rank joins: rank_offset plus the node's first TP rank."""
        from rlmegatron.rollout.sglang.protocol import init_custom_process_group

        rank = body["rank_offset"] + self.args.node_rank * (self.args.tp_size // self.args.nnodes)
        self.groups[body["group_name"]] = init_custom_process_group(
            body["backend"], f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
            rank, body["group_name"])
        self.record("/init_weights_update_group", **body, node_rank=self.args.node_rank)

    def update_weights_from_distributed(self, body):
        expect(body, {"names": list, "dtypes": list, "shapes": list, "group_name": str, "flush_cache": bool,
                      "weight_version": (str, type(None))})
        self.require_session("update_weights_from_distributed")
        group = self.groups[body["group_name"]]
        self.pushes += 1
        if self.pushes == self.args.fake_die_on_push and self.first_to_die():
            os._exit(3)  # announced, before the broadcast: the trainer's side of it is left waiting
        self.relay("/update_weights_from_distributed", body)
        with self.model_update():
            self.receive_bucket(body)
        return {"success": True, "message": "Succeeded to update parameter online."}

    def receive_bucket(self, body):
        started = time.time()  # with `ended`, when this rank took part: whether servers took their turns apart
        group = self.groups[body["group_name"]]
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(tensor, group_src=0, group=group)
            self.weights[name] = tensor
        time.sleep(self.args.fake_load_s)  # the model's load of the bucket, which SGLang answers after
        if body["weight_version"] is not None:
            self.weight_version = body["weight_version"]
        self.record("/update_weights_from_distributed", names=body["names"], node_rank=self.args.node_rank,
                    version=self.weight_version, digests={n: tensor_digest(self.weights[n])[2] for n in body["names"]},
                    started=started, ended=time.time())

    def load_lora_adapter(self, body):
        expect(body, {"lora_name": str, "lora_path": str})
        if not self.args.enable_lora:
            raise BadRequest("LoRA adapters need --enable-lora")
        from safetensors.torch import load_file

        config = json.load(open(os.path.join(body["lora_path"], "adapter_config.json")))
        if config["r"] > self.args.max_lora_rank or config["peft_type"] != "LORA":
            raise BadRequest(f"adapter rank {config['r']} over --max-lora-rank {self.args.max_lora_rank}")
        tensors = load_file(os.path.join(body["lora_path"], "adapter_model.safetensors"))
        self.adapters[body["lora_name"]] = tensors
        self.record("/load_lora_adapter", **body, tensors={n: tensor_digest(t) for n, t in tensors.items()})
        return {"success": True, "message": ""}

    def unload_lora_adapter(self, body):
        expect(body, {"lora_name": str})
        if self.adapters.pop(body["lora_name"], None) is None:
            raise BadRequest(f"no LoRA adapter {body['lora_name']!r} is loaded")
        self.record("/unload_lora_adapter", **body)
        return {"success": True, "message": ""}

    def memory(self, path, body):
        expect(body, {"tags": list})
        if not self.args.enable_memory_saver:
            raise BadRequest("memory occupation control needs --enable-memory-saver")
        if not set(body["tags"]) <= TAGS:
            raise BadRequest(f"unknown tags {body['tags']}")
        if path == "/release_memory_occupation":
            if self.in_flight or self.waiting_health:
                print("AssertionError: release_memory_occupation should be called only when server is idle",
                      flush=True)
                os._exit(1)  # SGLang's scheduler asserts an idle scheduler, which ends the server
            self.released |= set(body["tags"])
        elif not set(body["tags"]) <= self.released:
            print(f"KeyError: resume of {sorted(set(body['tags']) - self.released)}, never released", flush=True)
            os._exit(1)  # SGLang's scheduler raises (offload_tags.remove), which ends the server
        else:
            self.released -= set(body["tags"])
        self.record(path, tags=body["tags"])
        return {"success": True, "message": ""}


def make_handler(server):
    posts = {
        "/generate": server.generate,
        "/update_weights_from_tensor": server.update_weights_from_tensor,
        "/init_weights_update_group": server.init_weights_update_group,
        "/update_weights_from_distributed": server.update_weights_from_distributed,
        "/load_lora_adapter": server.load_lora_adapter,
        "/unload_lora_adapter": server.unload_lora_adapter,
        "/release_memory_occupation": lambda body: server.memory("/release_memory_occupation", body),
        "/resume_memory_occupation": lambda body: server.memory("/resume_memory_occupation", body),
        "/begin_weight_update": lambda body: server.weight_update_session("/begin_weight_update", body),
        "/end_weight_update": lambda body: server.weight_update_session("/end_weight_update", body),
    }
    control = {"/pause_generation", "/continue_generation", "/flush_cache"}

    class Handler(JSONHandler):
        def reply(self, code, payload=None):
            super().reply(code, b"" if payload is None else json.dumps(payload).encode())

        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                self.reply(server.health_generate())
            elif self.path == "/ping":
                self.reply(200 if server.nodes_joined.is_set() and not server.unhealthy else 503)
            elif self.path == "/server_info":
                self.reply(200, {"version": server.args.fake_version})
            elif self.path == "/fake/progress":
                self.reply(200, {"tokens": server.tokens_generated})
            elif self.path == "/fake/weights":
                self.reply(200, {"version": server.weight_version,
                                 "weights": {n: tensor_digest(t) for n, t in server.weights.items()}})
            else:
                self.reply(404, {"error": self.path})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path, _, query = self.path.partition("?")
            try:
                if path in control:
                    if path == "/flush_cache":
                        server.flush_cache(float(urllib.parse.parse_qs(query).get("timeout", ["0"])[0]))
                    else:
                        server.record(path)
                    if path == "/pause_generation":
                        server.pause()
                    elif path == "/continue_generation":
                        server.aborting = False
                        server.unpaused.set()
                    self.reply(200)
                elif path in posts:
                    self.reply(200, posts[path](body))
                else:
                    self.reply(404, {"error": path})
            except BadRequest as error:
                self.reply(400, {"success": False, "message": str(error)})
            except NotFound as error:
                self.reply(404, {"detail": f"{error} not found"})

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-dp-attention", action="store_true")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default="")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=0)
    parser.add_argument("--lora-target-modules", nargs="*", default=[])
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--fake-record", required=True)
    parser.add_argument("--fake-marker", default="")
    parser.add_argument("--fake-die-after-generates", type=int, default=0)
    parser.add_argument("--fake-die-on-push", type=int, default=0)
    parser.add_argument("--fake-fail-start", default="")
    parser.add_argument("--fake-slow-start", type=float, default=0.0)
    parser.add_argument("--fake-token-delay", type=float, default=0.0)
    parser.add_argument("--fake-load-s", type=float, default=0.0)
    parser.add_argument("--fake-version", default="0.5.23")
    parser.add_argument("--fake-max-running", type=int, default=0)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    args = parser.parse_args()
    print(f"fake sglang server pid {os.getpid()} args {vars(args)}", flush=True)
    print(f"fake sglang server argv {json.dumps(sys.argv[1:])}", flush=True)  # the command line, as launched
    if args.nnodes > 1 and args.tp_size != args.nnodes:
        print("the fake server spans nodes with one TP rank per node: --tp-size must equal --nnodes", flush=True)
        raise SystemExit(1)
    if args.fake_fail_start:
        print(args.fake_fail_start, flush=True)
        raise SystemExit(1)
    time.sleep(args.fake_slow_start)
    accept_device_uuids()
    server = FakeServer(args)
    if args.node_rank > 0:
        follow_node_zero(args, server)
    if args.nnodes > 1:
        threading.Thread(target=gather_nodes, args=(args, server), daemon=True).start()
    else:
        server.nodes_joined.set()
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(server))
    httpd.daemon_threads = True
    httpd.serve_forever()


def gather_nodes(args, server):
    host, port = args.dist_init_addr.rsplit(":", 1)
    listener = socket.create_server(("", int(port)))
    peers = [listener.accept()[0] for _ in range(args.nnodes - 1)]
    server.peers = peers
    server.record("/fake/nodes_joined", nnodes=args.nnodes)
    server.nodes_joined.set()
    for peer in peers:
        threading.Thread(target=end_with, args=(peer,), daemon=True).start()


def follow_node_zero(args, server):
    """A later node: joins node 0, takes its part in each weight update node 0 hands on, and lives exactly as long
    as node 0 does."""
    host, port = args.dist_init_addr.rsplit(":", 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            node_zero = socket.create_connection((host, int(port)))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    parts = {"/init_weights_update_group": server.join_group, "/update_weights_from_distributed": server.receive_bucket}
    for line in node_zero.makefile("r"):
        call = json.loads(line)
        parts[call["path"]](call["body"])
    os._exit(5)  # node 0 is gone


def end_with(peer):
    """Losing a node aborts the server, as a broken NCCL communicator does."""
    while peer.recv(1):
        pass
    os._exit(5)


if __name__ == "__main__":
    main()
