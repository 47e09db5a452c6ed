"""The fork server the trainer ranks start from: one process that imported the heavy libraries once and forks each
rank from a state that ran nothing."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from typing import Any, Iterator, Sequence

from rlmegatron.runtime.distributed import Device
from rlmegatron.runtime.notices import import_notices_off


# Also what every trainer rank imports on its first build and save (HF's model classes for the local engine and the
# converter, dist_checkpointing's torch strategy): imported here once, not once per rank. rlmegatron before Megatron-Core,
# so that its import hook (megatron_fusers.py) sees Megatron's first import.
_PRELOAD = ["rlmegatron", "torch", "megatron.core", "transformers", "transformers.modeling_utils",
            "transformers.models.auto.modeling_auto", "megatron.core.dist_checkpointing.strategies.torch",
            "rlmegatron.transport.local_ranks"]


def fork_server(preload: Sequence[str] = (), device: Device = "cpu") -> Any:
    """multiprocessing's forkserver context, its server started now if it is not running: it imports torch,
    Megatron-Core, transformers and `preload` (seconds of CPU) in the background, while the caller goes on, and
    ranks forked from it start with all of that imported. `preload` counts only for the call that starts the server.

    Forked from a server that imported them and ran nothing: forking a process that already ran torch (or has
    threads) can deadlock, forking this one cannot."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    # fork_server_exit last: the server leaves without Python's teardown once its driver is gone.
    ctx.set_forkserver_preload([*_PRELOAD, *preload, "rlmegatron.transport.fork_server_exit"])
    # Its imports come before any rank quiets the library notices they print: it starts with them off.
    with environment(PYTHONWARNINGS=",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                           import_notices_off(device)]))), _ctrl_c_ignored():
        forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def fork_server_ended_on_failure() -> Iterator[None]:
    """The fork server started within this block, if any, ended at once when the block fails: no rank was forked from
    it yet (a job refused by its checks). Left alone, it would notice its driver gone only once its imports were done,
    seconds of CPU later, an orphan until then."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # multiprocessing's own; ensure_running and _stop are its whole life cycle
    running = server._forkserver_pid
    try:
        yield
    except BaseException:
        if server._forkserver_pid not in (None, running):
            os.kill(server._forkserver_pid, signal.SIGKILL)  # mid-import: closing its pipe would wait for them
            server._stop()
        raise


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """SIGINT ignored while the fork server starts: it keeps that through exec, so a Ctrl-C during its seconds of
    imports does not print a traceback from it (the driver reports the interrupt and ends it). Its serving loop
    ignores SIGINT anyway, and the ranks it forks inherit that: the driver, not a KeyboardInterrupt in the middle
    of a collective, stops them. Only the main thread may set a handler; elsewhere the server starts as it would."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """`variables` in this process's environment for the processes started meanwhile, then as they were."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


