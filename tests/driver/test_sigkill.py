"""`rlm train` killed with SIGKILL mid-run: within seconds nothing it started is left, neither Ray's head processes
and agents nor the rank actors (rlmegatron/supervision/reaper.py), nor the rank processes of placement.transport=processes (each
watches the driver), nor their (loopback) SGLang servers (rlmegatron/supervision/lifeline.py)."""
import os
import subprocess
import time

import pytest

from tests.driver.test_train import QUICKSTART, REPO_ROOT, RLM, SMALL, processes_of_run, with_fake_sglang
from tests.helpers.processes import alive, command, descendants

GONE_WITHIN_S = 10
FULL_BAR = "[" + "#" * 30 + "]"


@pytest.mark.parametrize("launcher", ["ray", "processes"])
def test_nothing_the_driver_started_outlives_its_sigkill(tmp_path, launcher):
    sglang, env = with_fake_sglang(tmp_path, "sigkilled")
    with open(tmp_path / "stderr", "w") as stderr:
        # --verbose: the progress bars' lines show in the log, where the test sees step 1 trained.
        driver = subprocess.Popen([RLM, "train", "--verbose", QUICKSTART, *SMALL, "trainer.total_steps=20", *sglang,
                                   f"placement.transport={launcher}", f"trainer.run_dir={tmp_path / 'run'}"],
                                  cwd=REPO_ROOT, env=env, stderr=stderr)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while f"update_actor   {FULL_BAR} 1/1" not in (tmp_path / "stderr").read_text():  # step 1 has trained
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        tree = descendants(driver.pid)
        commands = [command(pid) for pid in tree]
        # By the program's name: a Ray worker still being set up names the raylet in its arguments.
        programs = [line.split(" ", 1)[0].rsplit("/", 1)[-1] for line in commands]
        if launcher == "ray":
            for part in ("gcs_server", "raylet"):
                assert programs.count(part) == 1, (part, commands)
            for part in ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "rlmegatron.supervision.reaper"):
                assert sum(part in line for line in commands) == 1, (part, commands)
            assert sum("ray::RankHost" in line for line in commands) == 2, commands
        else:  # the fork server and the two ranks forked from it (which keep its command line); no Ray at all
            assert sum("multiprocessing.forkserver" in line for line in commands) >= 3, commands
            assert not any("ray" in program for program in programs), commands
        assert sum("rlmegatron.supervision.lifeline" in line for line in commands) == 2, commands  # one per rank
        servers = [line for line in commands if "sglang.launch_server" in line and "rlmegatron.supervision.lifeline" not in line]
        assert len(servers) == 2, commands  # each under its lifeline

        driver.kill()
        killed = time.monotonic()
        driver.wait()
        while (any(map(alive, tree)) or processes_of_run("sigkilled")) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.05)
        gone_s = time.monotonic() - killed
        assert [command(pid) for pid in tree if alive(pid)] == []
        assert processes_of_run("sigkilled") == []
        print(f"{len(tree)} processes of the run gone {gone_s:.2f} s after the driver's SIGKILL")
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in filter(alive, tree):  # what a failure above left
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_only_a_ray_session_of_its_own_is_handed_to_the_reaper(monkeypatch):
    """Ray started here: its processes inherit a fresh mark, and the reaper gets the mark and the session. A
    cluster named by RAY_ADDRESS (the user's) is joined, and nothing of it is ever marked or reaped."""
    import ray

    from rlmegatron.supervision import reaper
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.job import start_ray

    inits, reapers = [], []

    class Context:
        address_info = {"session_dir": "/tmp/ray/session_x"}

    def init(**kwargs):
        inits.append((kwargs, os.environ.get(reaper.MARK_VARIABLE)))
        return Context()

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(reaper, "start", lambda mark, session_dir: reapers.append((mark, session_dir)))
    monkeypatch.setenv(reaper.MARK_VARIABLE, "the caller's")  # and taken out again after the test
    spec = load_spec(str(REPO_ROOT / QUICKSTART), [])

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    start_ray(spec)
    assert inits == [({"address": "127.0.0.1:6379"}, "the caller's")] and reapers == []

    monkeypatch.delenv("RAY_ADDRESS")
    start_ray(spec)
    (kwargs, mark), = inits[1:]
    assert kwargs["num_cpus"] == 2 and mark != "the caller's" and len(mark) == 32
    assert reapers == [(mark, "/tmp/ray/session_x")]
