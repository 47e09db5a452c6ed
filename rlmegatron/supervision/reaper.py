"""`python -m rlmegatron.supervision.reaper OWNER_PID MARK SESSION_DIR`: once OWNER_PID is gone, however it went (SIGKILL
included), SIGKILL every process of the Ray session it started and everything those started. Standard library only,
so it starts in milliseconds and idles in a few megabytes.

`rlm train` starts one when it starts a Ray session of its own (never for a cluster named by RAY_ADDRESS). Ray ties
its head processes (GCS, raylet, dashboard, monitors) to the driver with PR_SET_PDEATHSIG, and workers leave when
the raylet goes, but the raylet's agents (dashboard and runtime-env agents) hang for minutes in their exit, reporting
to a GCS that is gone. The session's processes are:
- every process whose initial environment holds RLM_SESSION_MARK=MARK: the owner sets it before starting Ray, so
  Ray's processes, rank actors, their engine servers and reward workers inherit it;
- every `ray::` process with a file open under SESSION_DIR: the agents, whose process titles wipe their environment;
- every descendant of those, whatever its environment (a process that sets its title may wipe it, as SGLang's
  schedulers do theirs).
The owner's death is a blocking wait (a pidfd, and the pipe on stdin whose writing end only the owner holds); the
sweep repeats until it finds no process it has not killed already, so one started during a sweep goes too.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import uuid
from collections import defaultdict

MARK_VARIABLE = "RLM_SESSION_MARK"

_started: list[subprocess.Popen] = []  # their stdin pipes close only when this process ends


def mark_started_processes() -> str:
    """Put a fresh mark in this process's environment, which every process started from now on inherits."""
    mark = uuid.uuid4().hex
    os.environ[MARK_VARIABLE] = mark
    return mark


def start(mark: str, session_dir: str) -> None:
    """A reaper for the session in `session_dir` and the processes carrying `mark`, watching this process (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    _started.append(subprocess.Popen(
        [sys.executable, "-m", "rlmegatron.supervision.reaper", str(os.getpid()), mark, session_dir],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        start_new_session=True,  # out of the owner's process group: a Ctrl-C or a group kill leaves it to clean up
    ))


def wait_for_exit(owner: int) -> None:
    """Blocks until `owner` (this process's parent, which holds the writing end of stdin) has exited."""
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN)  # POLLHUP once every writing end is closed
    try:
        # The pipe alone would wait on for a child the owner forked without exec, which holds the writing end too.
        poller.register(os.pidfd_open(owner), select.POLLIN)
    except (AttributeError, OSError):  # before Linux 5.3: the pipe alone
        pass
    poller.poll()


def session_processes(mark: str, session_dir: str) -> dict[int, str]:
    """pid -> start time (to tell a reused pid) of every live process of the session, this one excepted."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    children: dict[int, list[int]] = defaultdict(list)
    started: dict[int, str] = {}
    roots = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):  # dead, waiting to be reaped by its parent
                continue
            children[int(fields[1])].append(pid)
            started[pid] = fields[19].decode()
            if _carries(pid, needle) or _ray_process_with_files_in(pid, session_dir):
                roots.append(pid)
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
    found: dict[int, str] = {}
    while roots:
        pid = roots.pop()
        if pid not in found:
            found[pid] = started[pid]
            roots.extend(children[pid])
    return found


def _carries(pid: int, needle: bytes) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        return needle in environ.read().split(b"\0")


def _ray_process_with_files_in(pid: int, directory: str) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        if not cmdline.read().startswith(b"ray::"):
            return False
    prefix = directory.rstrip("/") + "/"
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def _kill(pid: int, start_time: str) -> None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            if stat.read().rsplit(b")", 1)[1].split()[19].decode() != start_time:
                return  # the pid belongs to another process now
        os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m rlmegatron.supervision.reaper OWNER_PID MARK SESSION_DIR", file=sys.stderr)
        return 2
    owner, mark, session_dir = int(argv[0]), argv[1], argv[2]
    wait_for_exit(owner)
    sweep(mark, session_dir)
    return 0


def sweep(mark: str, session_dir: str) -> None:
    """SIGKILL the session's processes, again until a pass finds none it has not killed: one started during a
    pass goes too. Nothing of another session is touched (unlike `ray stop`, which ends every Ray on the machine)."""
    killed: set[tuple[int, str]] = set()
    while fresh := set(session_processes(mark, session_dir).items()) - killed:
        for pid, start_time in fresh:
            _kill(pid, start_time)
        killed |= fresh


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
