"""The rollout engine's lifecycle inside a trainer rank (colocated placement): built with the rank, asleep (its memory
released) while the trainer runs, woken by the next weights, relaunched after a server failure, stopped with the rank.

With `rollout.engine=local` every rank leads its own in-process engine. With SGLang, one server per
`rollout.tensor_parallel_size` ranks: the group's first rank leads it (launches and supervises node 0), the others are
`EngineMember`s that share their copy of each weight bucket with it and, first on a later node of a server that spans
nodes, run that node's process.
"""
from __future__ import annotations

import collections
from typing import Iterable, Optional

import torch

from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.sglang.servers import generate_or_none, launch_spec, server_nodes, sglang_engine, this_place
from rlmegatron.models.hf_config import DTYPES
from rlmegatron.rollout.agent_loop import AgentLoop
from rlmegatron.rollout.buckets import NamedTensor, travel_rules_for
from rlmegatron.rollout.delta import DeltaReceiver
from rlmegatron.rollout.engine import MEMORY_TAGS, GenerationRequest, GenerationResult, RolloutEngine, WeightStream
from rlmegatron.rollout.local import LocalEngine, causal_lm_from_config, image_processor_at
from rlmegatron.rollout.sglang.weight_push import share_buckets
from rlmegatron.rollout.sglang.server import ServerProcess, launch_node
from rlmegatron.runtime.cpu_compat import plain_torch
from rlmegatron.runtime.distributed import collective_timeout
from rlmegatron.tracking.progress import Progress


class EngineMember:
    """A trainer rank in a colocated engine's group other than its leader: shares its copy of each weight bucket
    with the leader (`share_buckets`) and, if it is the first rank on a later node of a server that spans nodes,
    runs that node's server process."""

    def __init__(self, settings: RolloutSettings, group, travel_rules, node_process: Optional[ServerProcess] = None):
        self.bucket_bytes = settings.bucket_bytes
        self.tp_size, self.group, self.node_process = settings.tensor_parallel_size, group, node_process
        self.travel_rules = travel_rules
        if node_process is not None:
            node_process.start()

    def update_weights(self, named_tensors: WeightStream, version: str) -> None:
        share_buckets(named_tensors, self.bucket_bytes, self.travel_rules, self.tp_size, self.group, post=None)

    wake_up_with_weights = update_weights

    def release_memory(self, tags=MEMORY_TAGS) -> None:
        """The leader releases the server's memory on every node."""

    def relaunch(self) -> None:
        """The server restarted: this node's process goes down with it and starts again."""
        if self.node_process is not None:
            self.node_process.stop()
            self.node_process.start()

    def shutdown(self) -> None:
        if self.node_process is not None:
            self.node_process.stop()


class ColocatedEngine:
    """This rank's part in a colocated engine: the engine it leads (`leader`), its `member` share of one another rank
    leads, or neither (a rank outside every engine's group). Building it is collective over the trainer ranks."""

    def __init__(self, settings: RolloutSettings, hf_config) -> None:
        self.leader: Optional[RolloutEngine] = None
        self.member: Optional[EngineMember] = None
        self.index: Optional[int] = None
        """The engine this rank belongs to."""
        if settings.engine == "local":
            self.index, self.leader = torch.distributed.get_rank(), _local_engine(settings, hf_config)
        else:
            self._join_sglang_engine(settings, hf_config)
        self.agent = AgentLoop(settings.multi_turn) if settings.multi_turn and self.leader is not None else None
        self.asleep = False
        self.delta_receiver = DeltaReceiver()
        """Delta sync: the weights this rank's engine was last given, which each delta is applied to."""
        # With adapter sync the base weights stay on the device; only the adapters change.
        self.sleeping_tags = ("kv_cache", "cuda_graph") if settings.lora is not None else MEMORY_TAGS

    def _join_sglang_engine(self, settings: RolloutSettings, hf_config) -> None:
        tp = settings.tensor_parallel_size
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        places: list = [None] * world
        torch.distributed.all_gather_object(places, this_place(settings.device))
        layout = server_nodes(places, tp, (settings.num_gpus or world) // tp)
        # Every rank creates every group, in the same order, as new_group requires.
        groups = [torch.distributed.new_group([s for node in nodes for s in node.slots], backend="gloo",
                                              timeout=collective_timeout())
                  for nodes in layout] if tp > 1 else [None] * len(layout)
        mine = next(((node, index) for nodes in layout for node in nodes
                     for index, slot in enumerate(node.slots) if slot == rank), None)
        if mine is None:
            return
        node, index = mine
        self.index = node.engine
        # Behind a router (on the driver's node) a server must be reachable from there, not just from this node.
        host = places[rank].address if settings.router_url else "127.0.0.1"
        server = launch_spec(settings, [places[slot].device for slot in node.slots], host, node)
        if node.node_rank == 0 and index == 0:
            self.leader = sglang_engine(settings, server, hf_config, ipc_group=groups[node.engine])
        else:
            self.member = EngineMember(settings, groups[node.engine], travel_rules_for(hf_config),
                                       launch_node(server, settings.log_dir, start=False) if index == 0 else None)

    @property
    def part(self):
        """What this rank runs of its engine: the leader's or a member's part, or None."""
        return self.leader if self.leader is not None else self.member

    def generate(self, requests: list[GenerationRequest],
                 progress: Progress = None) -> Optional[list[GenerationResult]]:
        with plain_torch():
            return generate_or_none(self.leader, requests, progress, self.agent)

    def release_memory(self) -> None:
        """The engine gives its memory back while the trainer runs; the next weights wake it."""
        if self.part is not None:
            self.part.release_memory(self.sleeping_tags)
            self.asleep = True

    def receive_weights(self, stream: WeightStream, version: str, engines: Optional[list[int]] = None) -> None:
        """The actor's weights stream (collective: every rank walks it whole) into this rank's part of its engine, if
        it is one of `engines` (None: every engine)."""
        if self.part is None or (engines is not None and self.index not in engines):
            collections.deque(stream, maxlen=0)
            return
        with plain_torch():  # the export and the engine's copy are this project's torch code, naming no device
            if self.asleep:
                self.part.wake_up_with_weights(stream, version)
                self.asleep = False
            else:
                self.part.update_weights(stream, version)

    def takes(self, engines: Optional[list[int]]) -> bool:
        """This rank leads or shares an engine among `engines` (None: every engine)."""
        return self.part is not None and (engines is None or self.index in engines)

    def receive_records(self, records: Iterable[list[NamedTensor]], version: str) -> None:
        """Delta sync into the engine this rank leads (the local engine: every rank leads its own): each bucket's
        records (rollout/delta.py) made whole tensors again and loaded, only those that changed."""
        receiver = self.delta_receiver
        self.receive_weights((whole for bucket in records for whole in receiver.apply(bucket)), version)

    def receive_adapter(self, name: str, path: str, version: str, engines: Optional[list[int]] = None) -> None:
        """Adapter sync: this rank's engine (the leader's part), if it is one of `engines` (None: every engine),
        loads the PEFT adapter at `path` as `name` and samples with it."""
        if self.leader is None or (engines is not None and self.index not in engines):
            return
        if self.asleep:
            self.leader.resume_memory(self.sleeping_tags)
            self.asleep = False
        self.leader.load_adapter(name, path, version)

    def relaunch(self, engines: list[int]) -> None:
        """This rank's engine restarted (it is one of `engines`): its part starts again (a member's node process) or
        waits for the whole server (the leader)."""
        if self.part is not None and self.index in engines:
            self.part.relaunch()

    def shutdown(self) -> None:
        if self.part is not None:
            self.part.shutdown()


def _local_engine(settings: RolloutSettings, hf_config) -> LocalEngine:
    device = "cuda" if settings.device == "cuda" else "cpu"
    # The engine samples from the weights the trainer holds, in the trainer's dtype. No engine seed: every request
    # the trainer sends carries its own (Trainer.sampling_seed).
    model = causal_lm_from_config(hf_config, DTYPES[settings.model.dtype],
                                  settings.model.trust_remote_code).to(device)
    eos = hf_config.eos_token_id
    return LocalEngine(
        model,
        pad_token_id=hf_config.pad_token_id or 0,
        eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [],
        weight_format=settings.weight_format,
        # The image processor the data was read with (job: model.tokenizer_path or model.path).
        image_processor=image_processor_at(settings.model.tokenizer_path or settings.model.path),
        num_draft_tokens=settings.num_draft_tokens,
    )
