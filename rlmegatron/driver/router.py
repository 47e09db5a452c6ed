"""`rollout.sglang.router`: an sglang_router on the driver's node, in front of every engine's server."""
from __future__ import annotations

from pathlib import Path

from rlmegatron.config import JobSpec
from rlmegatron.driver.role_settings import rollout_settings
from rlmegatron.rollout.sglang.client import SGLangClient
from rlmegatron.rollout.sglang.server import ServerProcess, router_command
from rlmegatron.runtime.distributed import free_port
from rlmegatron.runtime.node import node_address


def start_router(spec: JobSpec) -> tuple[JobSpec, ServerProcess]:
    """The router, healthy, with no workers yet; the servers join it once they hold trained weights. Returns the
    spec naming it in rollout.sglang.router_url, and its process."""
    settings = rollout_settings(spec)
    host = node_address()  # the driver's node (its Ray node's IP: Ray starts first), which every engine reaches
    port = free_port(host)
    process = ServerProcess(router_command(settings.server.python, [], port, host, settings.router_args),
                            Path(settings.log_dir) / "sglang_router.log")
    process.start()
    url = f"http://{host}:{port}"
    try:
        process.wait_ready(SGLangClient(url).health, settings.startup_timeout_s)
    except BaseException:
        process.stop()
        raise
    sglang = spec.rollout.sglang
    rollout = spec.rollout.model_copy(update={"sglang": sglang.model_copy(update={"router_url": url})})
    return spec.model_copy(update={"rollout": rollout}), process
