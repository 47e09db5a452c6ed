"""`python -m rlmegatron.supervision.lifeline OWNER_PID -- COMMAND...`: runs COMMAND and ends its whole process
group when OWNER_PID dies. Standard library only, outside the heavy packages, so it starts in milliseconds.

Servers run in their own session so that stopping one also stops its TP worker children; that same session
would let them outlive a trainer rank killed with SIGKILL (Ray's `ray.kill`, the OOM killer). PR_SET_PDEATHSIG
set in the server directly is no help: it fires when the launching *thread* exits, and restarts are launched
from short-lived threads. The lifeline's own main thread lives as long as it does, so the server gets it there.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def _die_with_parent() -> None:
    """In the server, before exec: SIGTERM when this lifeline dies, for the case the poll below cannot handle,
    a SIGKILL of the lifeline itself (Ray kills a dead worker's child processes that way)."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _end_group(child: subprocess.Popen) -> None:
    """SIGTERM to the server, SIGKILL to the whole group (this process included) if it lingers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m rlmegatron.supervision.lifeline OWNER_PID -- COMMAND...", file=sys.stderr)
        return 2
    owner, command = int(argv[0]), argv[2:]
    child = subprocess.Popen(command, preexec_fn=_die_with_parent)
    # A stop of the group (SIGTERM) reaches the server directly; wait for it rather than die first.
    signal.signal(signal.SIGTERM, lambda *_: None)
    while child.poll() is None:
        if os.getppid() != owner:
            _end_group(child)
        time.sleep(POLL_S)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
