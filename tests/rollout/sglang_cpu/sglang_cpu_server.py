"""SGLang's own server code on a CPU, launched as `python -m sglang_cpu_server <sglang.launch_server's flags>`.

Real SGLang (the installed `sglang` package): the flags are parsed, resolved and checked by its `ServerArgs`; requests
are served by its FastAPI app (`entrypoints/http_server.py`: request parsing, `/health`'s one-token generation, status
codes); the tokenizer manager's control methods run as SGLang wrote them (pause and its abort loop, the model-update
lock, the weight-update session calls, LoRA registry, flush); behind them, SGLang's scheduler-side
`SchedulerWeightUpdaterManager` (sessions, memory tags) and `SchedulerFlushWrapper`, and the model runner's
`WeightUpdater`, which unpickles the buckets with SGLang's `MultiprocessingSerializer` and rebuilds them with its
`FlattenedTensorBucket`, or joins the weight-update group and receives the broadcasts.

Stood in for: the model (it records what `load_weights` is handed and generates a token sequence that depends on
those weights, `tokens`), the memory saver (it records which tags are released), and the scheduler loop, which runs
requests (one thread for control requests, like SGLang's event loop, so a control request that raises ends the
server as a scheduler exception does) and holds the queue whose emptiness decides whether a flush may run.

Stand-in knobs, as environment variables: RLM_SGLANG_CPU_TOKEN_DELAY (seconds per generated token),
RLM_SGLANG_CPU_MAX_RUNNING (requests that run at once; the others wait in the scheduler's waiting queue, and an
abort answers them as SGLang's tokenizer manager answers a waiting-queue abort: no tokens, no routed experts, no
prompt_tokens).
Test-only routes: GET /standin/model (digests of the tensors the model was handed, memory tags released, adapters,
how many flushes of the cache ran), GET /standin/progress (tokens generated so far).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gpu_stubs
from standin_routing import ROUTED_LAYERS, ROUTED_TOPK, standin_expert

gpu_stubs.install()

import torch  # noqa: E402
import uvicorn  # noqa: E402
from sglang.srt.entrypoints import http_server  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARegistry  # noqa: E402
from sglang.srt.managers.detokenizer_manager import DetokenizerManager  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper  # noqa: E402
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager  # noqa: E402
from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin  # noqa: E402
from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager  # noqa: E402
from sglang.srt.managers.tp_worker import TpModelWorker  # noqa: E402
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater  # noqa: E402
from sglang.srt.runtime_context import get_lora, get_parallel, publish  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.utils.aio_rwlock import RWLock  # noqa: E402

VOCAB = 1000


def digest(tensor: torch.Tensor) -> list:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
            hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]


class StandInModel(torch.nn.Module):
    """The model: keeps a copy of every tensor `load_weights` is handed, as SGLang's updaters hand them."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            self.received[name] = tensor.detach().clone()

    def checksum(self) -> int:
        return int(sum(float(t.double().sum()) for t in self.received.values()) * 1000) % 997


class StandInMemorySaver:
    """The memory saver: which tags are released. SGLang's manager decides what to pause and resume."""

    def __init__(self) -> None:
        self.paused: set[str] = set()

    def pause(self, tag: str) -> None:
        self.paused.add(tag)

    def resume(self, tag: str) -> None:
        self.paused.discard(tag)


class StandInScheduler:
    """The scheduler loop: control requests on one thread, through SGLang's own scheduler-side handlers."""

    def __init__(self, memory_saver_enabled: bool, custom_weight_loaders: list[str]) -> None:
        self.model = StandInModel()
        self.memory_saver = StandInMemorySaver()
        self.adapters: dict[str, dict] = {}
        self.running: dict[str, dict] = {}  # rid -> {"aborted": bool}
        self.tokens_generated = 0
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scheduler")
        runner_updater = WeightUpdater(
            # As ModelRunner hands it over: the server's --custom-weight-loader list.
            tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=custom_weight_loaders,
            get_model=lambda: self.model, update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None,
        )
        runner = type("ModelRunner", (), {"weight_updater": runner_updater, "model": self.model})()
        worker = type("TpWorker", (), {})()
        worker.model_runner = runner
        worker.weight_update_runners = lambda: [("target", runner)]
        worker.init_weights_update_group = lambda req: runner_updater.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend)
        worker.deserialize_own_rank = lambda payloads: TpModelWorker.deserialize_own_rank(worker, payloads)
        self.engine_paused = False
        self.flushes = 0
        self.waiting: list[str] = []  # rids in the waiting queue, in arrival order
        self.updates = SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, memory_saver_adapter=self.memory_saver,
            flush_cache=self.flush_cache, is_fully_idle=self.is_fully_idle, scheduler=self,
        )
        self.flush_answers: list = []  # a deferred flush's answer, once SGLang's wrapper sends it
        self.flush = SchedulerFlushWrapper(flush_cache=self.flush_cache, is_fully_idle=self.is_fully_idle,
                                           send_output=lambda output, request: self.flush_answers.append(output))
        self.weight_version = "default"
        self.disaggregation_mode = None
        self._engine_paused = False

    # What SGLang's manager asks of its scheduler.
    def is_fully_idle(self, for_health_check=False, ignore_waiting=False) -> bool:
        return not self.running

    def flush_cache(self, empty_cache: bool = True) -> bool:
        if not self.is_fully_idle():
            return False
        self.flushes += 1
        return True

    def record_weight_version_change(self, new_version) -> None:
        if new_version is not None:
            self.weight_version = new_version

    # The loop.
    async def call(self, request):
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self.thread, self.handle, request)
        if isinstance(request, io_struct.FlushCacheReqInput) and answer is None:
            # A flush with a timeout, deferred while requests run: SGLang's scheduler loop checks it each turn.
            while not self.flush_answers:
                await asyncio.sleep(0.01)
                await loop.run_in_executor(self.thread, self.flush.check_pending)
            answer = self.flush_answers.pop(0)
        return answer

    def handle(self, request):
        try:
            return self._handle(request)
        except BaseException:
            # An exception in SGLang's scheduler loop ends the server (run_scheduler_process: SIGQUIT to its parent).
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)

    def _handle(self, request):
        updates = self.updates
        handlers = {
            io_struct.FlushCacheReqInput: self.flush.handle,
            io_struct.BeginWeightUpdateReqInput: updates.begin_weight_update,
            io_struct.EndWeightUpdateReqInput: updates.end_weight_update,
            io_struct.UpdateWeightsFromTensorReqInput: updates.update_weights_from_tensor,
            io_struct.InitWeightsUpdateGroupReqInput: updates.init_weights_update_group,
            io_struct.UpdateWeightsFromDistributedReqInput: updates.update_weights_from_distributed,
            io_struct.ReleaseMemoryOccupationReqInput: updates.release_memory_occupation,
            io_struct.ResumeMemoryOccupationReqInput: updates.resume_memory_occupation,
            io_struct.LoadLoRAAdapterReqInput: self.load_lora_adapter,
            io_struct.UnloadLoRAAdapterReqInput: self.unload_lora_adapter,
            io_struct.ContinueGenerationReqInput: lambda request: None,
            io_struct.GetInternalStateReq: lambda request: io_struct.GetInternalStateReqOutput(
                internal_state={"weight_version": self.weight_version}),
        }
        return handlers[type(request)](request)

    # The model's LoRA side: adapters read from disk as SGLang's LoRA manager would, checked against its rank.
    def load_lora_adapter(self, request):
        from safetensors.torch import load_file

        config = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
        if config["r"] > get_lora().max_lora_rank:
            return io_struct.LoRAUpdateOutput(success=False, error_message=f"rank {config['r']} over max_lora_rank")
        tensors = load_file(str(Path(request.lora_path) / "adapter_model.safetensors"))
        self.adapters[request.lora_name] = {name: digest(t) for name, t in tensors.items()}
        return io_struct.LoRAUpdateOutput(success=True, loaded_adapters={n: n for n in self.adapters})

    def unload_lora_adapter(self, request):
        self.adapters.pop(request.lora_name)
        return io_struct.LoRAUpdateOutput(success=True, loaded_adapters={n: n for n in self.adapters})

    # Generation: the model's tokens, one per RLM_SGLANG_CPU_TOKEN_DELAY seconds, until done or aborted.
    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams) -> dict:
        state = self.running.setdefault(rid, {"aborted": False})
        try:
            limit = int(os.environ.get("RLM_SGLANG_CPU_MAX_RUNNING", "0"))
            self.waiting.append(rid)
            while limit and self.waiting.index(rid) >= limit and not state["aborted"]:
                await asyncio.sleep(0.01)
            if state["aborted"]:
                # What SGLang's tokenizer manager answers for a request the scheduler aborted in its waiting queue
                # (TokenizerManager._handle_abort_req): no tokens, none of a started request's fields.
                return {"text": "", "output_ids": [], "meta_info": {
                    "id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                    "weight_version": self.weight_version, "e2e_latency": 0.0, "input_token_logprobs": [],
                    "output_token_logprobs": [], "completion_tokens": 0}, "waiting_queue_abort": True}
            delay = float(os.environ.get("RLM_SGLANG_CPU_TOKEN_DELAY", "0"))
            checksum, version = self.model.checksum(), self.weight_version
            output_ids, finish = [], {"type": "length", "length": params.max_new_tokens}
            for step in range(params.max_new_tokens):
                await asyncio.sleep(delay)
                if state["aborted"]:
                    finish = {"type": "abort", "message": "Abort before prefill" if not output_ids else "Abort"}
                    break
                token = (sum(input_ids) + 31 * step + checksum) % VOCAB
                output_ids.append(token)
                self.tokens_generated += 1
                if token in (params.stop_token_ids or ()):
                    finish = {"type": "stop", "matched": token}
                    break
            return {"output_ids": output_ids, "meta_info": {
                "id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                "completion_tokens": len(output_ids), "weight_version": version,
                "output_token_logprobs": [[-0.01 * (i + 1), token, None] for i, token in enumerate(output_ids)]}}
        finally:
            self.running.pop(rid, None)
            if rid in self.waiting:
                self.waiting.remove(rid)

    def abort_all(self) -> None:
        for state in self.running.values():
            state["aborted"] = True


def _borrowed(*names):
    """SGLang's own TokenizerManager methods, run on the stand-in (they read only the attributes it sets)."""
    return {name: getattr(TokenizerManager, name) for name in names}


class StandInTokenizerManager(type("Borrowed", (), _borrowed(
    "pause_generation", "continue_generation", "flush_cache", "init_weights_update_group",
    "_weight_update_session_call", "begin_weight_update", "end_weight_update", "update_weights_from_distributed",
    "update_weights_from_tensor", "release_memory_occupation", "resume_memory_occupation", "load_lora_adapter",
    "_unload_lora_adapter_locked", "unload_lora_adapter", "get_internal_state", "is_healthy",
))):
    """The tokenizer manager's state, with its transport to the scheduler (zmq communicators) replaced by calls."""

    def __init__(self, server_args, scheduler: StandInScheduler) -> None:
        self.server_args = server_args
        self.scheduler = scheduler
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = RWLock()
        self.lora_update_lock = asyncio.Lock()
        self.lora_registry = LoRARegistry()
        self.pending_lora_unloads: dict = {}
        self.lora_ref_cache: dict = {}
        self.mm_processor = None
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.is_generation = True
        self.last_receive_tstamp = time.time()
        self.rid_to_state: dict = {}
        self.startup_time = None
        self.enable_metrics = False
        for name in ("flush_cache", "init_weights_update_group", "begin_weight_update", "end_weight_update",
                     "update_weights_from_distributed", "update_weights_from_tensor", "release_memory_occupation",
                     "resume_memory_occupation", "update_lora_adapter", "get_internal_state"):
            setattr(self, f"{name}_communicator", self._communicate)

    async def _communicate(self, request):
        return [await self.scheduler.call(request)]

    async def _async_dispatch_to_scheduler(self, request):
        await self.scheduler.call(request)

    def auto_create_handle_loop(self) -> None:
        pass

    def _update_weight_version_if_provided(self, weight_version) -> None:
        pass  # the scheduler records it (record_weight_version_after_update), and /generate reports it from there

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.scheduler.abort_all()

    async def generate_request(self, obj, request=None):
        """As SGLang's: wait while paused, then hold the model-update lock as a reader for the whole request."""
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock:
            if obj.lora_path is not None and obj.lora_path not in self.lora_registry.get_all_adapters():
                raise ValueError(f"LoRA adapter {obj.lora_path!r} is not loaded")
            params = SamplingParams(**(obj.sampling_params or {}))
            params.verify(VOCAB)
            rid = obj.rid or f"req-{time.monotonic_ns()}"
            if obj.return_routed_experts and not self.server_args.enable_return_routed_experts:
                raise ValueError("return_routed_experts needs --enable-return-routed-experts")
            answer = await self.scheduler.generate(rid, list(obj.input_ids), params)
            queued = answer.pop("waiting_queue_abort", False)
            if obj.return_routed_experts and not queued:
                # What SGLang's capturer hands the detokenizer: [prompt + output - 1 tokens, layers, top-k] int32,
                # encoded by SGLang's own detokenizer code.
                seen = [*obj.input_ids, *answer["output_ids"]][:-1]
                routed = torch.tensor([[[standin_expert(token, layer, slot) for slot in range(ROUTED_TOPK)]
                                        for layer in range(ROUTED_LAYERS)] for token in seen], dtype=torch.int32)
                answer["meta_info"]["routed_experts"] = DetokenizerManager._b64_encode_per_request([routed])[0]
            self.last_receive_tstamp = time.time()
            yield answer


def main(argv: list[str]) -> None:
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    server_args.check_server_args()
    publish(server_args, role="tokenizer")
    # The default process group SGLang's scheduler process has (the weight-update group is built beside it).
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                         world_size=1)
    # What SGLang's scheduler process writes when it builds its groups: this one is TP rank 0 of a group of one.
    tp_group = type("GroupCoordinator", (), {"cpu_group": torch.distributed.group.WORLD})()
    get_parallel().override_permanently(tp_rank=0, tp_group=tp_group)
    scheduler = StandInScheduler(server_args.enable_memory_saver, server_args.custom_weight_loader or [])
    manager = StandInTokenizerManager(server_args, scheduler)
    http_server.set_global_state(http_server._GlobalState(
        tokenizer_manager=manager, template_manager=None, scheduler_info={}))
    app = http_server.app
    # SGLang's startup hook builds the OpenAI-compatible handlers and runs a warm-up generation; the native endpoints
    # rlmegatron calls need neither.
    app.router.lifespan_context = _no_startup_hook

    @app.get("/standin/model")
    async def model_state():
        return {"weights": {name: digest(t) for name, t in scheduler.model.received.items()},
                "version": scheduler.weight_version, "released": sorted(scheduler.updates.offload_tags),
                "adapters": scheduler.adapters, "flushes": scheduler.flushes}

    @app.get("/standin/progress")
    async def progress():
        return {"tokens": scheduler.tokens_generated}

    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="warning", timeout_keep_alive=5)


@contextlib.asynccontextmanager
async def _no_startup_hook(app):
    yield


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main(sys.argv[1:])
