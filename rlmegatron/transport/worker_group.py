"""Worker groups: members that each hold one object of a plain class (a trainer rank, a rollout-pool host) and run the
methods the driver calls on it, in processes of their own as Ray actors or in this process.

Both kinds implement `WorkerGroup`. A caller names the method by reference (`group.call_all(PolicyRank.sync_weights,
version)`), never by a string; the member runs the method of that name on its object, so a subclass's override
runs. The typed handles built on a group (driver.trainer_client.TrainerClient, the rollout pool's hosts in
driver.engine_fleet) are what the rest of the driver calls.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Concatenate, Generic, Mapping, Optional, ParamSpec, Protocol, Sequence, TypeVar

import torch

from rlmegatron.transport.placement import ResourcePool
from rlmegatron.runtime import destroy_distributed, init_distributed
from rlmegatron.runtime.distributed import CollectiveTimeout, is_collective_timeout
from rlmegatron.runtime.distributed import free_port
from rlmegatron.runtime.node import gloo_interface, node_address
from rlmegatron.transport.shared_files import NotShared, SharedFiles
from rlmegatron.transport.local_ranks import RankDied, rank_threads

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


class WorkerGroup(Protocol[T]):
    """Members holding one object of class T each."""

    def __len__(self) -> int:
        ...

    def call_all(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """`method` on every member with the same arguments; results in member order."""

    def call_each(self, method: Callable[..., R], per_member: Mapping[int, tuple]) -> dict[int, R]:
        """`method` on member i with `per_member[i]`, for each i given (in that order where the order matters: in
        this process, one after another)."""

    def shutdown(self) -> None:
        ...


class Member:
    """The body of one member: builds the member's object, then runs the methods called on it. A Ray member first
    moves into the driver's files (`shared`), wherever its node is."""

    def __init__(self, shared: Optional[SharedFiles] = None) -> None:
        self.obj: Any = None
        self.refused: Optional[NotShared] = None
        """Said by `build`, the first call: Ray keeps only the text of what an actor's constructor raises, and a
        user's mistake must reach the driver as itself (its one line)."""
        if shared is not None:
            try:
                shared.enter(node_address())
            except NotShared as refused:
                self.refused = refused

    def build(self, cls: Callable[..., Any], *args: Any) -> None:
        if self.refused is not None:
            raise self.refused
        self.obj = cls(*args)

    def call(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return getattr(self.obj, method.__name__)(*args, **kwargs)

    def shutdown(self) -> None:
        if self.obj is not None and hasattr(self.obj, "shutdown"):
            self.obj.shutdown()


class RankHost(Member):
    """A trainer rank's member: joins the process group before its object is built, leaves it after shutdown. A call
    that waited `collective_timeout_s` in a collective raises CollectiveTimeout, naming the call."""

    def __init__(self, env: dict[str, str], device: str, threads: int = 1,
                 collective_timeout_s: float = 600.0, shared: Optional[SharedFiles] = None) -> None:
        super().__init__(shared)
        os.environ.update(env)
        if self.refused is not None:  # build says why; this rank never joins its group, whose peers are then ended
            return
        os.environ.update(gloo_interface(node_address()))
        torch.set_num_threads(threads)
        init_distributed(device, collective_timeout_s)
        self.collective_timeout_s = collective_timeout_s

    def call(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        try:
            return super().call(method, *args, **kwargs)
        except RuntimeError as error:
            if not is_collective_timeout(error):
                raise
            raise CollectiveTimeout(
                f"{method.__name__}: trainer rank {os.environ['RANK']} waited {self.collective_timeout_s:g} s in a "
                f"collective that other ranks of its group did not join (trainer.collective_timeout_s): one of them "
                f"is stuck or slower than that, or they ran different collectives") from error

    def shutdown(self) -> None:
        super().shutdown()
        destroy_distributed()

    def __repr__(self) -> str:
        # What Ray's state API shows of the actor (`repr_name`): which rank it is and whom it met.
        return (f"RankHost(rank={os.environ['RANK']}, world_size={os.environ['WORLD_SIZE']}, "
                f"rendezvous={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})")


def rank_env(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


# --- in this process -------------------------------------------------------------------------------------------------


class InProcessGroup(Generic[T]):
    """Members in this process, called one after another; member i's object is `group[i]`."""

    def __init__(self, members: Sequence[Member]) -> None:
        self.members = list(members)

    @classmethod
    def of(cls, size: int, member_class: Callable[..., T], *args: Any) -> InProcessGroup[T]:
        """`size` objects `member_class(*args)`."""
        members = [Member() for _ in range(size)]
        for member in members:
            member.build(member_class, *args)
        return cls(members)

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: int) -> T:
        return self.members[index].obj

    def call_all(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return [member.call(method, *args, **kwargs) for member in self.members]

    def call_each(self, method: Callable[..., R], per_member: Mapping[int, tuple]) -> dict[int, R]:
        return {index: self.members[index].call(method, *args) for index, args in per_member.items()}

    def shutdown(self) -> None:
        for member in self.members:
            member.shutdown()


class LocalWorkerGroup(InProcessGroup[T]):
    """One trainer rank in this process: no Ray (tests, debugging, torchrun-less machines)."""

    def __init__(self, device: str, rank_class: Callable[..., T], *args: Any) -> None:
        # On CPU the one rank takes what any CPU rank takes (every core, unless OMP_NUM_THREADS says otherwise). On a
        # GPU it keeps every core for its host-side work, as it did when the GPU harness's figures were measured.
        threads = rank_threads(device, 1) if device == "cpu" else os.cpu_count() or 1
        host = RankHost(rank_env(0, 1, 0, "127.0.0.1", free_port()), device, threads=threads)
        host.build(rank_class, *args)
        super().__init__([host])


# --- Ray actors ------------------------------------------------------------------------------------------------------

# How long the other members get to report after one failed (they may be stuck in a collective with it).
PEER_GRACE_S = 5.0


def gather(refs: list) -> list:
    """ray.get of one call on every member. Ray raises the first failure at once and would later print each other
    member's failure, traceback and all, as an unhandled error: those that come within PEER_GRACE_S are fetched here,
    so one failure (a user's mistake is then one line) is all that is said: the first, unless a member died, whose
    death is then why its peers' collectives failed (a reset connection) and what is raised."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayError as first:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_GRACE_S)
        died = None
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as error:
                died = died or error
            except ray.exceptions.RayError:
                pass
        if died is not None and not isinstance(first, ray.exceptions.RayActorError):
            raise died from None
        raise


def master_address() -> tuple[str, int]:
    """The rendezvous of a process group whose rank 0 runs where this is called: its node's address, a free port."""
    return node_address(), free_port(host="")


class RayActorGroup(Generic[T]):
    """Ray actors, member i on bundle i of a pool."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.unanswered: list = []
        """The calls of a gather the driver gave up on (Ctrl-C, SIGTERM): their members are still busy with them."""

    @classmethod
    def on(cls, pool: ResourcePool, size: int, member_class: Callable[..., T], *args: Any,
           concurrency: int = 1) -> RayActorGroup[T]:
        """`size` objects `member_class(*args)` on the first `size` bundles of `pool`, each running up to
        `concurrency` calls at once (on threads of its process)."""
        actors = [_placed(Member, pool, index, max_concurrency=concurrency).remote(pool.shared)
                  for index in range(size)]
        group = cls(actors)
        group._gather([actor.build.remote(member_class, *args) for actor in actors])
        return group

    def _gather(self, refs: list) -> list:
        import ray

        self.unanswered = refs
        try:
            replies = gather(refs)
        except ray.exceptions.RayError:  # every member answered, or is gone
            self.unanswered = []
            raise
        self.unanswered = []
        return replies

    def __len__(self) -> int:
        return len(self.actors)

    def call_all(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        import ray

        # One copy in the object store for all members, not one serialization per member (batches are large).
        shared = [ray.put(arg) for arg in args]
        return self._gather([actor.call.remote(method, *shared, **kwargs) for actor in self.actors])

    def call_each(self, method: Callable[..., R], per_member: Mapping[int, tuple]) -> dict[int, R]:
        replies = self._gather([self.actors[index].call.remote(method, *args) for index, args in per_member.items()])
        return dict(zip(per_member, replies))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Orderly where the members are idle; members still busy with a call the driver gave up on (an interrupted
        step: a SIGTERM, as scancel sends, may also be stopping their nodes) are killed at once, as are all after
        `timeout_s`; their engine servers go with them (`lifeline`)."""
        import ray

        try:
            busy = self.unanswered and len(ray.wait(self.unanswered, num_returns=len(self.unanswered),
                                                    timeout=0)[0]) < len(self.unanswered)
            if not busy:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            pass
        finally:
            for actor in self.actors:
                ray.kill(actor)


class RayWorkerGroup(RayActorGroup[T]):
    """The trainer ranks: `pool.world_size` Ray actors, rank i on bundle i of the pool, one process group."""

    def __init__(self, pool: ResourcePool, rank_class: Callable[..., T], *args: Any,
                 collective_timeout_s: float = 600.0) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = pool.world_size
        threads = rank_threads(pool.device, world_size)
        # Rank 0's node hosts the rendezvous: this one's address, or on another node, one from a probe placed like
        # rank 0 (a worker process of its own, which takes seconds to start: a local cluster does without).
        if pool.nodes[0] == ray.get_runtime_context().get_node_id():
            addr, port = master_address()
        else:
            probe = ray.remote(master_address).options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pool.placement_group, pool.bundle_of(0)),
                num_cpus=0,
            )
            addr, port = ray.get(probe.remote())
        self.rendezvous = f"{addr}:{port}"
        actors = []
        for rank in range(world_size):
            # On GPU Ray sets CUDA_VISIBLE_DEVICES to the rank's GPU of its node's bundle, so it sees its device as 0.
            env = rank_env(rank, world_size, 0 if pool.device == "cuda" else rank % pool.per_node, addr, port)
            actors.append(_placed(RankHost, pool, rank).remote(env, pool.device, threads, collective_timeout_s,
                                                               pool.shared))
        super().__init__(actors)
        self.where = {actor._actor_id.hex(): f"trainer rank {rank} on node {pool.addresses[rank]}"
                      for rank, actor in enumerate(actors)}
        try:
            self._gather([actor.build.remote(rank_class, *args) for actor in actors])
        except BaseException:
            # Its peers may wait in the process group's rendezvous for a rank that will never join.
            for actor in actors:
                ray.kill(actor)
            raise

    def _gather(self, refs: list) -> list:
        """A rank that is gone is named with its node: a process that died, or a node that left the cluster."""
        import ray

        try:
            return super()._gather(refs)
        except ray.exceptions.RayActorError as error:
            who = self.where.get(error.actor_id or "", "a trainer rank")
            raise RankDied(f"{who} is gone: its process or its node ended (Ray: {type(error).__name__})") from error


def _placed(member_class: type, pool: ResourcePool, index: int, **options: Any):
    """`member_class` as a Ray actor class for rank `index` of `pool`: one GPU (or CPU) of its node's bundle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = {"num_gpus": 1, "num_cpus": 1} if pool.device == "cuda" else {"num_cpus": 1}
    strategy = PlacementGroupSchedulingStrategy(pool.placement_group, pool.bundle_of(index))
    return ray.remote(member_class).options(scheduling_strategy=strategy, **resources, **options)


def group_on(pool: Optional[ResourcePool], size: int, member_class: Callable[..., T], *args: Any,
             concurrency: int = 1) -> WorkerGroup[T]:
    """`size` objects `member_class(*args)`: Ray actors on `pool` (each running up to `concurrency` calls at once), or
    (no pool: a run without Ray) in this process, where the callers' threads run them."""
    if pool is None:
        return InProcessGroup.of(size, member_class, *args)
    return RayActorGroup.on(pool, size, member_class, *args, concurrency=concurrency)
