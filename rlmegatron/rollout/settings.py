"""The settings of the rollout engines, wherever they run: built by the driver from the job spec
(driver.role_settings), read by the trainer ranks (colocated) and the rollout pool (disaggregated)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT
from rlmegatron.models.lora import LoRASettings
from rlmegatron.models.source import ModelSource
from rlmegatron.rollout.agent_loop import AgentSettings
from rlmegatron.rollout.sglang.server import ServerSpec


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout engines, wherever they run: in the trainer ranks (colocated) or on their own pool."""

    engine: str
    """`local` (transformers, in every trainer rank) or `sglang`."""
    device: str
    model: ModelSource
    tensor_parallel_size: int
    num_gpus: Optional[int]
    """GPUs the engines use (None: every trainer rank when colocated, the whole pool when disaggregated)."""
    pool_size: Optional[int]
    """Disaggregated: the rollout pool's hosts, one per GPU the engines use."""
    bucket_bytes: int
    quantization: str
    """`fp8`: the sync quantises the weights block-wise (models.fp8.DEFAULT); `none`: they travel in model.dtype."""
    server: ServerSpec
    """Every server's launch spec; host, port, env and the node fields are each launch's own (`servers.launch_spec`)."""
    router_url: Optional[str]
    router_args: dict[str, Any]
    """sglang_router's own flags, when rlmegatron starts it (`rollout.sglang.router`)."""
    startup_timeout_s: float
    log_dir: str
    multi_turn: Optional[AgentSettings] = None
    """The agent loop the engines run each request through (`rollout.multi_turn`); None: single completions."""
    lora: Optional[LoRASettings] = None
    """The actor's adapters when they travel as a LoRA adapter (actor.lora.weight_sync=adapter), else None."""
    adapter_dir: str = ""
    """Where the adapter of each version is written for the servers to load."""
    partial_rollout: bool = False
    """New weights reach the engines mid-generation (trainer.partial_rollout): pause, swap, continue."""
    weight_sync: str = "full"
    """`delta`: after a full push, each sync sends only the elements that changed (rollout/delta.py)."""
    full_sync_every: int = 0
    """Delta sync: every this many syncs a full push (0: only where one is needed)."""
    check_sync_every: int = 0
    """Every this many syncs, each engine's weights are checked against what a full push gives (0: never)."""
    num_draft_tokens: int = 0
    """rollout.speculative: tokens the model's MTP layer drafts per verification (0: no speculative decoding). The
    local engine drafts in-process (rollout/speculative.py); SGLang and the local server take it as their flags."""

    @property
    def weight_format(self):
        """The block-wise FP8 format the sync pushes in, or None: the weights travel as trained."""
        return FP8_ROLLOUT if self.quantization == "fp8" else None
