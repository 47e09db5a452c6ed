"""Where SGLang servers sit and how one is launched, for the processes that launch them (a trainer rank when colocated,
a rollout-pool host when disaggregated) and the driver that lays them out.

A server's TP ranks take slots (`Place`: a trainer rank, or a GPU of the rollout pool) on whole nodes; the first slot
of each node starts that node's server process, node 0 serves HTTP and is supervised by an `SGLangEngine`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.agent_loop import AgentLoop
from rlmegatron.rollout.buckets import travel_rules_for
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, RolloutEngine
from rlmegatron.rollout.sglang.engine import EngineRestarted, SGLangEngine
from rlmegatron.rollout.sglang.protocol import RoutedExpertsLayout
from rlmegatron.rollout.sglang.server import RETURN_ROUTED_EXPERTS, ServerSpec, installed_sglang
from rlmegatron.runtime.distributed import free_port
from rlmegatron.runtime.node import node_address, node_id
from rlmegatron.tracking.progress import Progress


@dataclass(frozen=True)
class Place:
    """One slot that can hold a server TP rank: a trainer rank (colocated) or a rollout-pool GPU (disaggregated)."""

    node: str
    """Its node's identity (runtime.node.node_id): a Ray node id, or without Ray the hostname."""
    device: str
    address: str
    rendezvous_port: int
    """Free on this node; the server's node 0 uses it as SGLang's dist-init address when it spans nodes."""


def this_place(device: str) -> Place:
    return Place(node_id(), device_id(device), node_address(), free_port(""))


def device_id(device: str) -> str:
    """This process's physical device: Ray narrows CUDA_VISIBLE_DEVICES to its GPU, torchrun sets LOCAL_RANK."""
    if device != "cuda":
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[torch.cuda.current_device()]
    return str(torch.cuda.current_device())


ServerDevices = tuple[tuple[str, str], ...]
"""A server's TP ranks as (node, device) each, in TP order: where its weight-update group's members sit."""


def weight_group_backend(device: str, server: ServerDevices) -> str:
    """The backend of the group over which this process (a sending trainer rank) broadcasts weights to a disaggregated
    server: NCCL between GPUs; gloo on CPU, and where one of the server's ranks is on this process's own GPU (one GPU
    split between trainer and engine, a run without Ray): NCCL refuses two ranks of a group on one device ("Duplicate
    GPU detected"), while gloo stages CUDA tensors through host memory."""
    if device != "cuda":
        return "gloo"
    return "gloo" if (node_id(), device_id(device)) in server else "nccl"


@dataclass(frozen=True)
class ServerNode:
    """One node's share of engine `engine`: `slots` (indices of places, in server TP order) of which the first
    launches this node's server process; `node_rank` 0 serves HTTP."""

    engine: int
    node_rank: int
    nnodes: int
    slots: tuple[int, ...]
    dist_init_addr: Optional[str]


def server_nodes(places: Sequence[Place], tp: int, engines: int) -> list[list[ServerNode]]:
    """Engine e takes slots e*tp .. e*tp+tp-1. SGLang splits a server's TP ranks evenly over whole nodes, so
    an engine's slots must form equal runs on distinct nodes."""
    layout = []
    for engine in range(engines):
        slots = range(engine * tp, (engine + 1) * tp)
        runs: list[list[int]] = []
        for slot in slots:
            if runs and places[runs[-1][0]].node == places[slot].node:
                runs[-1].append(slot)
            else:
                runs.append([slot])
        nodes = [places[run[0]].node for run in runs]
        if len(set(nodes)) != len(runs) or len({len(run) for run in runs}) != 1:
            raise RuntimeError(f"engine {engine} would take {[len(run) for run in runs]} GPUs on nodes {nodes}; "
                               "a server spans whole nodes with the same number of GPUs on each")
        head = places[runs[0][0]]
        address = f"{head.address}:{head.rendezvous_port}" if len(runs) > 1 else None
        layout.append([ServerNode(engine, rank, len(runs), tuple(run), address) for rank, run in enumerate(runs)])
    return layout


def launch_spec(settings: RolloutSettings, devices: Sequence[str], host: str, node: ServerNode) -> ServerSpec:
    """The launch spec of `node`'s share of a server on `devices` of that node, serving HTTP on `host`."""
    env = {}
    if settings.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    else:
        # CPU buckets reach the unrelated server process through named shared memory, not fd passing.
        torch.multiprocessing.set_sharing_strategy("file_system")
    # The flags are spelled for the SGLang the interpreter on this node has (server.RENAMED_IN).
    version = installed_sglang(settings.server.python) if settings.engine == "sglang" else None
    return dataclasses.replace(settings.server, port=free_port(host), host=host, env=env, nnodes=node.nnodes,
                               node_rank=node.node_rank, dist_init_addr=node.dist_init_addr, sglang_version=version)


def sglang_engine(settings: RolloutSettings, server: ServerSpec, hf_config, ipc_group=None) -> SGLangEngine:
    """A supervised SGLang server: node 0 of `server`, launched here and waited on."""
    return SGLangEngine(
        server,
        log_dir=settings.log_dir,
        bucket_bytes=settings.bucket_bytes,
        travel_rules=travel_rules_for(hf_config),
        router_url=settings.router_url,
        startup_timeout_s=settings.startup_timeout_s,
        ipc_group=ipc_group,
        lora_adapters=settings.lora is not None,
        partial_rollout=settings.partial_rollout,
        routing=RoutedExpertsLayout.of(hf_config) if server.extra_args.get(RETURN_ROUTED_EXPERTS) else None,
    )


def generate_or_none(engine: RolloutEngine, requests: list[GenerationRequest], progress: Progress = None,
                     agent: Optional[AgentLoop] = None) -> Optional[list[GenerationResult]]:
    """Through the agent loop when there is one (multi-turn). None: the engine was restarted mid-call and needs the
    weights before the requests are sent again."""
    if not requests:
        return []
    try:
        return engine.generate(requests, progress) if agent is None else agent.generate(engine, requests, progress)
    except EngineRestarted:
        return None
