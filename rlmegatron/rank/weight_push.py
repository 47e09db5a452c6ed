"""The weight push inside a trainer rank: the actor's weights, streamed from its layout as HF-named full tensors
(collective: every rank walks the whole stream), to the rollout engines after each update.

Colocated: into this rank's part of its engine (shared memory, or CUDA IPC for SGLang). Disaggregated: every trainer
rank pushes to its share of the servers (`sending_ranks`, `assign_senders`; with delta sync, the first rank of each
node), all at once, each bucket broadcast over a weight-update group per server (NCCL; gloo on CPU, or where the
server shares the sender's GPU: `servers.weight_group_backend`); a rank with no server lets the stream pass. Every
rank's export holds every tensor whole, so any rank can send, each over its GPU's own network link: with one
sender, n servers' bytes would share one link.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from rlmegatron.rank.colocated_engine import ColocatedEngine
from rlmegatron.rank.role_models import RoleModels
from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.sglang.servers import ServerDevices, weight_group_backend
from rlmegatron.models.lora import adapters_disabled
from rlmegatron.resharding import HFWeightExporter, export_peft_adapter
from rlmegatron.models.fp8 import SCALE_SUFFIX
from rlmegatron.models.hf_config import DTYPES
from rlmegatron.rollout.buckets import Bucketer, travel_rules_for
from rlmegatron.rollout.delta import DeltaSender, SyncBytes, expected_digests, iter_records, load_groups
from rlmegatron.rollout.engine import INITIAL_VERSION
from rlmegatron.rollout.sglang.client import SGLangClient, ServerUnavailable
from rlmegatron.rollout.sglang.protocol import DistributedGroupSpec
from rlmegatron.rollout.sglang.weight_push import DistributedWeightPush
from rlmegatron.runtime.distributed import free_port
from rlmegatron.runtime.node import node_address, node_id
from rlmegatron.errors import UserError, WeightSyncMismatch


def sending_ranks(nodes: list[str], per_node: Optional[int] = None) -> list[int]:
    """Of ranks on `nodes` (each rank's node, in rank order), those that push to disaggregated servers, in the order
    they take them: the first rank of every node, then the second of every node, and so on, so that servers spread
    over the nodes first; at most `per_node` of each node (None: all: each GPU's rank sends over its own network
    link, one per GPU in a DGX-like node)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    columns = itertools.zip_longest(*(ranks[:per_node] for ranks in by_node.values()))
    return [rank for column in columns for rank in column if rank is not None]


def assign_senders(engines: list[int], senders: list[int], assigned: dict[int, int]) -> None:
    """Gives each of `engines` not in `assigned` (engine -> sending rank) the sender with the fewest engines, the
    first in `senders`' order on a tie; an engine that has one keeps it (a restarted server). Every rank is given
    the same engines in the same order, so every rank builds the same table without asking; a pool that grows and
    shrinks stays spread over the senders."""
    for engine in engines:
        if engine not in assigned:
            load = collections.Counter(assigned.values())
            assigned[engine] = min(senders, key=lambda sender: load[sender])  # the first of the least loaded


def clashing_ports(picks: list[tuple[str, list[int]]]) -> dict[int, set[int]]:
    """Of each rank's (node, ports it drew), in rank order, the ports a rank must draw again: one that a lower rank
    of its node (or the rank itself, for another engine) drew first. free_port's draws clash about once in 12,000
    per pair; two weight-update groups on one port would meet in one store."""
    seen: dict[str, set[int]] = {}
    again: dict[int, set[int]] = {}
    for rank, (node, ports) in enumerate(picks):
        taken = seen.setdefault(node, set())
        for port in ports:
            if port in taken:
                again.setdefault(rank, set()).add(port)
            taken.add(port)
    return again


class WeightPushFailed(RuntimeError):
    """Another trainer rank's disaggregated push failed (raised on every rank, that one with its own error)."""


class FP8OverGloo(UserError):
    """rollout.quantization=fp8 where a push to SGLang would travel over gloo."""


@dataclass
class SyncReport:
    """One sync as this rank saw it: the servers that went down, and the bytes it carried to each engine against a
    full push's."""

    down: list[int] = field(default_factory=list)
    full: bool = True
    bytes: SyncBytes = field(default_factory=SyncBytes)


def _counted(stream, counted: SyncBytes):
    for name, tensor in stream:
        size = tensor.numel() * tensor.element_size()
        counted.add(SyncBytes(sent=size, full=size, tensors_changed=1, tensors=1))
        yield name, tensor


class WeightPush:
    """This rank's side of every weight sync, colocated or disaggregated."""

    def __init__(self, settings: RolloutSettings, models: RoleModels, engine: Optional[ColocatedEngine]) -> None:
        self.settings, self.models, self.engine = settings, models, engine
        self.travel_rules = travel_rules_for(settings.model.hf_config())
        self.delta: Optional[DeltaSender] = None
        """Delta sync: the last weights sent, and how to send what changed since."""
        if settings.weight_sync == "delta":
            scale_suffix = SCALE_SUFFIX if settings.weight_format is not None else None
            self.delta = DeltaSender(load_groups(self.travel_rules, scale_suffix))
        self.syncs = 0
        """Syncs of engines that hold weights, for full_sync_every and check_sync_every."""
        self.distributed: Optional[DistributedWeightPush] = None
        """Disaggregated, on a sending rank (`sending_ranks`): the weight-update groups with its servers."""
        self.senders: Optional[dict[int, str]] = None
        """Disaggregated: the sending ranks (in the order they take servers) and their node addresses, learnt at the
        first connect."""
        self.sender_of: dict[int, int] = {}
        """Disaggregated: each connected engine's sending rank (`assign_senders`), the same on every rank."""
        self.exporter: Optional[HFWeightExporter] = None
        """Made at the first sync: its plan (every rank's names, shapes and stages, an all_gather_object) is the
        model's, and the weights it streams are read when it streams."""
        self.server_urls: dict[int, str] = {}
        self.loaded_adapters: dict[int, str] = {}
        """Disaggregated, on trainer rank 0: each server's URL and the adapter it holds (adapters and sync checks go
        over HTTP, from rank 0)."""
        self.adapter_path: Optional[str] = None

    def connect(self, endpoints: list[tuple[int, str, ServerDevices]]) -> None:
        """Disaggregated (collective): each (engine, url, its TP ranks' devices) server joins a fresh weight-update
        group with its sending rank."""
        rank = torch.distributed.get_rank()
        if self.senders is None:
            places: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(places, (node_id(), node_address()))
            # Delta sync keeps a host copy of the policy in each sender (rollout/delta.py): one per node, not per GPU.
            ranks = sending_ranks([node for node, _ in places], per_node=1 if self.delta is not None else None)
            self.senders = {sender: places[sender][1] for sender in ranks}
        assign_senders([engine for engine, _, _ in endpoints], list(self.senders), self.sender_of)
        if rank == 0:
            self.server_urls.update({engine: url for engine, url, _ in endpoints})
            by_sender: dict[int, list[int]] = {}
            for engine, _, _ in endpoints:
                by_sender.setdefault(self.sender_of[engine], []).append(engine)
            print("weight sync: " + "; ".join(
                f"engine{'s' * (len(engines) > 1)} {', '.join(map(str, engines))} from trainer rank {sender} "
                f"({self.senders[sender]})" for sender, engines in sorted(by_sender.items())), file=sys.stderr,
                flush=True)
        if self.distributed is None and rank in self.senders:  # rank 0 is always one: it counts delta's bytes
            self.distributed = DistributedWeightPush(self.settings.bucket_bytes, self.travel_rules,
                                                     by_records=self.delta is not None)
        mine = [endpoint for endpoint in endpoints if self.sender_of[endpoint[0]] == rank]
        ports = self._ports([engine for engine, _, _ in mine])
        address = node_address()  # this sender's node, which every server's node reaches
        for engine, url, devices in mine:
            port = ports[engine]
            backend = weight_group_backend(self.settings.device, devices)
            if backend == "gloo" and self.settings.weight_format is not None and self.settings.engine == "sglang" \
                    and self.delta is None:  # delta records travel in request bodies, not over the group
                # On a GPU that the sending rank shares with the server (a run without Ray); on CPU checks.py refuses
                # it before anything starts.
                raise FP8OverGloo(f"rollout engine {engine} shares trainer rank {rank}'s GPU, so its weights travel "
                                  "over gloo, which cannot carry the FP8 weights SGLang receives (rollout.quantization="
                                  "fp8); give the rollout pool GPUs of its own (placement.transport=ray), or use "
                                  "rollout.quantization=none")
            group = DistributedGroupSpec(address, port, f"rlmegatron_sync_{engine}_{port}", backend)
            self.distributed.connect(engine, url, len(devices), group)

    def _ports(self, engines: list[int]) -> dict[int, int]:
        """A port for each of `engines`' weight-update groups, none drawn by another sender of this node
        (collective: the senders of a node draw at once)."""
        ports = {engine: free_port("") for engine in engines}
        node = node_id()
        while True:
            picks: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(picks, (node, list(ports.values())))
            again = clashing_ports(picks)
            if not again:
                return ports
            for engine, port in list(ports.items()):
                if port in again.get(torch.distributed.get_rank(), ()):
                    ports[engine] = free_port("")

    def disconnect(self, engines: list[int]) -> None:
        """`engines` left the pool: their senders forget them and their weight-update groups."""
        for engine in engines:
            self.server_urls.pop(engine, None)
            self.loaded_adapters.pop(engine, None)
            self.sender_of.pop(engine, None)
            if self.distributed is not None:
                self.distributed.disconnect(engine)

    def sync(self, version: str, engines: Optional[list[int]] = None, fresh: bool = False) -> SyncReport:
        """The trained weights to `engines` (None: every engine). `fresh`: they hold no weights (just built or
        restarted), so they get the whole model: with adapter sync the base weights too, and a frozen vision tower;
        otherwise what training can have changed. Reports the disaggregated servers that went down during the push
        (`DistributedWeightPush.push`: left out, not failed) and the bytes it carried.

        With delta sync (rollout.weight_sync), a push carries only what changed since the last one, except to fresh
        engines, at the first push and every full_sync_every syncs."""
        lora, chunks = self.settings.lora, self.models.actor.chunks
        report = SyncReport()
        if not fresh:
            self.syncs += 1
        every = self.settings.full_sync_every
        report.full = fresh or self.delta is None or not self.delta.last or bool(every and self.syncs % every == 0)
        with self.models.phase("actor"):
            if lora is None or fresh:
                with adapters_disabled(chunks) if lora is not None else contextlib.nullcontext():
                    report.down += self._push(self._weights(full=fresh), version, engines, report)
            if lora is not None and version != INITIAL_VERSION:
                report.down += self._push_adapter(version, engines, fresh, report.down)
            check = self.settings.check_sync_every
            if check and not fresh and self.syncs % check == 0:
                self._check(version, engines, report.down)
        return report

    def _weights(self, full: bool = True):
        """The actor's HF-named weights as the engines take them: block-wise FP8 with rollout.quantization fp8;
        all of them, or (not `full`) all that training can have changed. Of the MTP layers, the one the engines
        draft with (rollout.speculative), else none: no engine loads the others."""
        stream = self._exporter().stream(skip_frozen=not full, mtp_layers=1 if self.settings.num_draft_tokens else 0)
        weight_format = self.settings.weight_format
        return stream if weight_format is None else weight_format.quantised_stream(stream)

    def _exporter(self) -> HFWeightExporter:
        if self.exporter is None:
            self.exporter = HFWeightExporter(self.models.actor.chunks, self.models.weight_map)
        return self.exporter

    def _push(self, stream, version: str, engines: Optional[list[int]], report: SyncReport) -> list[int]:
        if self.delta is None:
            stream = _counted(stream, report.bytes)
        if self.senders is not None:
            return self._push_to_servers(stream, version, engines, report)
        if self.engine is not None and self.delta is not None and self.engine.takes(engines):
            buckets = Bucketer(self.settings.bucket_bytes, self.travel_rules, reuse_buffer=True).buckets(stream)
            self.engine.receive_records(iter_records(buckets, self.delta, report.full, report.bytes), version)
        elif self.engine is not None:
            self.engine.receive_weights(stream, version, engines)
        else:
            collections.deque(stream, maxlen=0)
        return []

    def _push_to_servers(self, stream, version: str, engines: Optional[list[int]], report: SyncReport) -> list[int]:
        """Disaggregated (collective): this rank's push to its own servers among `engines`; every sender's left-out
        servers, gathered on every rank."""
        rank = torch.distributed.get_rank()
        down: list[int] = []
        mine = [e for e in (self.sender_of if engines is None else engines) if self.sender_of[e] == rank]
        failure: Optional[BaseException] = None
        try:
            if mine or (rank == 0 and self.delta is not None):  # rank 0 counts delta's bytes from its records
                as_records = None if self.delta is None else \
                    (lambda buckets: iter_records(buckets, self.delta, report.full, report.bytes))
                down = self.distributed.push(stream, version, only=mine, as_records=as_records)
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            failure = error
        # The rest of the stream (all of it on a rank that sends to no server this time, with no bucket buffer): the
        # export is collective, so a rank whose push failed still walks it for the others.
        with contextlib.suppress(Exception) if failure is not None else contextlib.nullcontext():
            collections.deque(stream, maxlen=0)
        # Every sender's left-out servers and failures, on every rank; and every push has ended before rank 0 checks
        # the servers' weights or has them load an adapter.
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, (down, None if failure is None else repr(failure)))
        if failure is not None:
            raise failure
        failed = [(sender, why) for sender, (_, why) in enumerate(everyone) if why is not None]
        if failed:
            raise WeightPushFailed(f"the weight push failed on trainer rank {failed[0][0]}: {failed[0][1]}")
        return sorted({engine for went, _ in everyone for engine in went})

    def _check(self, version: str, engines: Optional[list[int]], down: list[int]) -> None:
        """Each engine's weights against what a full push of them gives, tensor by tensor (trainer.check_sync_every):
        WeightSyncMismatch naming the first that differs."""
        expected = expected_digests(self._weights(full=True), self.settings.weight_format,
                                    DTYPES[self.settings.model.dtype])
        held: dict[str, dict[str, str]] = {}
        if self.senders is not None:  # disaggregated: rank 0 asks each server (the others know no URL)
            for engine, url in self.server_urls.items():
                if (engines is None or engine in engines) and engine not in down:
                    held[f"rollout engine {engine}"] = SGLangClient(url).weight_digests(sorted(expected))
        elif self.engine is not None and self.engine.takes(engines) and self.engine.leader is not None:
            held[f"rollout engine {self.engine.index}"] = self.engine.leader.weight_digests(sorted(expected))
        for who, digests in held.items():
            wrong = [name for name in expected if digests.get(name) != expected[name]]
            if wrong:
                raise WeightSyncMismatch(f"after the sync of {version}, {who} holds {len(wrong)} of {len(expected)} "
                                         f"tensors other than a full push gives, first {wrong[0]} (trainer."
                                         f"check_sync_every)")

    def _push_adapter(self, version: str, engines: Optional[list[int]], fresh: bool, down: list[int]) -> list[int]:
        """The adapters as a PEFT adapter named `version`, written once (rank 0) and loaded by every server; the
        previous version's files go once every server has loaded its successor."""
        path = os.path.join(self.settings.adapter_dir, version)
        previous, self.adapter_path = self.adapter_path, path
        export_peft_adapter(self._exporter(), path, self.settings.lora, self.settings.model.path)
        went_down = []
        if self.senders is not None:  # disaggregated: rank 0 has each server load it (the others know no URL)
            for engine, url in self.server_urls.items():
                if (engines is not None and engine not in engines) or engine in down:
                    continue
                client = SGLangClient(url)
                try:
                    client.load_lora_adapter(version, path)
                    held = None if fresh else self.loaded_adapters.get(engine)  # a fresh server holds none
                    if held is not None and held != version:
                        client.unload_lora_adapter(held)
                    client.flush_cache()
                except ServerUnavailable:
                    went_down.append(engine)  # as in DistributedWeightPush.push: left out, restarted when next met
                    continue
                self.loaded_adapters[engine] = version
        elif self.engine is not None:
            self.engine.receive_adapter(version, path, version, engines)
        torch.distributed.barrier()
        if previous is not None and previous != path and torch.distributed.get_rank() == 0:
            shutil.rmtree(previous, ignore_errors=True)
        return went_down
