"""The HTTP side of an SGLang server: a client for its generation, weight and memory endpoints, one for the router in
front of several servers, and the parsing of their answers."""
from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

import torch
from packaging.version import InvalidVersion, Version

from rlmegatron.errors import Divergence, UserError
from rlmegatron.rollout.engine import (
    GenerationResult,
    SamplingSpec,
)
from rlmegatron.rollout.sglang.protocol import (
    RoutedExpertsLayout,
)


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


def tensor_update_body(serialized_named_tensors: list[str], weight_version: str | None, flush_cache: bool = False,
                       load_format: str = "flattened_bucket") -> bytes:
    """The JSON body of `/update_weights_from_tensor`."""
    return json.dumps({"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                       "flush_cache": flush_cache, "weight_version": weight_version}).encode()


class SGLangClient:
    """Endpoints of `sglang/srt/entrypoints/http_server.py`, with field names from `managers/io_struct.py`."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.version: Version | None = None
        """The server's SGLang version, once `check_version` read it."""

    def _call(self, method: str, path: str, payload: dict | bytes | None = None, timeout_s: float | None = None
              ) -> Any:
        """`payload`: a JSON body, or one already encoded (bytes)."""
        data = payload if payload is None or isinstance(payload, bytes) else json.dumps(payload).encode()
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
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as error:
            # HTTPException: an answer cut off or malformed (IncompleteRead, BadStatusLine), the server going away
            raise ServerUnavailable(f"{path}: {error}") from error
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def _post_checked(self, path: str, payload: dict | bytes, timeout_s: float | None = None) -> dict:
        answer = self._call("POST", path, payload, timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SGLangRequestError(f"{path} failed: {answer.get('message')}")
        return answer

    def generate(self, input_ids: list[int], params: dict[str, Any], lora_name: str | None = None,
                 return_routed_experts: bool = False, image_data: list[str] | None = None) -> dict:
        """`lora_name`: the loaded LoRA adapter to sample with (SGLang's `lora_path` names it); None: the base.
        `return_routed_experts`: the answer carries each token's experts (a server launched to record them).
        `image_data`: the prompt's images, base64-encoded, one per image placeholder of `input_ids` (SGLang's
        processor expands each placeholder to its image's grid)."""
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
        if image_data:
            body["image_data"] = image_data
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
        self, serialized_named_tensors: list[str], weight_version: str | None, flush_cache: bool = False,
        load_format: str = "flattened_bucket",
    ) -> dict:
        """One payload per server TP rank; `load_format` flattened_bucket (`serialize_flattened_bucket`) or a custom
        weight loader the server was launched with (`serialize_records`)."""
        return self.post_tensor_update(tensor_update_body(serialized_named_tensors, weight_version, flush_cache,
                                                          load_format))

    def post_tensor_update(self, body: bytes) -> dict:
        """/update_weights_from_tensor with a body `tensor_update_body` encoded (once for every server it goes to)."""
        return self._post_checked("/update_weights_from_tensor", body)

    def weight_digests(self, names: Sequence[str]) -> dict[str, str]:
        """The local engine's server only (rollout/local_server.py): the checksum of each weight named."""
        return self._call("POST", "/rlm/weight_digests", {"names": list(names)})

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

    def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """Drops the prefix cache the old weights computed. SGLang refuses (HTTP 400: False here) while requests run
        or wait; with `timeout_s` it waits up to that long for them to end first (0.5.23's `/flush_cache?timeout=`;
        an older server flushes at once, or refuses)."""
        query = f"?timeout={timeout_s:g}" if timeout_s else ""
        try:
            self._call("POST", "/flush_cache" + query, {}, timeout_s=timeout_s + 30 if timeout_s else None)
        except SGLangRequestError as error:
            if "HTTP 400" not in str(error):
                raise
            return False
        return True

    def server_info(self, timeout_s: float = 10.0) -> dict:
        """`/server_info`: the launch configuration and the scheduler's live state, which the scheduler answers
        (a control request: it runs while generation is paused)."""
        return self._call("GET", "/server_info", timeout_s=timeout_s)

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
    reason = meta["finish_reason"]["type"]
    if reason == "abort" and not output_ids:
        # Aborted before it started (SGLang's waiting-queue abort, as a pause aborts what it holds): no tokens, and
        # none of what a started request reports (routed experts, prompt tokens). The caller sends it again.
        return GenerationResult(request_index=request_index, sample_index=sample_index, output_token_ids=(),
                                output_token_logprobs=(), finish_reason="abort",
                                weight_version=meta.get("weight_version"), routed_experts=None)
    triples = meta["output_token_logprobs"]  # [logprob, token_id, text-or-None] per output token
    if [int(token) for _, token, *_ in triples] != output_ids:
        raise SGLangRequestError("output_token_logprobs does not follow output_ids")
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
            # A request that ran and still carries none: the server does not record them.
            raise SGLangRequestError(f"the answer to sample {request_index}/{sample_index} ({len(output_ids)} tokens, "
                                     f"finish reason {reason}) carries no routed_experts though they were asked for: "
                                     "the server does not record them; launch it with --enable-return-routed-experts")
        routed = routing.decode(meta["routed_experts"])
    return GenerationResult(
        request_index=request_index,
        sample_index=sample_index,
        output_token_ids=tuple(output_ids),
        output_token_logprobs=logprobs,
        finish_reason=reason,
        weight_version=meta.get("weight_version"),
        routed_experts=routed,
        # Speculative decoding's counts (SGLang's, and the local server's under its names); absent without it.
        spec_verify_ct=meta.get("spec_verify_ct", 0),
        spec_num_correct_drafts=meta.get("spec_num_correct_drafts", 0),
        spec_num_proposed_drafts=meta.get("spec_num_proposed_drafts", 0),
    )


def joined(parts: Sequence[GenerationResult]) -> GenerationResult:
    """One sample from the pieces partial rollout generated it in, each piece's tokens tagged with its weights. A piece
    aborted before it started adds nothing."""
    last = parts[-1]
    parts = [part for part in parts[:-1] if part.output_token_ids] + [last]
    if len(parts) == 1:
        return last
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
        spec_verify_ct=sum(part.spec_verify_ct for part in parts),
        spec_num_correct_drafts=sum(part.spec_num_correct_drafts for part in parts),
        spec_num_proposed_drafts=sum(part.spec_num_proposed_drafts for part in parts),
    )
