"""SGLang server processes: launch commands (server, multi-node, router), the process with its log, and readiness."""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping


RETURN_ROUTED_EXPERTS = "enable-return-routed-experts"
"""The server flag that has SGLang record each token's experts for requests that ask (`return_routed_experts`)."""
# model.dtype -> SGLang's --dtype, so the engines serve the dtype the trainer trains in.
SGLANG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class ServerStartupError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


def extra_flags(extra_args: Mapping[str, Any]) -> list[str]:
    """{key: value} -> --key value; true -> bare --key; false/None -> omitted; a list -> --key v1 v2."""
    flags: list[str] = []
    for key, value in extra_args.items():
        if value is True:
            flags.append(f"--{key}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [f"--{key}", *map(str, value)]
        else:
            flags += [f"--{key}", str(value)]
    return flags


def speculative_flags(num_draft_tokens: int) -> dict[str, Any]:
    """SGLang's flags for rollout.speculative (its one method, mtp): the checkpoint's MTP layer as the draft model,
    which SGLang calls NEXTN (an alias of EAGLE whose draft is the target checkpoint's own next-token layer, its class
    the architecture's *NextN, e.g. DeepseekV3ForCausalLMNextN), chained for `num_draft_tokens` steps with one
    candidate each (top-k 1), so each verification scores the k drafts and the token after them: k + 1 draft tokens.
    A weight update reaches both the target and the draft model (SGLang's default runner selector), and the draft
    reads its MTP layer's names from the same stream."""
    return {"speculative-algorithm": "NEXTN", "speculative-num-steps": num_draft_tokens,
            "speculative-eagle-topk": 1, "speculative-num-draft-tokens": num_draft_tokens + 1}


@dataclass(frozen=True)
class ServerSpec:
    """One SGLang server (one TP group; weight updates need dp_size 1 per server)."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    python: str = "python"
    module: str = "sglang.launch_server"
    """The server's module: SGLang's, or rlmegatron.rollout.local_server (the local engine behind SGLang's API)."""
    dtype: str = "auto"
    """SGLang's --dtype; `auto` follows the checkpoint's torch_dtype."""
    device: str = "cuda"
    """`cpu` runs SGLang's CPU backend (and the loopback test server)."""
    tp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    mem_fraction_static: float = 0.7
    enable_memory_saver: bool = True
    load_format: str = "auto"
    skip_tokenizer_init: bool = True
    trust_remote_code: bool = False
    """The model's own code (its config.json auto_map) may run in the server."""
    extra_args: Mapping[str, Any] = field(default_factory=dict)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    """HOST:PORT of node 0's rendezvous, required when nnodes > 1."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to this process's environment (CUDA_VISIBLE_DEVICES, PYTHONPATH, ...)."""
    sglang_version: str | None = None
    """The SGLang the interpreter runs (`installed_sglang`), which decides flag spellings; None: unknown, the older."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def for_node(self, node_rank: int) -> "ServerSpec":
        return dataclasses.replace(self, node_rank=node_rank)


RENAMED_IN = "0.5.23"
"""From this SGLang on, the spellings of RENAMED_FLAGS and of dp-attention: the old ones are deprecated (to go after
2026-12-31), and `--cuda-graph-bs` is ambiguous (argparse exits 2: it is a prefix of two flags)."""
RENAMED_FLAGS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "disable-cuda-graph": lambda value: {"cuda-graph-backend-decode": "disabled",
                                         "cuda-graph-backend-prefill": "disabled"} if value is True else {},
    "cuda-graph-bs": lambda value: {"cuda-graph-bs-decode": value},
}


@functools.lru_cache(maxsize=None)
def installed_sglang(python: str) -> str | None:
    """The SGLang version `python` has installed (its package metadata: no import), None where it has none."""
    probe = "import importlib.metadata as m\ntry:\n print(m.version('sglang'))\nexcept m.PackageNotFoundError:\n pass"
    try:
        answer = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return answer.stdout.strip() or None


def _renamed(spec: ServerSpec) -> bool:
    from packaging.version import InvalidVersion, Version  # lazy: a dependency of the launch alone

    try:
        return spec.sglang_version is not None and Version(spec.sglang_version) >= Version(RENAMED_IN)
    except InvalidVersion:
        return False


def server_command(spec: ServerSpec) -> list[str]:
    command = [
        spec.python, "-m", spec.module,
        "--model-path", spec.model_path,
        "--host", spec.host,
        "--port", str(spec.port),
        "--tp-size", str(spec.tp_size),
        "--ep-size", str(spec.ep_size),
        "--mem-fraction-static", str(spec.mem_fraction_static),
        "--load-format", spec.load_format,
        "--dtype", spec.dtype,
    ]
    if spec.device != "cuda":
        command += ["--device", spec.device]
    renamed = _renamed(spec)
    if spec.enable_dp_attention:
        # dp-attention splits attention across the TP ranks of this one server; its dp_size is the TP size.
        command += ["--attn-dp-size", str(spec.tp_size)] if renamed else \
            ["--enable-dp-attention", "--dp-size", str(spec.tp_size)]
    if spec.enable_memory_saver:
        command.append("--enable-memory-saver")
    if spec.skip_tokenizer_init:
        command.append("--skip-tokenizer-init")
    if spec.trust_remote_code:
        command.append("--trust-remote-code")
    if spec.nnodes > 1:
        if not spec.dist_init_addr:
            raise ValueError("a multi-node server needs dist_init_addr (node 0's HOST:PORT)")
        command += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                    "--dist-init-addr", spec.dist_init_addr]
    extra = spec.extra_args
    if renamed:  # a verl spelling passed through (engine_kwargs.sglang.*) becomes the one this SGLang takes
        extra = {}
        for key, value in spec.extra_args.items():
            extra.update(RENAMED_FLAGS[key](value) if key in RENAMED_FLAGS else {key: value})
    return command + extra_flags(extra)


def router_command(
    python: str, worker_urls: list[str], port: int, host: str = "127.0.0.1", extra_args: Mapping[str, Any] = {}
) -> list[str]:
    """sglang_router in front of several servers; generation goes to the router, weight updates to each server.
    Without worker URLs the servers join later, each once it holds trained weights."""
    workers = ["--worker-urls", *worker_urls] if worker_urls else []
    return [python, "-m", "sglang_router.launch_router", *workers, "--host", host, "--port", str(port),
            *extra_flags(extra_args)]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except FileNotFoundError:
        return "<no log file>"


class ServerProcess:
    """A server (or router) subprocess writing stdout+stderr to `log_path`; restartable. It runs under
    `lifeline`, so it ends with this process even when this process is killed outright."""

    def __init__(self, command: list[str], log_path: Path, env: Mapping[str, str] = {}) -> None:
        self.command = command
        self.log_path = Path(log_path)
        self.env = dict(env)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rlmegatron.supervision.lifeline", str(os.getpid()), "--", *self.command],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True,  # its own process group, so stop() also ends the TP worker children
            )
        finally:
            log.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None:
            return
        group = self.process.pid
        if self.process.poll() is None:
            try:
                os.killpg(group, 15)
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(group, 9)
                self.process.wait()
            except ProcessLookupError:
                pass
        # The lifeline has exited, but its group may not be empty yet: a SIGTERM that comes before the lifeline has
        # set its handler ends it at once, and the server it started is then reaped by init moments later. Return
        # once nothing of the group is left.
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 9)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self.process = None

    def wait_ready(self, is_healthy: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                code = None if self.process is None else self.process.returncode
                raise ServerStartupError(
                    f"server exited with code {code}: {' '.join(self.command)}\n"
                    f"--- last lines of {self.log_path} ---\n{log_tail(self.log_path)}"
                )
            if is_healthy():
                return
            time.sleep(poll_s)
        raise ServerStartupError(
            f"server not healthy after {timeout_s:.0f}s: {' '.join(self.command)}\n"
            f"--- last lines of {self.log_path} ---\n{log_tail(self.log_path)}"
        )


def launch_node(spec: ServerSpec, log_dir: str, start: bool = True) -> ServerProcess:
    """This node's share of a (possibly multi-node) server. Only node 0 serves HTTP, so readiness is
    node 0's health, which SGLang reports once every node joined."""
    name = f"sglang_{spec.port}.log" if spec.nnodes == 1 else f"sglang_{spec.port}_node{spec.node_rank}.log"
    process = ServerProcess(server_command(spec), Path(log_dir) / name, spec.env)
    if start:
        process.start()
    return process
