"""The run directory (`trainer.run_dir`): whether this process can write there, whether its disk is full, and the
lock that keeps a second run out of it while one runs.

Two runs in one run directory would resume from each other's checkpoints, write the same step twice and take over
each other's MLflow run. The lock is a POSIX record lock (fcntl.lockf) on `run_dir/LOCK_FILE`: the kernel drops it
when the process that holds it ends, however it ends (SIGKILL and the OOM killer included), and unlike flock it is
not shared with the processes this one forks, so nothing the run leaves behind keeps the next run out. The file
says who holds it (pid, host, start time), for the line that refuses the second run; it is never deleted, since
deleting a lock file lets two processes lock two different files.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rlmegatron.errors import UserError

LOCK_FILE = ".rlm_run.lock"
# A holder writes its name right after it locks; a run refused in between reads again for this long.
_HOLDER_WAIT_S = 2.0


class RunDirBusy(UserError):
    """Another live process runs in this run directory: one line naming it, exit 2."""


def unwritable(run_dir: str | Path) -> str | None:
    """Why this process cannot write in `run_dir` (None: it can), changing nothing. An existing directory is tried
    with a file created and removed at once (its permission bits say nothing of a read-only mount, nor to root); a
    missing one by its nearest existing parent, where access(2) answers for a read-only mount too."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    if not path.exists():
        parent = next(p for p in path.absolute().parents if p.exists())
        if not parent.is_dir():
            return f"cannot be created: {parent} is a file"
        return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created in {parent} (not writable)"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rlm_write_check_"):
            pass
    except OSError as error:
        return f"cannot be written to ({error.strerror or error})"
    return None


def no_space_left(directory: str | Path) -> bool:
    """Whether the file system of `directory` is full now: a write of 64 KiB there fails with ENOSPC (or EDQUOT). A
    failed write does not always say so itself: torch's checkpoint writer reports a short write as "unexpected pos",
    and Megatron's as a CheckpointException naming no rank. statvfs would not answer for root, who may fill the
    blocks it reserves."""
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return False


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[None]:
    """Holds `run_dir`'s lock for the body; RunDirBusy if another live process holds it."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock_or_refuse(fd, path, run_dir)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock


def refuse_if_busy(run_dir: str | Path) -> None:
    """RunDirBusy at once if another live process holds `run_dir`'s lock, creating nothing: `rlm train` takes the
    lock only once its checks have passed, and a run refused then would have paid for them (and for the imports its
    ranks start with) first."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # no lock file (no run has been here), or not writable (preflight says so)
        return
    try:
        _lock_or_refuse(fd, path, run_dir)
    finally:
        os.close(fd)  # drops the lock it may have taken


def in_use(run_dir: str | Path) -> bool:
    """Whether a live process (`rlm train`) holds `run_dir`'s lock (`rlm pool` talks to that run)."""
    try:
        refuse_if_busy(run_dir)
    except RunDirBusy:
        return True
    return False


def _lock_or_refuse(fd: int, path: Path, run_dir: str | Path) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise RunDirBusy(f"trainer.run_dir={run_dir}: another run is using it ({_holder(path)}); wait for it to end "
                         "or stop it, or give this run its own trainer.run_dir") from None


def _holder(path: Path) -> str:
    """The holder as its lock file names it: 'rlm train, pid 123 on host h, started ...'."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        try:
            holder = json.loads(path.read_text())
            return f"rlm train, pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return f"a process that holds the lock on {path}"
            time.sleep(0.05)
