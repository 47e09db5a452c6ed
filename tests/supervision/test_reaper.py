"""The reaper ends what its owner started within moments of the owner's SIGKILL: processes carrying the owner's mark,
`ray::` processes with files open in the owner's Ray session (Ray's agents), and their descendants, however they
were started; and nothing else, not even a process reading the session's logs or another session's agent."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.processes import alive, command, descendants, open_files

REPO_ROOT = Path(__file__).resolve().parents[2]
SLEEP = "import sys, time; files = [open(path, 'a') for path in sys.argv[1:]]; time.sleep(600)"

# Marks what it starts and hands the session to a reaper, then starts: a marked child; a marked child whose own
# child has a session and an environment of its own; an agent as Ray's look (retitled ray::, environment wiped,
# its log open in the session).
OWNER = f"""
import subprocess, sys, time
from rlmegatron.supervision import reaper
session = sys.argv[1]
reaper.start(reaper.mark_started_processes(), session)
subprocess.Popen([sys.executable, "-c", {SLEEP!r}])
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                  "subprocess.Popen(sys.argv[1:], start_new_session=True, env={{}}); time.sleep(600)",
                  sys.executable, "-c", {SLEEP!r}])
subprocess.Popen(["ray::FakeAgent", "-c", {SLEEP!r}, session + "/logs/agent.log"], executable=sys.executable, env={{}})
print("started", flush=True)
time.sleep(600)
"""


def test_the_owners_session_ends_within_moments_of_its_sigkill_and_nothing_else_does(tmp_path):
    session, other = tmp_path / "session", tmp_path / "other_session"
    for directory in (session, other):
        (directory / "logs").mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if key != "RLM_SESSION_MARK"}
    bystanders = [  # a reader of this session's log, another session's agent
        subprocess.Popen([sys.executable, "-c", SLEEP, str(session / "logs" / "agent.log")], env=env),
        subprocess.Popen(["ray::OtherAgent", "-c", SLEEP, str(other / "logs" / "agent.log")],
                         executable=sys.executable, env=env),
    ]
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(session)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             text=True, env=env)
    tree: list[int] = []
    try:
        assert owner.stdout.readline() == "started\n"
        deadline = time.monotonic() + 30
        while len(tree := descendants(owner.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # the grandchild's parent is still starting
        [reaper] = [pid for pid in tree if "rlmegatron.supervision.reaper" in command(pid)]
        victims = [pid for pid in tree if pid != reaper]
        assert len(victims) == 4, [command(pid) for pid in tree]
        # The agent is known by the log it holds open: on a loaded machine its interpreter may not have opened it yet.
        [agent] = [pid for pid in victims if command(pid).startswith("ray::FakeAgent")]
        while str(session / "logs" / "agent.log") not in open_files(agent) and time.monotonic() < deadline:
            time.sleep(0.05)
        owner.kill()
        killed = time.monotonic()
        owner.wait()
        while any(map(alive, victims + [reaper])) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        gone_s = time.monotonic() - killed
        assert not [command(pid) for pid in victims if alive(pid)]
        assert not alive(reaper)
        assert all(bystander.poll() is None for bystander in bystanders)
        print(f"the owner's {len(victims)} processes ended {gone_s:.2f} s after its SIGKILL")
    finally:
        for process in bystanders + [owner]:
            process.kill()
            process.wait()
        for pid in filter(alive, tree):  # left by a failure above
            os.kill(pid, signal.SIGKILL)
