"""What runs on the rollout pool (disaggregated placement): one `EngineHost` per GPU (one CPU rank on CPU), a plain
class the driver runs as a Ray actor on the pool's bundle, or in its own process without Ray."""
from __future__ import annotations

import contextlib
from typing import Optional

from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.sglang.servers import Place, ServerNode, generate_or_none, launch_spec, sglang_engine, this_place
from rlmegatron.rollout.agent_loop import AgentLoop
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult
from rlmegatron.rollout.sglang.client import ServerUnavailable
from rlmegatron.rollout.sglang.engine import SGLangEngine
from rlmegatron.rollout.sglang.server import ServerProcess, launch_node
from rlmegatron.tracking.progress import Progress
from rlmegatron.runtime.node import node_address


class EngineHost:
    """One GPU of the rollout pool. The first host of each node of a server launches that node's process on the
    node's devices; the host of node 0 supervises the server. The others hold their GPU."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.engine: Optional[SGLangEngine] = None
        self.agent: Optional[AgentLoop] = None
        self.node_process: Optional[ServerProcess] = None

    def place(self) -> Place:
        return this_place(self.settings.device)

    def launch(self, devices: list[str], node: ServerNode) -> Optional[str]:
        """Returns the server's URL on node 0's host; None on the other nodes' hosts."""
        server = launch_spec(self.settings, devices, node_address(), node)
        if node.node_rank:
            self.node_process = launch_node(server, self.settings.log_dir)
            return None
        self.engine = sglang_engine(self.settings, server, self.settings.model.hf_config())
        self.agent = AgentLoop(self.settings.multi_turn) if self.settings.multi_turn else None
        return self.engine.spec.url

    def relaunch(self) -> None:
        """The server restarted after a failure: other nodes restart their process, node 0 waits for all of them."""
        if self.node_process is not None:
            self.node_process.stop()
            self.node_process.start()
        else:
            self.engine.relaunch()

    def generate(self, requests: list[GenerationRequest],
                 progress: Progress = None) -> Optional[list[GenerationResult]]:
        return generate_or_none(self.engine, requests, progress, self.agent)

    def pause_generation(self) -> bool:
        """Before a push: the server holds its generation (`SGLangEngine.pause_generation`). False: the server is
        down (`takes_weights`)."""
        try:
            self.engine.pause_generation()
        except ServerUnavailable:
            return False
        return True

    def continue_generation(self) -> None:
        with contextlib.suppress(ServerUnavailable):  # down since it paused: the generation that meets it restarts it
            self.engine.continue_generation()

    def takes_weights(self) -> bool:
        """Whether a push to every engine may include this server: not one that is down, or restarted (`stale`)
        and so outside the trainer's weight-update group. With generation running beside the push (one_step_off,
        async), the generation that met the failure restarts the server and has it rejoined and synced on its own
        (`Trainer.generate`), as in sync mode."""
        return not self.engine.stale and self.engine.health()

    def weights_pushed(self, version: str) -> None:
        """The trainer broadcast `version` to this server, around the engine, over its weight-update group."""
        self.engine.mark_synced(version)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.node_process is not None:
            self.node_process.stop()
