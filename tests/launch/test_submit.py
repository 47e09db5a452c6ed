"""launch/submit.sh --dry-run: the generated Slurm script and ray command, and clear usage errors."""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "launch" / "submit.sh"
CONFIG = "configs/quickstart.yaml"
# submit.sh validates the job at the size it is submitted at: these make the quickstart's batches split evenly over
# 2 to 128 ranks (32 prompts x rollout.n=4 or 8 sequences, micro-batches of 1).
FITS_ANY_SIZE = ["data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=1"]


def submit(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    full_env.pop("RAY_ADDRESS", None) if "RAY_ADDRESS" not in env else None
    return subprocess.run(["bash", str(SUBMIT), *args], cwd=REPO, env=full_env, capture_output=True, text=True)


@pytest.fixture(scope="module", params=[1, 2, 16])
def slurm_dry_run(request):
    """(nodes, result) of a Slurm dry run of a GPU job, shared by the tests that read it: each submit runs
    `rlm validate`."""
    nodes = request.param
    return nodes, submit("--backend", "slurm", "--config", CONFIG, "--nodes", str(nodes), "--gpus-per-node", "8",
                         "--dry-run", "--", "rollout.n=4", "data.train_files=[a b.parquet]", *FITS_ANY_SIZE,
                         "placement.device=cuda")


def test_slurm_dry_run_prints_the_whole_script_and_the_sbatch_command(slurm_dry_run):
    nodes, result = slurm_dry_run
    assert result.returncode == 0, result.stderr
    out = result.stdout
    script = out.split("# --- command ---")[0]
    assert f"#SBATCH --nodes={nodes}\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert "set -euo pipefail" in script and "trap cleanup EXIT INT TERM" in script
    # Ray in job steps of its own, stopped by stopping them: `ray stop` would end every Ray on the node.
    assert "ray start --head" in script and "ray stop" not in script and "pkill" not in script
    assert ("--exclude=\"$HEAD_NODE\"" in script) and "(( NNODES > 1 ))" in script
    assert 'NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-' in script and "GLOO_SOCKET_IFNAME" in script
    assert "EXPECTED=GPU\n" in script and "EXPECTED_DEVICES=$((NNODES * DEVICES_PER_NODE))" in script
    assert "--num-gpus=8" in script and "RAY_JOIN_TIMEOUT_S" in script
    # Each node's address is Slurm's NodeAddr, not what its hostname resolves to.
    assert "scontrol show node" in script and "hostname --ip-address" not in script
    train = shlex.join(["rlm", "train", CONFIG, "rollout.n=4", "data.train_files=[a b.parquet]", *FITS_ANY_SIZE,
                        "placement.device=cuda", f"placement.nnodes={nodes}", "placement.gpus_per_node=8"])
    assert train in script
    command = out.split("# --- command ---\n")[1].strip()
    assert command.startswith("sbatch runs/slurm/rlm-quickstart-") and command.endswith(".sbatch")
    assert not (REPO / command.split()[1]).exists()  # a dry run writes nothing


def test_generated_script_is_valid_bash(slurm_dry_run, tmp_path):
    _, result = slurm_dry_run
    script = tmp_path / "job.sbatch"
    script.write_text(result.stdout.split("# --- command ---")[0])
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


@pytest.mark.parametrize("nodes", [None, 2, 16])
def test_ray_dry_run_prints_the_job_submit_command(nodes):
    args = ["--backend", "ray", "--config", CONFIG, "--dry-run"]
    args += ["--nodes", str(nodes), "--gpus-per-node", "8"] if nodes else []
    result = submit(*args, "--", "rollout.n=4", *FITS_ANY_SIZE, RAY_ADDRESS="http://head:8265",
                    MLFLOW_TRACKING_URI="http://mlflow:5000")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[:5] == ["ray", "job", "submit", "--address", "http://head:8265"]
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert runtime_env["working_dir"] == "."
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    placement = [f"placement.nnodes={nodes}", "placement.gpus_per_node=8"] if nodes else []
    assert argv[argv.index("--") + 1 :] == ["rlm", "train", CONFIG, "rollout.n=4", *FITS_ANY_SIZE,
                                            f"trainer.run_dir={REPO / 'runs' / 'quickstart'}", *placement]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--backend is required"),
        (["--backend", "k8s", "--config", CONFIG], "--backend must be slurm or ray, got 'k8s'"),
        (["--backend", "slurm"], "--config is required"),
        (["--backend", "slurm", "--config", "nope.yaml"], "--config nope.yaml is not a file"),
        (["--backend", "slurm", "--config", CONFIG, "--nodes", "0"], "--nodes must be a positive integer"),
        (["--backend", "slurm", "--config", CONFIG, "--gpus-per-node"], "--gpus-per-node needs a value"),
        (["--backend", "slurm", "--config", CONFIG, "rollout.n=4"], "unknown argument 'rollout.n=4'"),
        (["--backend", "slurm", "--config", CONFIG, "--", "rollout.n"], "must look like key=value"),
        (["--backend", "ray", "--config", CONFIG, "--dry-run"], "RAY_ADDRESS is not set"),
    ],
)
def test_bad_arguments_fail_with_a_clear_message(args, message):
    result = submit(*args)
    assert result.returncode == 2
    assert message in result.stderr and "--help" in result.stderr


def test_a_cpu_job_asks_slurm_for_cpus_and_ray_for_cpu_devices():
    result = submit("--backend", "slurm", "--config", CONFIG, "--nodes", "2", "--gpus-per-node", "1", "--dry-run")
    assert result.returncode == 0, result.stderr
    script = result.stdout.split("# --- command ---")[0]
    assert "#SBATCH --cpus-per-task=1\n" in script and "--gpus-per-node" not in script
    assert "--num-cpus=1 --num-gpus=0" in script and "EXPECTED=CPU\n" in script


def test_a_ray_job_keeps_its_run_directory_outside_the_copy_ray_unpacks(tmp_path):
    """A relative trainer.run_dir is made absolute against the repository: the job runs in a copy of it that goes
    when the job ends. One given on the command line stays as given."""
    relative = submit("--backend", "ray", "--config", CONFIG, "--dry-run", RAY_ADDRESS="http://head:8265")
    assert relative.returncode == 0, relative.stderr
    assert shlex.split(relative.stdout)[-1] == f"trainer.run_dir={REPO / 'runs' / 'quickstart'}"
    given = submit("--backend", "ray", "--config", CONFIG, "--dry-run", "--", f"trainer.run_dir={tmp_path}",
                   RAY_ADDRESS="http://head:8265")
    assert shlex.split(given.stdout)[-1] == f"trainer.run_dir={tmp_path}"


def test_real_slurm_submit_without_sbatch_says_so(tmp_path):
    # A PATH with what submit.sh needs and no sbatch, whatever this machine has installed.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "basename", "date", "mkdir"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = submit("--backend", "slurm", "--config", CONFIG, PATH=str(bin_dir))
    assert result.returncode == 2 and "sbatch is not on PATH" in result.stderr
