"""`python -m rlmegatron.rewards.worker FD FUNCTION_REF MODE`: one reward worker process, started by the reward
manager's pool (manager._RewardWorkers) and talking to it over the socket FD. It loads the function, says "ready"
(or "broken" and why), then scores what it is sent: (index, item, seconds, limit) in, (index, outcome) out.

MODE "one" scores one sample at a time in the main thread, stopped by SIGALRM after `seconds`, so a slow Python
function costs a timeout and not the worker. MODE "async" runs an `async def` function on an event loop, every sample
it is sent at once, each cancelled after its `seconds`. Code that neither returns to the interpreter nor yields to the
loop (stuck in C) is ended by the pool, which kills this process when an answer is overdue.

Started with subprocess, not multiprocessing: no re-import of the driver's __main__, and nothing of the driver's
threads is inherited (fork+exec).
"""
from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

from rlmegatron.rewards.manager import (
    RewardFunctionError,
    _Outcome,
    _outcome_from_return,
    _raise_timeout,
    _score_one,
    load_reward_function,
)

# Past a sample's `seconds` plus this, the worker ends itself: the pool kills it well before (manager._KILL_GRACE_S
# after `seconds`), so this only matters when the driver is gone (SIGKILL) and a function is stuck in C, where no
# Python thread can run. faulthandler's timer is a C thread that needs no interpreter lock.
_ORPHAN_EXIT_S = 30.0


def main(argv: list[str]) -> int:
    fd, function_ref, mode = int(argv[0]), argv[1] or None, argv[2]
    conn = Connection(fd)
    try:
        function = load_reward_function(function_ref)
    except RewardFunctionError as err:
        conn.send(("broken", str(err)))
        return 0
    conn.send(("ready", None))
    devnull = open(os.devnull, "w")  # where the self-exit below writes its thread dump
    try:
        if mode == "async":
            asyncio.run(_serve_async(conn, function, devnull))
        else:
            _serve_one_at_a_time(conn, function, devnull)
    except (EOFError, OSError):  # the driver closed its end, or is gone
        pass
    return 0


def _serve_one_at_a_time(conn: Connection, function: Any, devnull: Any) -> None:
    signal.signal(signal.SIGALRM, _raise_timeout)
    while True:
        index, item, seconds, limit = conn.recv()
        faulthandler.dump_traceback_later(seconds + _ORPHAN_EXIT_S, exit=True, file=devnull)
        outcome = _score_one(function, item, seconds, limit)
        faulthandler.cancel_dump_traceback_later()
        conn.send((index, outcome))


async def _serve_async(conn: Connection, function: Any, devnull: Any) -> None:
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # for the loop's reader; the Connection keeps its own

    def receive() -> None:
        try:
            arrived.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(sock)
            arrived.put_nowait(None)

    loop.add_reader(sock, receive)
    running: set[asyncio.Task] = set()
    while (job := await arrived.get()) is not None:
        index, item, seconds, limit = job
        # Re-armed with every sample: a loop blocked for longer than any sample may take ends the process.
        faulthandler.dump_traceback_later(seconds + _ORPHAN_EXIT_S, exit=True, file=devnull)
        task = asyncio.create_task(_score_awaited(conn, function, index, item, seconds, limit))
        running.add(task)
        task.add_done_callback(lambda done: _finished(running, done))


def _finished(running: set[asyncio.Task], task: asyncio.Task) -> None:
    running.discard(task)
    if not running:  # idle between batches, for as long as a step takes: no self-exit
        faulthandler.cancel_dump_traceback_later()


async def _score_awaited(conn: Connection, function: Any, index: int, item: Any, seconds: float, limit: str) -> None:
    try:
        async with asyncio.timeout(seconds) as scope:
            returned = await function(item.data_source, item.solution_str, item.ground_truth, item.extra_info)
    except TimeoutError as err:
        outcome = (_Outcome("timeout", message=limit) if scope.expired()
                   else _Outcome("error", message=f"{type(err).__name__}: {err}"))
    except Exception as err:  # a user function may raise anything; the batch goes on
        outcome = _Outcome("error", message=f"{type(err).__name__}: {err}")
    else:
        outcome = _outcome_from_return(returned)
    conn.send((index, outcome))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
