"""Worker groups: one process per rank hosting a plain rank class, as Ray actors or in-process (one rank, no Ray)."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Callable

from rlmegatron.controller.placement import ResourcePool
from rlmegatron.runtime.launcher import free_port


def rank_env(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


class RankHost:
    """The body of one rank's process: joins the process group, then builds and serves the rank object."""

    def __init__(self, env: dict[str, str], device: str, threads: int = 1) -> None:
        import torch

        from rlmegatron.runtime import init_distributed

        os.environ.update(env)
        # One core per rank: more threads only fight over the same cores.
        torch.set_num_threads(threads)
        init_distributed(device)
        self.rank = None

    def build(self, rank_class: Callable[..., Any], *args: Any) -> None:
        self.rank = rank_class(*args)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.rank, method)(*args)

    def shutdown(self) -> None:
        from rlmegatron.runtime import destroy_distributed

        if self.rank is not None and hasattr(self.rank, "shutdown"):
            self.rank.shutdown()
        destroy_distributed()


# How long the other ranks get to report after one failed (they may be stuck in a collective with it).
PEER_GRACE_S = 5.0


def gather(refs: list) -> list:
    """ray.get of one call on every rank. Ray raises the first failure at once and would later print each other
    rank's failure, traceback and all, as an unhandled error: those that come within PEER_GRACE_S are fetched here,
    so the first failure (a user's mistake is then one line) is all that is said."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayError:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_GRACE_S)
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref)
        raise


def master_address() -> tuple[str, int]:
    return socket.gethostbyname(socket.gethostname()), free_port(host="")


class RayWorkerGroup:
    """`pool.world_size` Ray actors, rank i on bundle i of the pool, all running the same rank class."""

    def __init__(self, pool: ResourcePool, rank_class: Callable[..., Any], *args: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host_class = ray.remote(RankHost)
        world_size = pool.world_size

        def placed(rank: int):
            resources = {"num_gpus": 1, "num_cpus": 1} if pool.device == "cuda" else {"num_cpus": 1}
            strategy = PlacementGroupSchedulingStrategy(pool.placement_group, pool.bundle_order[rank])
            return host_class.options(scheduling_strategy=strategy, **resources)

        # Rank 0's node hosts the rendezvous, so its address comes from a probe placed like rank 0.
        probe = ray.remote(master_address).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pool.placement_group, pool.bundle_order[0]),
            num_cpus=0,
        )
        addr, port = ray.get(probe.remote())
        self.ranks = []
        for rank in range(world_size):
            # On GPU Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPU, so each rank sees its device as 0.
            env = rank_env(rank, world_size, 0 if pool.device == "cuda" else rank, addr, port)
            self.ranks.append(placed(rank).remote(env, pool.device))
        gather([host.build.remote(rank_class, *args) for host in self.ranks])

    def execute_all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank with the same arguments; results in rank order."""
        import ray

        # One copy in the object store for all ranks, not one serialization per rank (batches are large).
        shared = [ray.put(arg) for arg in args]
        return gather([host.call.remote(method, *shared) for host in self.ranks])

    def execute_rank_zero_result(self, method: str, *args: Any) -> Any:
        """Call on every rank (the workers run collectives) and return rank 0's result: every rank holds the same."""
        return self.execute_all(method, *args)[0]

    def execute_each(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        """Call `method` on rank i with `per_rank_args[i]` (e.g. each rank's share of the prompts)."""
        return gather([host.call.remote(method, *args) for host, args in zip(self.ranks, per_rank_args)])

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Orderly where the ranks are idle; a rank still busy (an interrupted step) is killed after `timeout_s`,
        and its engine servers go with it (`lifeline`)."""
        import ray

        try:
            ray.get([host.shutdown.remote() for host in self.ranks], timeout=timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            pass
        finally:
            for host in self.ranks:
                ray.kill(host)


class LocalWorkerGroup:
    """The same interface with one rank in this process: no Ray (tests, debugging, torchrun-less machines)."""

    def __init__(self, device: str, rank_class: Callable[..., Any], *args: Any) -> None:
        self.host = RankHost(rank_env(0, 1, 0, "127.0.0.1", free_port()), device, threads=os.cpu_count() or 1)
        self.host.build(rank_class, *args)

    def execute_all(self, method: str, *args: Any) -> list[Any]:
        return [self.host.call(method, *args)]

    def execute_rank_zero_result(self, method: str, *args: Any) -> Any:
        return self.host.call(method, *args)

    def execute_each(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        return [self.host.call(method, *per_rank_args[0])]

    @property
    def world_size(self) -> int:
        return 1

    def shutdown(self) -> None:
        self.host.shutdown()
