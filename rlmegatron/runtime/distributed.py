"""Process-group and model-parallel setup: cuda + nccl on GPUs, cpu + gloo (with the CPU layer) otherwise."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import os
import random
import socket
import types
from dataclasses import dataclass
from typing import Iterator, Literal, Optional, Sequence

import torch

from rlmegatron.runtime.cpu_compat import enable_cpu_compat
from rlmegatron.runtime.notices import quiet_library_notices

Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron parallel sizes of one model; data parallelism is whatever the world size leaves."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # None: experts use the dense TP size
    sequence_parallel: bool = False
    # Uneven pipeline: decoder layers on the first/last stage, the rest split evenly (None: even split).
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def transformer_config_fields(self) -> dict:
        """The TransformerConfig fields that carry this layout."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=self.sequence_parallel,
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            num_layers_in_last_pipeline_stage=self.last_stage_layers,
        )

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.first_stage_layers or self.last_stage_layers:
            parts[-1] += f"({self.first_stage_layers or '-'},{self.last_stage_layers or '-'})"
        parts += [f"VPP{self.vpp}"] if self.vpp else []
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"ETP{self.etp}"] if self.etp else []
        parts += ["SP"] if self.sequence_parallel else []
        return "x".join(parts)


def transformer_config_overrides(device: Device) -> dict:
    """TransformerConfig fields the process-group backend dictates."""
    if device == "cpu":
        # gloo pairs sends and receives to one peer in posting order, so batched p2p can
        # swap the interleaved (VPP) schedule's activation and gradient: same shape, and
        # at PP=2 the same peer. Megatron's unbatched path orders them by rank parity.
        return {"batch_p2p_comm": False}
    return {}


class CollectiveTimeout(RuntimeError):
    """A rank waited longer than the process group's timeout in a collective: a peer never joined it (stuck, far
    slower, or running a different sequence of collectives). The message names the rank's call."""


# What the backends' timeouts say: gloo's RuntimeError, and NCCL's watchdog where it raises (DistBackendError)
# rather than ending the process.
_TIMEOUT_MARKERS = ("Timed out waiting", "Watchdog caught collective operation timeout")


def is_collective_timeout(error: BaseException) -> bool:
    """Whether `error` is the process group's timeout."""
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _TIMEOUT_MARKERS)


_timeout = datetime.timedelta(seconds=600.0)
"""init_distributed's timeout, which every group built later here (Megatron's included) gets too."""


def collective_timeout() -> datetime.timedelta:
    """How long a collective of this process's groups waits for its peers."""
    return _timeout


def init_distributed(device: Device, timeout_s: float = 600.0) -> None:
    """Join the default process group from torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT); a collective
    that waits `timeout_s` for its peers raises (CollectiveTimeout's causes), in this group and every later one."""
    global _timeout
    quiet_library_notices(device)
    _timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cpu":
        enable_cpu_compat()
        backend = "gloo"
    elif device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=_timeout)


@dataclass
class _LayoutState:
    """One layout's Megatron model-parallel state while another layout is active."""

    parallel_state: dict  # parallel_state's module globals: its groups, ranks and sizes
    rng_states: dict  # the model-parallel RNG tracker's states (dropout, init)


_megatron_groups: list = []
"""The process groups the last init_model_parallel created (every layout's), destroyed when it rebuilds."""
_layouts: dict[ParallelLayout, _LayoutState] = {}
_active: Optional[ParallelLayout] = None


def _groups_key(layout: ParallelLayout) -> ParallelLayout:
    # Sequence parallelism lives in the TransformerConfig, not in the groups.
    return dataclasses.replace(layout, sequence_parallel=False)


def _parallel_state_globals() -> dict:
    """parallel_state's private module globals. Megatron-Core 0.16 and 0.19 both keep every group, rank list and
    size there, and every reader (Megatron's and ours) looks them up at call time, so swapping them swaps layouts."""
    from megatron.core import parallel_state

    return {name: value for name, value in vars(parallel_state).items()
            if name.startswith("_") and not name.startswith("__")
            and not callable(value) and not isinstance(value, types.ModuleType)}


def _set_parallel_state_globals(values: dict) -> None:
    from megatron.core import parallel_state

    for name, value in values.items():
        setattr(parallel_state, name, value)


def _activate(key: Optional[ParallelLayout]) -> None:
    """Make `key`'s groups and RNG streams Megatron's current ones, keeping the outgoing layout's as they now are."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    global _active
    if key == _active:
        return
    tracker = get_cuda_rng_tracker()
    if _active is not None:
        _layouts[_active] = _LayoutState(_parallel_state_globals(), tracker.get_states())
    if key is not None:
        _set_parallel_state_globals(_layouts[key].parallel_state)
        tracker.set_states(dict(_layouts[key].rng_states))
    _active = key


def init_model_parallel(layout: ParallelLayout, seed: int = 1234, others: Sequence[ParallelLayout] = ()) -> None:
    """(Re)build Megatron's parallel groups for `layout` and each of `others`, seeding each layout's RNG streams;
    `layout` is active afterwards and `layout_scope` switches to another. Collective.

    Megatron's destroy_model_parallel only forgets its groups; each gloo group keeps three threads and its
    sockets, so a process that changes layout thirty times (the conversion matrix) ran ~2,000 threads per rank.
    Rebuilding therefore destroys every previous layout's groups: models built under them are unusable after."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from torch.distributed.distributed_c10d import _world

    global _active
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in _megatron_groups:
        if group in _world.pg_map:  # Megatron destroys its gloo data-parallel groups itself
            torch.distributed.destroy_process_group(group)
    _megatron_groups.clear()
    _layouts.clear()
    _active = None
    blank = _parallel_state_globals()
    for key in dict.fromkeys(_groups_key(each) for each in (layout, *others)):
        # Each layout starts from Megatron's uninitialised state, with containers of its own.
        _set_parallel_state_globals({name: copy.copy(value) if isinstance(value, (list, dict)) else value
                                     for name, value in blank.items()})
        existing = set(_world.pg_map)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=key.tp,
            pipeline_model_parallel_size=key.pp,
            virtual_pipeline_model_parallel_size=key.vpp,
            context_parallel_size=key.cp,
            expert_model_parallel_size=key.ep,
            expert_tensor_parallel_size=key.etp,
            # Megatron's groups otherwise wait its own default (half an hour), whatever the default group's timeout is.
            distributed_timeout_minutes=_timeout.total_seconds() / 60,
        )
        _megatron_groups.extend(group for group in _world.pg_map if group not in existing)
        model_parallel_cuda_manual_seed(seed)
        _layouts[key] = _LayoutState(_parallel_state_globals(), get_cuda_rng_tracker().get_states())
    _active = key  # the live globals are the last-built layout's
    _activate(_groups_key(layout))


@contextlib.contextmanager
def layout_scope(layout: ParallelLayout) -> Iterator[None]:
    """`layout`'s parallel groups and RNG streams active for the duration (models built under a layout run only
    under it); the previously active layout's again after."""
    key = _groups_key(layout)
    if key not in _layouts:
        raise ValueError(f"no parallel groups were built for {layout}; pass it to init_model_parallel")
    previous = _active
    _activate(key)
    try:
        yield
    finally:
        _activate(previous)


def rng_tracker_states() -> dict[str, dict]:
    """Every built layout's model-parallel RNG states, by layout (a checkpoint keeps them to resume exactly)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {str(key): state.rng_states for key, state in _layouts.items()}
    if _active is not None:
        states[str(_active)] = get_cuda_rng_tracker().get_states()
    return states


def set_rng_tracker_states(states: dict[str, dict]) -> None:
    """Restore `rng_tracker_states()`; a layout the checkpoint did not have keeps its fresh seeding."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    for key, state in _layouts.items():
        if str(key) in states:
            state.rng_states = states[str(key)]
    if _active is not None:
        get_cuda_rng_tracker().set_states(dict(_layouts[_active].rng_states))


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    global _active
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _megatron_groups.clear()  # destroyed with everything else just below
    _layouts.clear()
    _active = None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce_shared(tensor: torch.Tensor, group, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    """all_reduce over `group` when it has more than one rank. A group of one (TP=1, PP=1, one DP rank) leaves the
    tensor as it is, but a gloo all_reduce over it still costs a round through the backend, and a step makes a
    dozen (benchmarks/RESULTS.md, "Measured reasons in the code")."""
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor


# Ray's worker processes listen on 10002-19999 by default; ports are picked above them.
_LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    """The lowest port of the kernel's range for outgoing connections' local ports (Linux's default where it cannot
    be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now; "" probes every interface (a rendezvous other nodes connect to).

    Picked at random below the kernel's ephemeral range, not by binding port 0: a server binds its port a second
    or more after it is picked, and a port from the ephemeral range can meanwhile become the local end of any
    outgoing connection on the machine (gloo's, Ray's, an HTTP client's); the parallel test suite saw a colocated
    SGLang server fail on EADDRINUSE that way. Two pickers may still draw the same port, one time in ~12,000."""
    low = _ephemeral_low()
    draw = random.SystemRandom()  # not the random module's state: a seeded run would pick the same ports everywhere
    for _ in range(64) if low - 1 > _LOWEST_PORT else ():
        port = draw.randint(_LOWEST_PORT, low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no such range here, or all of it taken
        sock.bind((host, 0))
        return sock.getsockname()[1]
