"""The weight push inside a trainer rank: the actor's weights, streamed from its layout as HF-named full tensors
(collective: every rank walks the whole stream), to the rollout engines after each update.

Colocated: into this rank's part of its engine (shared memory, or CUDA IPC for SGLang). Disaggregated: trainer rank 0
broadcasts each bucket to every server over a weight-update group of its own (NCCL; gloo on CPU); the other ranks
let the stream pass.
"""
from __future__ import annotations

import collections
import socket
from typing import Optional

import torch

from rlmegatron.controller.rank.colocated_engine import ColocatedEngine
from rlmegatron.controller.rank.role_models import RoleModels
from rlmegatron.controller.role_settings import RolloutSettings
from rlmegatron.resharding import HFWeightExporter
from rlmegatron.rollout.buckets import travel_rules_for
from rlmegatron.rollout.sglang import DistributedGroupSpec, DistributedWeightPush
from rlmegatron.runtime.launcher import free_port


class WeightPush:
    """This rank's side of every weight sync, colocated or disaggregated."""

    def __init__(self, settings: RolloutSettings, models: RoleModels, engine: Optional[ColocatedEngine]) -> None:
        self.settings, self.models, self.engine = settings, models, engine
        self.distributed: Optional[DistributedWeightPush] = None
        """Disaggregated, on trainer rank 0: the weight-update groups with the servers."""
        self.exporter: Optional[HFWeightExporter] = None
        """Made at the first sync: its plan (every rank's names, shapes and stages, an all_gather_object) is the
        model's, and the weights it streams are read when it streams."""

    def connect(self, endpoints: list[tuple[int, str, int]]) -> None:
        """Disaggregated: rank 0 joins a fresh weight-update group with each (engine, url, tp_size) server."""
        if torch.distributed.get_rank() != 0:
            return
        if self.distributed is None:
            self.distributed = DistributedWeightPush(self.settings.bucket_bytes,
                                                     travel_rules_for(self.settings.model.hf_config()))
        address = socket.gethostbyname(socket.gethostname())
        for engine, url, tp_size in endpoints:
            port = free_port("")
            group = DistributedGroupSpec(address, port, f"rlmegatron_sync_{engine}_{port}",
                                         self.settings.weight_group_backend)
            self.distributed.connect(engine, url, tp_size, group)

    def sync(self, version: str, restarted: Optional[list[int]] = None) -> None:
        """The trained weights to the engines: all, or the `restarted` ones."""
        with self.models.phase("actor"):
            if self.exporter is None:
                self.exporter = HFWeightExporter(self.models.actor.chunks, self.models.weight_map)
            stream = self.exporter.stream()
            if self.distributed is not None:
                self.distributed.push(stream, version, only=restarted)
            elif self.engine is not None:
                self.engine.receive_weights(stream, version, restarted)
            else:
                collections.deque(stream, maxlen=0)
