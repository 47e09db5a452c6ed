"""Weight pushes into SGLang servers: colocated, each trainer rank shares its copy of every bucket (shared memory or CUDA
IPC) with the server rank on its GPU; disaggregated, each trainer rank (rank/weight_push.sending_ranks)
broadcasts each bucket over a weight-update group of each of its servers."""
from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import torch

from rlmegatron.rollout.buckets import Bucketer, FlattenedBucket, NamedTensor, TravelRule
from rlmegatron.rollout.delta import LOADER as DELTA_LOADER
from rlmegatron.rollout.engine import WeightStream
from rlmegatron.rollout.sglang.client import SGLangClient, SGLangRequestError, ServerUnavailable, tensor_update_body
from rlmegatron.rollout.sglang.protocol import (
    DistributedGroupSpec,
    init_custom_process_group,
    on_the_wire,
    serialize_flattened_bucket,
    serialize_records,
)


def share_buckets(named_tensors: WeightStream, bucket_bytes: int, travel_rules: Sequence[TravelRule], tp_size: int,
                  group: torch.distributed.ProcessGroup | None, post: Callable[[list[str]], Any] | None) -> None:
    """Colocated push, run by every rank of `group` on the same stream (the export yields it on every rank).

    Each rank shares its own copy of each bucket, so server TP rank i opens memory of trainer rank i, which sits on
    its GPU and its node: no cross-device reads, and a server spanning nodes works. The group's first rank, which
    gets `post`, sends the tp_size handles in one request. Without a group, one copy serves every TP rank.
    """
    bucketer = Bucketer(bucket_bytes, travel_rules, reuse_buffer=True, shared_memory=True)
    for bucket in bucketer.buckets(named_tensors):
        payload = serialize_flattened_bucket(bucket)
        if group is None:
            payloads = [payload] * tp_size
        else:
            payloads = [None] * group.size() if post is not None else None
            torch.distributed.gather_object(payload, payloads, group_dst=0, group=group)
        if post is not None:
            post(payloads)  # returns once the server loaded the bucket
        if group is not None:
            torch.distributed.barrier(group=group)  # ...so every rank may reuse its buffer
        if bucket.flattened_tensor.is_cuda:
            torch.cuda.ipc_collect()


FLUSH_TIMEOUT_S = 30.0
"""How long a flush at the end of a push waits for the server to be idle: it is paused, so only what it ran when the
pause came (a router's health check) can keep it busy."""


class DistributedWeightPush:
    """Trainer side of disaggregated sync (run on each sending trainer rank): one process group per server, with
    this process as rank 0 and the server's TP ranks as 1..tp, built exactly as SGLang's `init_weights_update_group`
    does; one bucketed pass over the weight stream, each bucket sent to all its servers at once (their transfers
    share this rank's link, their loads overlap), the next bucket once every server has answered for it."""

    def __init__(self, bucket_bytes: int, travel_rules: Sequence[TravelRule] = (), timeout_s: float = 600.0,
                 by_records: bool = False) -> None:
        """`by_records` (delta sync): every push goes as records in request bodies (`push(as_records=...)`), so no
        weight-update group is made."""
        self.bucket_bytes = bucket_bytes
        self.travel_rules = tuple(travel_rules)
        self.timeout_s = timeout_s
        self.by_records = by_records
        self.servers: dict[int, tuple[SGLangClient, DistributedGroupSpec, torch.distributed.ProcessGroup]] = {}
        self.tp_sizes: dict[int, int] = {}

    def connect(self, key: int, url: str, tp_size: int, group: DistributedGroupSpec) -> None:
        """Joins a group with server `key`; a restarted server gets a new group (its old members are gone)."""
        client = SGLangClient(url, self.timeout_s)
        client.check_version()
        self.tp_sizes[key] = tp_size
        if self.by_records:
            self.servers[key] = (client, group, None)
            return
        world_size = 1 + tp_size  # tp_size counts the server's ranks on all its nodes
        pending = _in_thread(lambda: client.init_weights_update_group(
            group.master_address, group.master_port, 1, world_size, group.group_name, group.backend
        ))
        process_group = init_custom_process_group(
            group.backend, f"tcp://{group.master_address}:{group.master_port}", world_size, 0, group.group_name
        )
        pending.result()
        self.servers[key] = (client, group, process_group)

    def disconnect(self, key: int) -> None:
        """Server `key` left: its group goes (the server, stopping, leaves it too)."""
        server = self.servers.pop(key, None)
        self.tp_sizes.pop(key, None)
        if server is not None and server[2] is not None:
            torch.distributed.destroy_process_group(server[2])

    def push(self, named_tensors: WeightStream, version: str, only: Sequence[int] | None = None,
             as_records: Callable[[Iterable[FlattenedBucket]], Iterable[list[NamedTensor]]] | None = None
             ) -> list[int]:
        """Per bucket and server: announce names/dtypes/shapes, then broadcast in exactly that order while the
        server's request is pending. `only` limits the push to those servers (restarted ones). `as_records` (delta
        sync) makes each bucket records (rollout/delta.py) that go instead to the server's custom weight loader
        (`DELTA_LOADER`) in the body of `/update_weights_from_tensor`: SGLang's distributed update hands what it
        receives to the model's own loader, which takes whole tensors only.

        Atomic for generation: each server is paused for the whole push, so a request that arrives between two
        buckets waits and then runs whole on the new weights (SGLang takes its writer lock per update call, and
        would run it on a mix, labelled with the new version). The caller decides what happens to the samples in
        flight first (`SGLangEngine.pause_generation`). The push ends with a flush of the prefix cache the old
        weights computed, while the server is still paused.

        Returns the servers left out: gone (ServerUnavailable), or that refused a bucket or the flush
        (SGLangRequestError); the others get every bucket all the same, and the stream is walked whole, as the
        other trainer ranks export it collectively. A server left out joins a new group before it takes weights
        again (the fleet recovers it: at once if it lives, else when generation next meets it). Every session begun
        is ended and every server paused is continued, whatever failed: a session left open refuses the next."""
        if self.by_records and as_records is None:
            raise ValueError("a push without records to servers joined without a weight-update group (by_records)")
        keys = list(self.servers if only is None else only)
        down: list[int] = []
        paused: list[int] = []
        begun: list[int] = []
        try:
            for key in keys:
                client = self.servers[key][0]
                try:
                    client.pause_generation()
                    paused.append(key)
                    client.begin_weight_update()
                    begun.append(key)
                except (ServerUnavailable, SGLangRequestError):
                    down.append(key)
            try:
                buckets = Bucketer(self.bucket_bytes, self.travel_rules, reuse_buffer=True).buckets(named_tensors)
                if as_records is None:
                    self._broadcast(buckets, version, keys, down)
                else:
                    self._post(as_records(buckets), version, keys, down)
            finally:
                for key in begun:
                    try:
                        self.servers[key][0].end_weight_update()
                    except (ServerUnavailable, SGLangRequestError):
                        if key not in down:
                            down.append(key)
            for key in keys:
                if key in down:
                    continue
                try:
                    flushed = self.servers[key][0].flush_cache(FLUSH_TIMEOUT_S)
                except ServerUnavailable:
                    flushed = False
                if not flushed:  # its cache still holds what the old weights computed: not to be generated from
                    down.append(key)
        finally:
            for key in paused:
                with contextlib.suppress(ServerUnavailable, SGLangRequestError):  # gone: the fleet recovers it
                    self.servers[key][0].continue_generation()
        return down

    def _post(self, records: Iterable[list[NamedTensor]], version: str, keys: list[int], down: list[int]) -> None:
        posted = False
        with ThreadPoolExecutor(max_workers=max(len(keys), 1)) as servers:
            # A bucket in which nothing changed sends nothing; a push in which nothing did still sends one (empty)
            # payload, which labels the server's weights with the new version.
            for bucket_records in itertools.chain(records, [[]]):
                if not bucket_records and posted:
                    continue
                posted = True
                payload = serialize_records(bucket_records)
                # One payload per server TP rank, each its own copy of the bucket; every server's at once, one body
                # for all servers of a TP size (the bodies are the bucket's size times the TP).
                bodies = {tp: tensor_update_body([payload] * tp, version, load_format=DELTA_LOADER)
                          for tp in {self.tp_sizes[key] for key in keys if key not in down}}
                answers = {key: servers.submit(self.servers[key][0].post_tensor_update, bodies[self.tp_sizes[key]])
                           for key in keys if key not in down}
                for key, answer in answers.items():
                    try:
                        answer.result()
                    except (ServerUnavailable, SGLangRequestError):
                        down.append(key)

    def _broadcast(self, buckets: Iterable[FlattenedBucket], version: str, keys: list[int], down: list[int]) -> None:
        for bucket in buckets:
            pairs = bucket.named_tensors()
            sending = {}
            failure: BaseException | None = None  # what no server's answer explains: raised once every server settled
            for key in keys:
                if key in down:
                    continue
                client, group, process_group = self.servers[key]
                announce = _in_thread(lambda client=client, group=group: client.update_weights_from_distributed(
                    names=[name for name, _ in pairs],
                    dtypes=[str(tensor.dtype).removeprefix("torch.") for _, tensor in pairs],
                    shapes=[list(tensor.shape) for _, tensor in pairs],
                    group_name=group.group_name,
                    weight_version=version,
                ))
                # Queued, not waited on one by one: a server that refuses the announcement (and so never joins)
                # fails the push with its answer instead of leaving this rank in a broadcast for ever; and every
                # server takes the bucket at once, each on its own group.
                try:
                    sending[key] = announce, [torch.distributed.broadcast(on_the_wire(tensor, group.backend),
                                                                          group_src=0, group=process_group,
                                                                          async_op=True) for _, tensor in pairs]
                except Exception as error:  # noqa: BLE001 - re-raised below, once the others have the bucket
                    down.append(key)
                    failure = failure or error
            for key, (announce, sent) in sending.items():
                try:
                    announce.result()
                except (ServerUnavailable, SGLangRequestError):
                    down.append(key)  # its broadcasts go with its group, which is never used again
                    continue
                try:
                    for work in sent:
                        work.wait()
                except Exception as error:  # noqa: BLE001 - as above
                    down.append(key)
                    failure = failure or error
            if failure is not None:
                raise failure


def _in_thread(call: Callable[[], Any]) -> Future:
    """An HTTP call that blocks server-side until this process joins a collective, run alongside it."""
    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(call)
    executor.shutdown(wait=False)
    return future
