"""launch/submit.sh --backend ray for real: a local Ray head on CPU runs the quickstart config as a Ray job."""
import os
import subprocess
import sys
from pathlib import Path

from rlmegatron.runtime.launcher import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_as_a_ray_job_on_a_local_head(tmp_path):
    dashboard, gcs = free_port(), free_port()
    # A short temp dir: Ray's socket paths must fit in 107 characters. No token auth on a loopback test head.
    # submit.sh and the job's `rlm train` find ray and rlm on PATH, as in an activated environment.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    temp_dir = f"/tmp/rlm-ray-{os.getpid()}"
    head = ["ray", "start", "--head", "--num-cpus", "3", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard), "--temp-dir", temp_dir, "--disable-usage-stats"]
    subprocess.run(head, env={**env, "RAY_ADDRESS": ""}, check=True, capture_output=True, timeout=120)
    try:
        run_dir = tmp_path / "run"
        job = subprocess.run(
            ["bash", "launch/submit.sh", "--backend", "ray", "--config", "configs/quickstart.yaml", "--",
             "trainer.total_steps=2", f"trainer.run_dir={run_dir}"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400,
        )
        output = job.stdout + job.stderr
        assert job.returncode == 0, output[-3000:]
        assert "succeeded" in output and "trained 2 steps" in output
        assert (run_dir / "checkpoints" / "step_2").is_dir()
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
