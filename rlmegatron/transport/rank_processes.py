"""The trainer ranks as plain processes on this machine, driven over pipes: a `WorkerGroup` without Ray
(placement.transport=processes).

Ray costs a one-node run seconds of start-up (its import and `ray.init`) and milliseconds per actor call
(benchmarks/RESULTS.md, "Start-up"); a pipe to a forked process costs neither. Each rank is forked from the fork server
(transport.fork_server), which imported torch, Megatron-Core, transformers and the rank's class once, while the
driver was still checking the job; a rank then joins the process group (`RankHost`), builds its object and runs the
calls sent to it, one at a time, in order, as a Ray actor does.

Failures are reported as RayWorkerGroup reports them: a rank's exception is raised in the driver with its own type (the
trainer catches a Divergence by type; a UserError stays one line), its traceback as the cause; a rank that dies fails
the call at once, naming it; after the first failure the other ranks get `PEER_GRACE_S` to report (they may be stuck in
a collective with it), then the call raises the failure that caused the others (`_cause`). No rank outlives the driver:
each ends its own process group when the driver's process is gone, however it went (SIGKILL included).
"""
from __future__ import annotations

import contextlib
import copyreg
import io
import os
import pickle
import select
import signal
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Concatenate, Generic, Mapping, Optional, ParamSpec, TypeVar

import torch

from rlmegatron.transport.worker_group import PEER_GRACE_S, RankHost, rank_env
from rlmegatron.errors import user_error_in
from rlmegatron.runtime.distributed import free_port
from rlmegatron.transport.fork_server import fork_server
from rlmegatron.transport.local_ranks import RankDied, RankFailure, RankUserError, rank_threads, stop_processes
from rlmegatron.tracking.progress import ProgressBar

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

_PROGRESS = "progress"
"""The persistent id a driver-side progress callback travels as: the rank gets a stand-in that reports back."""


class RankProcesses(Generic[T]):
    """`world_size` ranks of `rank_class(*args)` on this machine, rank i as local rank i, one process group.

    The constructor returns as soon as the processes are forked (the fork server must have done its imports) and told
    what to build: they build while the driver goes on; the first call waits for them (and raises what building
    raised)."""

    def __init__(self, device: str, world_size: int, rank_class: Callable[..., T], *args: Any,
                 collective_timeout_s: float = 600.0) -> None:
        context = fork_server([rank_class.__module__], device)
        port, threads = free_port(), rank_threads(device, world_size)
        self.pipes: list[Connection] = []
        self.procs = []
        self.sequence = 0
        self.calling = "build"
        self.lock = threading.Lock()  # one call at a time, in the order the driver's threads make them (as Ray's queue)
        self.stuck: dict[int, int] = {}  # the ranks that have not answered the latest call (yet, or ever)
        try:
            for rank in range(world_size):
                here, there = context.Pipe()
                proc = context.Process(
                    target=_serve, name=f"rank {rank}",
                    # Not daemonic: dist_checkpointing starts its own writer processes inside each rank.
                    args=(there, os.getpid(), dict(os.environ), os.getcwd(),
                          rank_env(rank, world_size, rank, "127.0.0.1", port), device, threads, collective_timeout_s))
                self.pipes.append(here)
                proc.start()
                there.close()
                self.procs.append(proc)
            self.building = self._send({rank: ("build", (rank_class, *args), {}) for rank in range(world_size)})
        except BaseException:
            # Interrupted while it waited for the fork server (Ctrl-C), or the arguments do not pickle: the ranks
            # started so far would wait for their peers, and multiprocessing would wait for them as this process exits.
            stop_processes(self.procs, grace_s=0.0)
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def call_all(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        # One serialization for all ranks (batches are large).
        replies = self._call(dict.fromkeys(range(len(self)), ("call", (method, *args), kwargs)))
        return [replies[rank] for rank in range(len(self))]

    def call_each(self, method: Callable[..., R], per_member: Mapping[int, tuple]) -> dict[int, R]:
        return self._call({rank: ("call", (method, *args), {}) for rank, args in per_member.items()})

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Orderly where the ranks are idle; ranks still busy with a call the driver gave up on (an interrupted step,
        a failed peer) are killed at once, as are all after `timeout_s`."""
        idle = self.lock.acquire(blocking=False)  # else a driver thread is still waiting for a call
        orderly = idle and not self.stuck
        try:
            if orderly:
                alive = [rank for rank, proc in enumerate(self.procs) if proc.is_alive()]
                with contextlib.suppress(Exception):  # what went wrong was said already: this is cleanup
                    self._receive(self._send({rank: ("shutdown", (), {}) for rank in alive}), timeout_s)
        finally:
            # After an orderly stop the ranks exit on their own (their checkpoint writers joined); busy ones never do.
            stop_processes(self.procs, grace_s=5.0 if orderly else 0.0)
            for pipe in self.pipes:
                pipe.close()
            if idle:
                self.lock.release()

    # --- the wire ---

    def _call(self, messages: Mapping[int, tuple]) -> dict[int, Any]:
        with self.lock:
            if self.building is not None:
                building, self.building = self.building, None
                self._receive(building)
            return self._receive(self._send(messages))

    def _send(self, messages: Mapping[int, tuple]) -> dict[int, int]:
        """Each rank's message; returns the sequence number its reply will carry."""
        self.sequence += 1
        for op, args, _ in messages.values():
            self.calling = args[0].__name__ if op == "call" else op  # what a rank that dies was doing
            break
        callbacks: dict[int, Callable] = {}
        encoded: dict[int, bytes] = {}
        for rank, message in messages.items():
            key = id(message)
            if key not in encoded:
                encoded[key] = _dumps((self.sequence, *message), callbacks)
            with contextlib.suppress(OSError):  # a dead rank's pipe: _receive names it from its exit
                self.pipes[rank].send_bytes(encoded[key])
        self.callbacks = callbacks
        return dict.fromkeys(messages, self.sequence)

    def _receive(self, waiting: dict[int, int], timeout_s: Optional[float] = None) -> dict[int, Any]:
        """The replies to the messages `waiting` for (rank -> sequence number). The first failure (an exception, a
        death) is raised once every other rank has answered or PEER_GRACE_S has passed."""
        # Kept as it shrinks: a driver interrupted meanwhile (Ctrl-C, SIGTERM) finds the busy ranks in it.
        self.stuck = waiting = dict(waiting)
        replies: dict[int, Any] = {}
        failure: Optional[BaseException] = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if remaining == 0.0:
                break
            by_object = {}
            for rank in waiting:
                by_object[self.pipes[rank]] = rank
                by_object[self.procs[rank].sentinel] = rank
            for ready in wait(list(by_object), remaining):
                rank = by_object[ready]
                if rank not in waiting:
                    continue  # its pipe and its sentinel were both ready: already settled
                try:
                    if ready is self.procs[rank].sentinel and not self.pipes[rank].poll():
                        raise EOFError
                    sequence, kind, payload = pickle.loads(self.pipes[rank].recv_bytes())
                except (EOFError, OSError):  # gone, all it sent read
                    self.procs[rank].join(timeout=5.0)
                    failure = _cause(failure, RankDied(f"trainer rank {rank} (pid {self.procs[rank].pid}) "
                                                       f"{_ended(self.procs[rank].exitcode)} during {self.calling}"))
                    del waiting[rank]
                    continue
                if kind == _PROGRESS:
                    callback = self.callbacks.get(payload[0])
                    if callback is not None:  # else a late report of an earlier call
                        callback(payload[1])
                    continue
                if sequence != waiting[rank]:
                    continue  # the late reply to a call that already failed
                del waiting[rank]
                if kind == "ok":
                    replies[rank] = payload
                else:
                    failure = _cause(failure, _rank_error(rank, *payload))
            if failure is not None and deadline is None:
                deadline = time.monotonic() + PEER_GRACE_S
        if failure is not None:
            raise failure
        if waiting:
            raise RankFailure(f"trainer ranks {sorted(waiting)} did not answer within {timeout_s:.0f} s")
        return replies


def _cause(first: Optional[BaseException], new: BaseException) -> BaseException:
    """Which of two failures of one call to raise. Its peers fail in their collectives with a rank that died or
    raised, maybe before it is seen: a death is the cause, then a user's mistake, then whichever came first."""
    def weight(error: BaseException) -> int:
        return 2 if isinstance(error, RankDied) else 1 if user_error_in(error) is not None else 0

    return new if first is None or weight(new) > weight(first) else first


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}


def _tensor_as_array(tensor: torch.Tensor):
    """A CPU tensor travels as its numpy array: torch's own pickling writes each storage through torch.save, over ten
    times slower for a step's batch (benchmarks/RESULTS.md, "Measured reasons in the code") (and a view sends its own elements, not the storage it views). Anything numpy cannot hold takes torch's way."""
    if (tensor.device.type != "cpu" or tensor.requires_grad or tensor.dtype not in _NUMPY_DTYPES or tensor.is_sparse
            or tensor.is_neg()):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return torch.from_numpy, (tensor.numpy(),)


def _pickler(buffer: io.BytesIO) -> pickle.Pickler:
    """Plain pickle, not the multiprocessing one (that moves every tensor to shared memory and passes a descriptor),
    with CPU tensors as numpy arrays."""
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _tensor_as_array}
    return pickler


def _dumps(message: tuple, callbacks: dict[int, Callable]) -> bytes:
    """`message` pickled; a progress bar's `advance` among it stays here (callbacks) and travels as a stand-in."""
    buffer = io.BytesIO()
    pickler = _pickler(buffer)

    def persistent_id(obj: Any) -> Optional[tuple]:
        if isinstance(obj, types.MethodType) and obj.__func__ is ProgressBar.advance:
            callbacks[id(obj)] = obj
            return (_PROGRESS, id(obj))
        return None

    pickler.persistent_id = persistent_id
    pickler.dump(message)
    return buffer.getvalue()


def _rank_error(rank: int, error: Optional[BaseException], text: str) -> BaseException:
    """The rank's exception, as raised there (its type and message), with its traceback as the cause."""
    cause = RankFailure(f"trainer rank {rank} failed:\n{text.rstrip()}")
    if error is None:  # it did not survive pickling
        return cause
    error.__cause__ = cause
    return error


def _ended(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


# --- in the rank ---------------------------------------------------------------------------------------------------


def _serve(pipe: Connection, driver: int, environment: dict, cwd: str, env: dict[str, str], device: str,
           threads: int, collective_timeout_s: float) -> None:
    # Its own process group, so ending it also ends the helpers the rank starts (dist_checkpointing's writers);
    # nor does a Ctrl-C on the terminal reach it directly: the driver stops it (shutdown).
    os.setpgrp()
    # The driver's environment and directory as they are now (the fork server has its first caller's).
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    threading.Thread(target=_end_with, args=(driver,), daemon=True).start()
    send_lock = threading.Lock()  # progress reports come from the rank's engine threads too

    def send(reply: tuple) -> None:
        buffer = io.BytesIO()
        _pickler(buffer).dump(reply)
        with send_lock:
            try:
                pipe.send_bytes(buffer.getvalue())
            except OSError:  # BrokenPipeError, ConnectionResetError: the driver is gone (killed)
                raise _DriverGone from None

    try:
        _serve_calls(pipe, send, env, device, threads, collective_timeout_s)
    except _DriverGone:
        # Nothing to tell anyone: _end_with ends this rank in a moment, and a traceback here would land on the
        # terminal of the user who killed the driver ("Process rank N:", ConnectionResetError).
        pass


class _DriverGone(Exception):
    """The driver's end of the pipe is closed or reset: it is gone, or going without a shutdown."""


def _serve_calls(pipe: Connection, send: Callable[[tuple], None], env: dict[str, str], device: str, threads: int,
                 collective_timeout_s: float) -> None:
    host: Optional[RankHost] = None
    while True:
        try:
            data = pipe.recv_bytes()
        except (EOFError, OSError):  # closed without a shutdown, or reset by a driver killed outright
            raise _DriverGone from None
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = lambda pid: lambda count: send((0, _PROGRESS, (pid[1], count)))
        sequence, op = 0, "call"
        try:
            sequence, op, args, kwargs = unpickler.load()
            if op == "build":
                host = RankHost(env, device, threads, collective_timeout_s)
                host.build(*args)
                value = None
            elif op == "shutdown":
                value = host.shutdown() if host is not None else None
            else:
                value = host.call(*args, **kwargs)
            send((sequence, "ok", value))
        except BaseException as error:  # noqa: BLE001 - every failure must reach the driver
            text = traceback.format_exc()
            send((sequence, "error", (_portable(error), text)))
        if op == "shutdown":
            break


def _portable(error: BaseException) -> Optional[BaseException]:
    """`error` if it survives a pickle round trip (as a rank's errors, ours and the user's, do), else None; a user
    error that does not is raised as what it says."""
    with contextlib.suppress(Exception):  # its traceback and chained errors are not pickled: the text has them
        pickle.loads(pickle.dumps(error))
        return error
    mistake = user_error_in(error)
    if mistake is not None:
        return RankUserError(str(mistake))
    return None


def _end_with(driver: int) -> None:
    """Waits for the driver's process to end, then ends this rank's process group: a driver killed outright leaves
    no rank behind (a rank's engine servers watch the rank: rlmegatron.supervision.lifeline)."""
    try:
        poller = select.poll()
        poller.register(os.pidfd_open(driver), select.POLLIN)
        poller.poll()
    except (AttributeError, OSError):  # no pidfd (before Linux 5.3): look twice a second
        while True:
            try:
                os.kill(driver, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)
