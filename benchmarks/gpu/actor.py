"""The actor process of the GPU harness, one rank, no Ray: the model is built once for three measurements.

1. MFU: the Megatron actor (`ActorWorker`, local non-TE layer spec) trains on synthetic full-length sequences;
   the micro-batch doubles from 1 until it runs out of memory (or past --max-micro-batch, or the time budget), and
   the last size that fit is the result. Both batch layouts the actor has are measured: `packed` (THD, what every
   `rlm train` step runs) and `padded` (one row per sequence; the rows are full, so nothing is padding).
2. Weight sync: the actor's HF-named export stream -> `share_buckets` (the colocated SGLang path: flattened buckets,
   CUDA-IPC handles or CPU shared memory) -> a receiver process on the same device that opens each bucket and copies
   it into its own model (benchmarks/gpu/receiver.py); GB/s against a device-to-device copy of the same bytes, and
   every tensor's bytes compared after.
3. Generation: that receiver's LocalEngine, holding the synced weights, generates for a batch of prompts.

FLOPs (model FLOPs, PaLM's appendix B formula): per sequence of s tokens, 6*N*s + 12*L*H*s^2, where N is the matmul
parameters a token goes through (every weight matrix but the input embedding, plus the output projection,
hidden x vocabulary, counted once when it is tied to the embedding), L the layers and H = heads x head_dim. Attention
is counted without the causal discount and per sequence, whatever the batch layout: work spent across packed
sequences is not model FLOPs.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback

import torch

from benchmarks.gpu import receiver
from rlmegatron.models.hf_config import DTYPES

# bf16 dense tensor-core peaks (TFLOP/s) from NVIDIA's datasheets, matched against torch's device name.
GPU_BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                        ("H800", 989.0), ("GH200", 989.0), ("A100", 312.0))


def peak_tflops(device: str, dtype: str, given: float | None) -> tuple[float | None, str]:
    """(peak, where it comes from); None with the reason when there is no honest number."""
    if given:
        return given, "--peak-tflops"
    if device != "cuda":
        return None, "no nominal peak for a CPU; pass --peak-tflops to compute an MFU"
    if dtype != "bf16":
        return None, f"the table holds bf16 peaks, and the model is {dtype}; pass --peak-tflops"
    name = torch.cuda.get_device_name()
    for key, value in GPU_BF16_PEAK_TFLOPS:
        if key in name:
            return value, f"bf16 dense peak of {name}"
    return None, f"no known bf16 peak for {name}; pass --peak-tflops"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, torch.cuda.OutOfMemoryError) or "CUBLAS_STATUS_ALLOC_FAILED" in text \
        or "out of memory" in text.lower()


def machine_info(device: str) -> dict:
    import megatron.core
    import transformers

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "megatron_core": megatron.core.__version__,
            "transformers": transformers.__version__}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_memory_gb=round(props.total_memory / 1e9, 1))
    else:
        info["device_name"] = f"CPU ({os.cpu_count()} cores)"
    return info


def start_rank(device: str) -> None:
    """A world of one: the default process group (nccl or gloo) and Megatron's groups at TP=PP=1."""
    from rlmegatron.runtime import ParallelLayout, init_distributed, init_model_parallel
    from rlmegatron.runtime.distributed import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_distributed(device)
    init_model_parallel(ParallelLayout())


def build_actor(model_dir: str, dtype: str, device: str):
    """The actor as PolicyRank builds it, from the model directory's config.json, randomly initialised."""
    from rlmegatron.models.hf_config import build_gpt_model, model_facts, read_hf_config, transformer_config
    from rlmegatron.runtime import ParallelLayout
    from rlmegatron.rank.roles import ActorSettings, ActorWorker, OptimizerSettings

    facts = model_facts(read_hf_config(model_dir), tp=1)
    # On a GPU the weights are initialised there: Megatron's CPU initialisation of a billion parameters takes minutes.
    config = transformer_config(facts, ParallelLayout(), dtype=dtype,
                                options={"use_cpu_initialization": False} if device == "cuda" else None)
    settings = ActorSettings(vocab_size=facts.vocab_size, optimizer=OptimizerSettings(lr=1e-6))
    actor = ActorWorker(settings, lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), ParallelLayout())
    actor.init(parallel_state_ready=True)
    return facts, actor


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """Full-length sequences (no padding), advantages and old log-probs as a GRPO step hands them to the actor."""
    from rlmegatron.rank.roles import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    length = prompt_len + response_len
    return RolloutBatch(
        input_ids=torch.randint(0, vocab, (rows, length), generator=generator),
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        response_mask=torch.ones(rows, response_len),
        advantages=torch.randn(rows, response_len, generator=generator),
        old_log_probs=torch.full((rows, response_len), -math.log(vocab)),
    )


def matmul_parameters(actor, facts) -> int:
    """N of the FLOPs formula (see the module docstring)."""
    from rlmegatron.rank.roles.megatron_step import unwrap

    model = unwrap(actor.chunks[0])
    inner = sum(p.numel() for name, p in model.named_parameters()
                if p.dim() >= 2 and "word_embeddings" not in name and "output_layer" not in name)
    return inner + facts.vocab_size * model.config.hidden_size


def flops_per_sequence(n_params: int, config, seq_len: int) -> float:
    attention_width = config.num_attention_heads * config.kv_channels
    return 6.0 * n_params * seq_len + 12.0 * config.num_layers * attention_width * seq_len ** 2


@contextlib.contextmanager
def timed_optimizer_step(actor, device: str, seconds: list):
    """Times each optimizer step (synchronised), so fwd+bwd is the update's time less its optimizer steps."""
    step = actor.optimizer.step

    def timed():
        synchronize(device)
        start = time.perf_counter()
        result = step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        return result

    actor.optimizer.step = timed
    try:
        yield
    finally:
        del actor.optimizer.step  # the instance attribute goes; the class's bound method is back


def release_memory(actor, device: str) -> None:
    for chunk in actor.chunks:
        chunk.zero_grad_buffer()
    actor.optimizer.zero_grad()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def mfu_trial(actor, facts, args, micro_batch: int, packed: bool, flops_n: int, trial_limit_s: float) -> dict:
    """One micro-batch size: a warm-up update, then timed updates of `accumulation` micro-batches each."""
    rows = micro_batch * args.accumulation
    seq_len = args.prompt_len + args.response_len
    actor.settings = dataclasses.replace(actor.settings, micro_batch_size=micro_batch, ppo_mini_batch_size=rows,
                                         use_packing=packed, max_token_len=None)
    batch = synthetic_batch(rows, args.prompt_len, args.response_len, facts.vocab_size, seed=micro_batch)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    update_s, optimizer_s = [], []
    with timed_optimizer_step(actor, args.device, optimizer_s):
        for repeat in range(1 + args.repeats):
            synchronize(args.device)
            start = time.perf_counter()
            actor.update(batch)
            synchronize(args.device)
            update_s.append(time.perf_counter() - start)
            if repeat == 0 and update_s[0] * args.repeats > trial_limit_s:
                break  # too slow to repeat within the budget: the warm-up is the measurement
    timed = slice(1, None) if len(update_s) > 1 else slice(0, 1)
    update = min(update_s[timed])
    optimizer = optimizer_s[update_s.index(update)]
    flops = rows * flops_per_sequence(flops_n, model_config(actor), seq_len)
    return {"micro_batch": micro_batch, "tokens_per_micro_batch": micro_batch * seq_len, "rows_per_update": rows,
            "update_s": update, "optimizer_s": optimizer, "fwd_bwd_s": update - optimizer, "flops_per_update": flops,
            "fwd_bwd_tflops": flops / (update - optimizer) / 1e12, "update_tflops": flops / update / 1e12,
            "timed_updates": len(update_s[timed]),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else None}


def model_config(actor):
    from rlmegatron.rank.roles.megatron_step import unwrap

    return unwrap(actor.chunks[0]).config


def mfu_benchmark(actor, facts, args, peak: float | None, peak_source: str, deadline: float) -> dict:
    """For each batch layout, the micro-batch doubles from 1 until out of memory, past --max-micro-batch, or past
    the layout's share of the time left before `deadline`."""
    flops_n = matmul_parameters(actor, facts)
    modes = {}
    for index, mode in enumerate(args.mfu_modes):
        mode_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(args.mfu_modes) - index)
        trials, stop = [], "reached --max-micro-batch"
        micro_batch = 1
        while micro_batch <= args.max_micro_batch:
            left = mode_deadline - time.monotonic()
            if left <= 0:
                stop = "time budget spent"
                break
            try:
                trial = mfu_trial(actor, facts, args, micro_batch, mode == "packed", flops_n, left)
            except RuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                trials.append({"micro_batch": micro_batch, "oom": True, "error": str(error).splitlines()[0][:200]})
                stop = "out of memory"
                break
            finally:
                release_memory(actor, args.device)
            if peak:
                trial["fwd_bwd_mfu"] = trial["fwd_bwd_tflops"] / peak
                trial["update_mfu"] = trial["update_tflops"] / peak
            trials.append(trial)
            print(f"mfu {mode} micro-batch {micro_batch}: fwd+bwd {trial['fwd_bwd_tflops']:.1f} TFLOP/s "
                  f"({trial['fwd_bwd_s']:.3f} s), optimizer {trial['optimizer_s']:.3f} s", flush=True)
            micro_batch *= 2
        fitted = [t for t in trials if not t.get("oom")]
        modes[mode] = {"trials": trials, "search_stopped": stop, "largest": fitted[-1] if fitted else None}
    return {"matmul_parameters": flops_n, "seq_len": args.prompt_len + args.response_len,
            "accumulation": args.accumulation, "peak_tflops": peak, "peak_source": peak_source,
            "flops_formula": "6*N*s + 12*L*heads*head_dim*s^2 per sequence (PaLM appendix B; no causal discount)",
            "modes": modes}


class Receiver:
    """The receiver process (receiver.py) and the request/answer pipe to it."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=receiver.main, args=(child, model_dir, dtype, device), daemon=True)
        self.process.start()
        self.wait()

    def wait(self):
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"the receiver failed:\n{value}")
        return value

    def ask(self, kind: str, body=None):
        self.conn.send((kind, body))
        return self.wait()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop", None))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def best_time(run, device: str, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def device_copy_seconds(nbytes: int, device: str, repeats: int) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return best_time(lambda: target.copy_(source), device, repeats)


def sync_benchmark(actor, facts, args, peer: Receiver) -> dict:
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.rollout.buckets import Bucketer, travel_rules_for
    from rlmegatron.rollout.sglang.weight_push import share_buckets

    exporter = HFWeightExporter(actor.chunks, WeightMap(facts))
    sizes = {name: tensor.nbytes for name, tensor in exporter.stream()}
    total = sum(sizes.values())
    bucket_bytes = int(args.bucket_mb * 2**20)
    rules = travel_rules_for(facts.hf)
    device = args.device
    versions = iter(range(1 << 30))
    arrived: dict = {}
    posts: list = []

    receiver_seconds = collections.defaultdict(list)

    def sync(verify: bool = False, keep: bool = False):
        def post(payloads):
            answer = peer.ask("bucket", {"payloads": payloads, "version": str(next(versions)), "digest": verify,
                                         "keep": keep})
            if verify:
                arrived.update(answer)
            else:
                for name, value in answer.items():
                    receiver_seconds[(keep, name)].append(value)
            posts.append(verify)

        share_buckets(exporter.stream(), bucket_bytes, rules, 1, None, post)

    def export_and_bucket():  # the sender's share of the work, nothing handed over
        collections.deque(Bucketer(bucket_bytes, rules, reuse_buffer=True, shared_memory=True).buckets(
            exporter.stream()), maxlen=0)

    # The receiver's model holds each tensor in its own dtype (the local spec keeps norm weights in fp32 in a bf16
    # model; copy_ rounds them): it must hold exactly the sent values after that rounding.
    dtype = DTYPES[args.dtype]
    sent = {name: receiver.digest(tensor) for name, tensor in exporter.stream()}
    held = {name: receiver.digest(tensor.to(dtype)) for name, tensor in exporter.stream()}
    before = peer.ask("digests", list(sizes))
    seconds = {
        "export_only": best_time(lambda: collections.deque(exporter.stream(), maxlen=0), device, args.repeats),
        "export_and_bucket": best_time(export_and_bucket, device, args.repeats),
        "sync": best_time(sync, device, args.repeats),
        "sync_receiver_keeps_mapping": best_time(lambda: sync(keep=True), device, args.repeats),
        "device_copy": device_copy_seconds(total, device, args.repeats),
    }
    sync(verify=True)  # untimed: the receiver hashes every tensor as it arrived, before loading it
    after = peer.ask("digests", list(sizes))
    rates = {name: total / 1e9 / value for name, value in seconds.items()}
    return {"bytes": total, "tensors": len(sizes), "elements": sum(t.numel() for _, t in exporter.stream()),
            "bucket_bytes": bucket_bytes, "buckets": posts.count(True),
            "largest_tensor_bytes": max(sizes.values()),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for _, t in exporter.stream()}),
            "seconds": seconds, "gb_per_s": rates,
            # Per bucket, the median over the timed syncs: mapping the CUDA-IPC handle, and the copy into the model.
            "receiver_bucket_s": {f"{name}{'_kept' if keep else ''}": statistics.median(values)
                                  for (keep, name), values in receiver_seconds.items()}, "sync_vs_device_copy": rates["sync"] / rates["device_copy"],
            "arrived_bitwise": arrived == sent,
            "arrived_mismatched": sorted(n for n in sent if arrived.get(n) != sent[n])[:10],
            "receiver_differed_before": sum(before[n] != held[n] for n in sizes),
            "receiver_equal_after": after == held,
            "receiver_mismatched": sorted(n for n in sizes if after[n] != held[n])[:10]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--model", required=True, help="directory with the HF config.json")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--result", required=True, help="JSON written after every stage")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-micro-batch", type=int, default=1024)
    parser.add_argument("--mfu-modes", nargs="+", choices=["packed", "padded"], default=["packed", "padded"])
    parser.add_argument("--mfu-budget-s", type=float, default=180.0)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--bucket-mb", type=float, required=True)
    parser.add_argument("--gen-batch", type=int, default=64)
    parser.add_argument("--gen-prompt-len", type=int, default=256)
    parser.add_argument("--gen-new-tokens", type=int, default=256)
    args = parser.parse_args()

    result: dict = {"machine": machine_info(args.device)}

    def save() -> None:
        with open(args.result, "w") as handle:
            json.dump(result, handle, indent=1)

    def stage(name: str, run) -> bool:
        start = time.perf_counter()
        try:
            result[name] = run()
            ok = True
        except Exception:
            result[name] = {"error": traceback.format_exc()[-4000:]}
            print(f"{name} failed:\n{result[name]['error']}", file=sys.stderr, flush=True)
            ok = False
        result[name]["wall_s"] = time.perf_counter() - start
        save()
        return ok

    if args.device == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")  # CPU buckets reach an unrelated process
    start_rank(args.device)
    built: dict = {}

    def build():
        built["facts"], built["actor"] = build_actor(args.model, args.dtype, args.device)
        return {"model": args.model, "dtype": args.dtype,
                "parameters": sum(p.numel() for p in built["actor"].chunks[0].parameters())}

    if not stage("model", build):
        sys.exit(1)
    facts, actor = built["facts"], built["actor"]
    peak, peak_source = peak_tflops(args.device, args.dtype, args.peak_tflops)
    deadline = time.monotonic() + args.mfu_budget_s
    stage("mfu", lambda: mfu_benchmark(actor, facts, args, peak, peak_source, deadline))
    peer = None
    try:
        def start_receiver():
            nonlocal peer
            peer = Receiver(args.model, DTYPES[args.dtype], args.device)
            return {"started": True}

        if stage("receiver", start_receiver):
            stage("sync", lambda: sync_benchmark(actor, facts, args, peer))
            stage("generate", lambda: peer.ask("generate", {
                "batch": args.gen_batch, "prompt_len": args.gen_prompt_len, "new_tokens": args.gen_new_tokens,
                "vocab": facts.vocab_size}))
    finally:
        if peer is not None:
            peer.stop()
    forbidden = sorted({name.split(".")[0] for name in sys.modules} & {"ray", "mlflow", "sglang", "transformer_engine"})
    result["forbidden_modules_imported"] = forbidden
    save()


if __name__ == "__main__":
    main()
