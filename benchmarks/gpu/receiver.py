"""The receiving side of the colocated weight sync: a second process on the trainer's device, standing in for an
SGLang server, with a transformers model inside rlmegatron's LocalEngine.

It gets `update_weights_from_tensor` payloads exactly as `share_buckets` makes them for SGLang (base64 pickles of
{"flattened_tensor", "metadata"}; the tensor a CUDA-IPC handle naming its device by UUID, or a CPU shared-memory
file), opens them as SGLang does (metadata class resolved by name, device UUID mapped to a local index), copies each
bucket into its own model's tensors with `LocalEngine.update_weights`, and answers only once the copy is done, so the
sender may overwrite its reused bucket buffer. It then serves the generation benchmark from the synced weights.
"""
from __future__ import annotations

import base64
import hashlib
import io
import pickle
import time
import traceback

import torch

from rlmegatron.rollout.buckets import FlattenedBucket, FlattenedTensorMetadata
from rlmegatron.rollout.sglang.protocol import SGLANG_METADATA_CLASS, SGLANG_METADATA_MODULE


def _rebuild_cuda_tensor_by_uuid(*args):
    """torch's rebuild_cuda_tensor with the device given by UUID (see rollout/sglang/protocol.cuda_tensor_reduction)."""
    from torch.multiprocessing import reductions

    device = args[6]
    if isinstance(device, str):
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if device not in uuids:
            raise ValueError(f"bucket on GPU {device}, which this process does not see (it sees {uuids})")
        device = uuids.index(device)
    return reductions.rebuild_cuda_tensor(*args[:6], device, *args[7:])


class _PayloadUnpickler(pickle.Unpickler):
    """What SGLang resolves by its own imports (its metadata class, its patched rebuild), resolved without sglang."""

    def find_class(self, module, name):
        if (module, name) == (SGLANG_METADATA_MODULE, SGLANG_METADATA_CLASS):
            return FlattenedTensorMetadata
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_by_uuid
        return super().find_class(module, name)


def open_payload(payload: str) -> FlattenedBucket:
    content = _PayloadUnpickler(io.BytesIO(base64.b64decode(payload))).load()
    return FlattenedBucket(content["flattened_tensor"], list(content["metadata"]))


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()).hexdigest()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_engine(model_dir: str, dtype: torch.dtype, device: str):
    """A LocalEngine around a randomly initialised transformers model of `model_dir`'s config.json, on `device`.
    No EOS ids: every sample runs to its max_new_tokens, so the generation benchmark counts a fixed number."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlmegatron.rollout.local import LocalEngine

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return LocalEngine(model, pad_token_id=0, eos_token_ids=(), max_batch_size=1 << 16)


def generation_benchmark(engine, device: str, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    """New tokens per second for `batch` prompts of `prompt_len` random tokens, each generating `new_tokens`
    (prefill included in the time), sampled at temperature 1 (as rollouts are) and greedy."""
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec

    generator = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(1, vocab, (prompt_len,), generator=generator).tolist()) for _ in range(batch)]

    def requests(tokens: int, temperature: float):
        return [GenerationRequest(p, SamplingSpec(temperature=temperature, max_new_tokens=tokens, seed=i))
                for i, p in enumerate(prompts)]

    # Warm-up at full length: cuDNN's attention builds a plan per KV length on first sight (1.7 ms of CPU per decode
    # step on an H100), which a short warm-up left to whichever mode ran first.
    engine.generate(requests(new_tokens, 1.0))
    rows = {}
    for mode, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        synchronize(device)
        start = time.perf_counter()
        results = engine.generate(requests(new_tokens, temperature))
        synchronize(device)
        seconds = time.perf_counter() - start
        generated = sum(len(r.output_token_ids) for r in results)
        rows[mode] = {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "seconds": seconds,
                      "generated_tokens": generated, "tokens_per_s": generated / seconds}
    return rows


def main(conn, model_dir: str, dtype: torch.dtype, device: str) -> None:
    """Serve the sender over `conn` until it says stop. Every answer is ("ok", value) or ("error", traceback)."""
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        engine = build_engine(model_dir, dtype, device)
        conn.send(("ok", "ready"))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    held: list = []  # the last bucket, while the sender asks to keep its mapping (see "keep")
    while True:
        kind, body = conn.recv()
        if kind == "stop":
            return
        try:
            if kind == "bucket":  # one payload per server TP rank; this server has one
                (payload,) = body["payloads"]
                start = time.perf_counter()
                bucket = open_payload(payload)
                synchronize(device)
                opened = time.perf_counter()
                # What arrived, byte for byte (a verification pass; the timed ones skip it).
                answer = {name: digest(t) for name, t in bucket.named_tensors()} if body["digest"] else None
                engine.update_weights([bucket], body["version"])
                synchronize(device)  # copied, so the sender may reuse its buffer
                if answer is None:
                    answer = {"open_s": opened - start, "copy_s": time.perf_counter() - opened}
                # Holding the last bucket keeps its CUDA-IPC mapping in torch's cache, so a sender that reuses its
                # buffer is not mapped anew for every bucket; SGLang drops it (the `keep` off measures that).
                held[:] = [bucket] if body.get("keep") else []
                del bucket
            elif kind == "digests":
                from rlmegatron.rollout.local import checkpoint_named_weights

                weights = checkpoint_named_weights(engine.model)
                answer = {name: digest(weights[name]) for name in body}
            elif kind == "generate":
                answer = generation_benchmark(engine, device, **body)
            else:
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("ok", answer))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
