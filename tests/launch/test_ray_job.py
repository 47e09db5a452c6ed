"""launch/submit.sh --backend ray for real: a local Ray head on CPU runs the shipped quickstart as a Ray job, and
it learns a skill the random model lacks: reward <= 0.2 at step 1 and >= 0.8 at step 150 (its 5-step mean reaches 0.8
at step 120), validation <= 0.2 before training and >= 0.8 after, within 10 minutes."""
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rlmegatron import reaper
from rlmegatron.runtime.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_quickstart_learns_as_a_ray_job_on_a_local_head(tmp_path):
    dashboard, gcs = free_port(), free_port()
    # A short temp dir: Ray's socket paths must fit in 107 characters. No token auth on a loopback test head.
    # submit.sh and the job's `rlm train` find ray and rlm on PATH, as in an activated environment.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # Every process of this head carries a mark of its own: the end of the test stops them and nothing else (`ray
    # stop` would also end the Ray of a test running beside this one, or of another session on the machine).
    mark = uuid.uuid4().hex
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}",
           reaper.MARK_VARIABLE: mark}
    temp_dir = f"/tmp/rlm-ray-{os.getpid()}"
    # Ports of its own for the agents too: their defaults (52365 for the job agent's HTTP) belong to whichever Ray on
    # the machine took them first, and a head whose agent lost that race never accepts a job ("No available agent").
    agent_ports = [f"--{option}={free_port()}" for option in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                              "runtime-env-agent-port", "metrics-export-port")]
    head = ["ray", "start", "--head", "--num-cpus", "3", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard), "--temp-dir", temp_dir, "--disable-usage-stats", *agent_ports]
    subprocess.run(head, env={**env, "RAY_ADDRESS": ""}, check=True, capture_output=True, timeout=120)
    try:
        run_dir = tmp_path / "run"
        started = time.monotonic()
        # The head's job agent can take a minute to come up while the other test worker keeps both cores busy.
        while True:
            job = subprocess.run(
                ["bash", "launch/submit.sh", "--backend", "ray", "--config", "configs/quickstart.yaml", "--",
                 "trainer.total_steps=150", f"trainer.run_dir={run_dir}"],
                cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
            )
            # A head just started may not have its job agent yet; the job was then not submitted, so try again.
            if "No available agent to submit job" not in job.stderr or time.monotonic() - started > 180:
                break
            time.sleep(5)
        wall_s = time.monotonic() - started
        output = job.stdout + job.stderr
        assert job.returncode == 0, output[-3000:]
        assert "succeeded" in output
        learned = re.search(r"trained steps 1-150 \(150 steps\) in [\d.]+ s; critic/score/mean ([\d.]+) \(step 1\) "
                            r"-> ([\d.]+) \(step 150\)", output)
        assert learned, output[-3000:]
        first, last = float(learned.group(1)), float(learned.group(2))
        assert first <= 0.2 and last >= 0.8, (first, last)
        validated = re.search(r"validation: val/next_digit/score/mean ([\d.]+) \(step 0, before training\) -> "
                              r"([\d.]+) \(step 150\)", output)
        assert validated, output[-3000:]
        before, after = float(validated.group(1)), float(validated.group(2))
        assert before <= 0.2 and after >= 0.8, (before, after)
        assert wall_s < 600
        assert (run_dir / "checkpoints" / "step_150").is_dir()
        print(f"quickstart as a Ray job: {wall_s:.0f} s wall, reward {first:.3f} -> {last:.3f}, validation "
              f"{before:.3f} -> {after:.3f}")
    finally:
        reaper.sweep(mark, temp_dir)
