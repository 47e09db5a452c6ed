"""A server launched through ServerProcess dies with its launcher, even when the launcher is SIGKILLed."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).parents[2]

# The launcher: starts a long-sleeping "server" (which itself starts a child, as SGLang's TP workers are)
# through ServerProcess, prints the server's process group, then waits to be killed.
LAUNCHER = """
import sys, time
from rlmegatron.rollout.sglang.server import ServerProcess
server = ServerProcess([sys.executable, "-c", "import subprocess, sys, time; "
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"],
                       sys.argv[1])
server.start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def group_members(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid, group in (line.split() for line in out.splitlines()) if int(group) == pgid]


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_server_group_ends_when_its_launcher_is_killed(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "server.log")], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, text=True)
    pgid = int(launcher.stdout.readline())
    # lifeline, the server and the server's child
    assert wait_until(lambda: len(group_members(pgid)) == 3, 10), group_members(pgid)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert wait_until(lambda: not group_members(pgid), 15), group_members(pgid)


def test_stop_ends_the_server_and_reports_its_exit_code(tmp_path):
    from rlmegatron.rollout.sglang.server import ServerProcess

    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "server.log")
    server.start()
    pgid = server.process.pid
    assert wait_until(lambda: len(group_members(pgid)) == 2, 10)
    server.stop()
    assert not group_members(pgid)

    failing = ServerProcess([sys.executable, "-c", "raise SystemExit(7)"], tmp_path / "failing.log")
    failing.start()
    assert failing.process.wait(10) == 7


def test_the_server_ends_when_its_lifeline_is_killed(tmp_path):
    """Ray kills a dead worker's direct children with SIGKILL: that child is the lifeline, not the server."""
    from rlmegatron.rollout.sglang.server import ServerProcess

    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "server.log")
    server.start()
    pgid = server.process.pid
    assert wait_until(lambda: len(group_members(pgid)) == 2, 10)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    assert wait_until(lambda: not group_members(pgid), 10), group_members(pgid)
