"""Renders what launch/submit.sh runs: the Slurm batch script that brings up Ray, or the `ray job submit` line,
once `rlm validate` has accepted exactly the job it will run.

Only the standard library, so any Python can run it; the validation runs in the project's environment (RLM_VENV's
python, else this one). submit.sh checks its own arguments; this file is the single source of the generated text.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Environment forwarded to the Ray job when set at submit time (tracking, caches, network choice).
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "HF_HOME",
    "HF_TOKEN",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_DEBUG",
)
# Not uploaded as the job's working_dir: environments, history and run outputs.
WORKING_DIR_EXCLUDES = [".git", ".venv", "runs", "mlruns", "__pycache__"]


@dataclass(frozen=True)
class Launch:
    config: str
    overrides: tuple[str, ...]
    nodes: int | None
    gpus_per_node: int | None

    def train_command(self) -> list[str]:
        """`rlm train` with the placement the scheduler grants appended, so it wins over the YAML."""
        placement = []
        if self.nodes is not None:
            placement.append(f"placement.nnodes={self.nodes}")
        if self.gpus_per_node is not None:
            placement.append(f"placement.gpus_per_node={self.gpus_per_node}")
        return ["rlm", "train", self.config, *self.overrides, *placement]

    @property
    def job_name(self) -> str:
        return "rlm-" + Path(self.config).stem


def validate(launch: Launch, env: dict[str, str]) -> tuple[int, str]:
    """`rlm validate` of the job as it will run (spec, overrides, the placement the scheduler grants), from the
    directory it runs in; its problems and notes go to stderr. (0, the resolved spec) when it may be submitted."""
    python = str(Path(env["RLM_VENV"], "bin", "python")) if env.get("RLM_VENV") else sys.executable
    command = [python, "-m", "rlmegatron", "validate", *launch.train_command()[2:]]
    try:
        # stderr is kept: an interpreter without the project's packages dies with a traceback, said here in a line.
        validated = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError as err:
        code, reason = None, str(err)
    else:
        code, said = validated.returncode, validated.stderr.strip().splitlines()
        if code in (0, 2):  # accepted (with notes), or the spec's problems: rlm validate's own lines
            sys.stderr.write(validated.stderr)
            return code, validated.stdout
        reason = said[-1] if said else f"exit code {code}"
    print(f"submit.sh: cannot validate the spec with {python} ({reason}); activate the project's environment "
          "(source .venv/bin/activate, once bash launch/install.sh made it), or set RLM_VENV (or PYTHON) to one",
          file=sys.stderr)
    return 2, ""


def resolved(spec_text: str, section: str, key: str) -> str:
    """One field of the resolved spec `rlm validate` prints (YAML: top-level sections, two-space keys), read without
    a YAML library: this file runs on any Python."""
    inside = False
    for line in spec_text.splitlines():
        if not line.startswith(" "):
            inside = line == f"{section}:"
        elif inside and line.startswith(f"  {key}:"):
            return line.split(":", 1)[1].strip().strip("'\"")
    raise KeyError(f"{section}.{key}")


def absolute_run_dir(launch: Launch, spec_text: str) -> Launch:
    """A Ray job runs in a copy of the working directory that Ray unpacks on the head (`working_dir`), which goes when
    the job ends: a relative trainer.run_dir (checkpoints, the MLflow store, the exported policy) is made absolute
    against this repository, which the cluster's nodes must share (docs/clusters.md, "Several nodes")."""
    run_dir = resolved(spec_text, "trainer", "run_dir")
    if Path(run_dir).is_absolute() or any(o.startswith("trainer.run_dir=") for o in launch.overrides):
        return launch
    return Launch(launch.config, (*launch.overrides, f"trainer.run_dir={REPO_ROOT / run_dir}"), launch.nodes,
                  launch.gpus_per_node)


def render_ray_command(launch: Launch, env: dict[str, str]) -> list[str]:
    runtime_env = {
        "working_dir": ".",
        "excludes": WORKING_DIR_EXCLUDES,
        "env_vars": {name: env[name] for name in FORWARDED_ENV if env.get(name)},
    }
    return [
        "ray", "job", "submit",
        "--address", env["RAY_ADDRESS"],
        "--runtime-env-json", json.dumps(runtime_env, sort_keys=True),
        "--",
        *launch.train_command(),
    ]


def render_sbatch(launch: Launch, env: dict[str, str], device: str = "cuda") -> str:
    """The batch script: Ray across the allocation (a head on the first node, a worker on each other, each at its
    node's address), `rlm train` on the head once every node joined, and Ray stopped however the job ends. With
    device cpu the devices are CPUs (a CPU cluster, or launch/local_cluster.sh's)."""
    nodes, per_node = launch.nodes or 1, launch.gpus_per_node or 8
    train = shlex.join(launch.train_command())
    activate = f"source {shlex.quote(env['RLM_VENV'])}/bin/activate\n" if env.get("RLM_VENV") else ""
    devices = f"#SBATCH --gpus-per-node={per_node}" if device == "cuda" else f"#SBATCH --cpus-per-task={per_node}"
    resource, ray_devices = ("GPU", f"--num-gpus={per_node}") if device == "cuda" else \
        ("CPU", f"--num-cpus={per_node} --num-gpus=0")
    return f"""#!/bin/bash
#SBATCH --job-name={launch.job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{devices}
#SBATCH --exclusive
#SBATCH --chdir={shlex.quote(str(REPO_ROOT))}
#SBATCH --output=runs/slurm/%x-%j.out
#SBATCH --signal=B:TERM@120
# Generated by launch/submit.sh; partition, account and time limit come from SBATCH_* variables.
set -euo pipefail
{activate}
NNODES={nodes}
DEVICES_PER_NODE={per_node}
RAY_PORT="${{RAY_PORT:-6379}}"
RAY_DASHBOARD_PORT="${{RAY_DASHBOARD_PORT:-8265}}"
RAY_JOIN_TIMEOUT_S="${{RAY_JOIN_TIMEOUT_S:-600}}"
# Ray's files (sockets, logs, the jobs' unpacked working directories) go under here, a directory per node; a
# job-private token authenticates its nodes and driver.
export RAY_TMPDIR="${{RAY_TMPDIR:-/tmp/ray}}"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$PWD/runs/slurm/$SLURM_JOB_ID.ray_token"
(umask 077 && python -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH")

# A node's address is the one Slurm reaches it at (its NodeAddr), as an IPv4 address: not what its hostname
# resolves to, which on Debian hosts is often 127.0.1.1, unreachable from the other nodes.
node_ip() {{
  local addr
  addr="$(scontrol show node "$1" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')"
  if [[ "$addr" =~ ^[0-9.]+$ ]]; then echo "$addr"; else getent ahostsv4 "$addr" | awk 'NR == 1 {{print $1}}'; fi
}}
# Ray's per-node ports: its defaults, unless RLM_RAY_NODE_PORTS gives a base for nodes that share a machine (a
# cluster on one box: launch/local_cluster.sh), each node then taking its own from it (and 200 worker ports from
# RLM_RAY_WORKER_PORTS) by its index in the job.
ray_node_ports() {{
  [[ -n "${{RLM_RAY_NODE_PORTS:-}}" ]] || return 0
  local index=0 name
  for name in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    [[ "$name" == "$SLURMD_NODENAME" ]] && break
    index=$((index + 1))
  done
  local base=$((RLM_RAY_NODE_PORTS + 10 * index)) workers=$((${{RLM_RAY_WORKER_PORTS:-10002}} + 200 * index))
  echo "--node-manager-port=$base --object-manager-port=$((base + 1)) --dashboard-agent-listen-port=$((base + 2))" \\
       "--dashboard-agent-grpc-port=$((base + 3)) --runtime-env-agent-port=$((base + 4))" \\
       "--metrics-export-port=$((base + 5)) --ray-client-server-port=$((base + 6))" \\
       "--min-worker-port=$workers --max-worker-port=$((workers + 199))"
}}
# NCCL takes an exclusion list; Gloo needs one interface name, so each node uses the one holding its address.
export NCCL_SOCKET_IFNAME="${{NCCL_SOCKET_IFNAME:-^lo,docker0}}"
node_ifname() {{
  local ip
  ip="$(node_ip "$SLURMD_NODENAME")"
  case "$ip" in 127.*) echo lo; return ;; esac
  ip -o -4 addr show | awk -v ip="$ip" 'index($4, ip "/") == 1 {{print $2}}'
}}
export -f node_ip ray_node_ports node_ifname  # srun's bash -c on every node inherits them
GLOO_IFNAME_SETUP='export GLOO_SOCKET_IFNAME="${{GLOO_SOCKET_IFNAME:-$(node_ifname)}}"'

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_NODE="${{NODES[0]}}"
HEAD_IP="$(node_ip "$HEAD_NODE")"
export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"

# Ray runs in job steps of its own (`ray start --block`): stopping a step stops that node's Ray and what it started.
# Never Ray's stop command, which ends every Ray on the node, another job's too.
RAY_PIDS=()
cleanup() {{
  trap - EXIT INT TERM
  echo "stopping Ray on $NNODES node(s)"
  for pid in "${{RAY_PIDS[@]}}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
  rm -f "$RAY_AUTH_TOKEN_PATH"
}}
trap cleanup EXIT INT TERM

# Each node's Ray start-up and logs go to a file of its own beside the job's output.
RAY_OUTPUT="runs/slurm/%x-%j-ray-%N.out"
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD_NODE" --output="$RAY_OUTPUT" \\
  bash -c "$GLOO_IFNAME_SETUP; exec ray start --head \\
  --node-ip-address=$HEAD_IP --port=$RAY_PORT --dashboard-host=$HEAD_IP --dashboard-port=$RAY_DASHBOARD_PORT \\
  --temp-dir=\\$RAY_TMPDIR/\\$SLURMD_NODENAME {ray_devices} --disable-usage-stats \\$(ray_node_ports) --block" &
RAY_PIDS+=($!)
if (( NNODES > 1 )); then
  # Workers that dial in before the head's GCS listens give up.
  deadline=$((SECONDS + RAY_JOIN_TIMEOUT_S))
  until (exec 3<>"/dev/tcp/$HEAD_IP/$RAY_PORT") 2>/dev/null; do
    if (( SECONDS > deadline )); then
      echo "Ray's head did not listen on $RAY_ADDRESS within $RAY_JOIN_TIMEOUT_S s" >&2
      exit 1
    fi
    sleep 1
  done
  srun --overlap --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) --ntasks-per-node=1 --exclude="$HEAD_NODE" \\
    --output="$RAY_OUTPUT" bash -c "$GLOO_IFNAME_SETUP; exec ray start --address=$RAY_ADDRESS \\
      --node-ip-address=\\$(node_ip \\$SLURMD_NODENAME) --temp-dir=\\$RAY_TMPDIR/\\$SLURMD_NODENAME {ray_devices} \\
      --disable-usage-stats \\$(ray_node_ports) --block" &
  RAY_PIDS+=($!)
fi

EXPECTED={resource}
EXPECTED_DEVICES=$((NNODES * DEVICES_PER_NODE))
deadline=$((SECONDS + RAY_JOIN_TIMEOUT_S))
until python - "$EXPECTED" "$EXPECTED_DEVICES" <<'PY'
import sys, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
resource, expected = sys.argv[1], int(sys.argv[2])
joined = sum(node["Resources"].get(resource, 0) for node in ray.nodes() if node["Alive"])
print(f"ray cluster: {{joined:g}} of {{expected}} {{resource}}s joined", flush=True)
sys.exit(0 if joined >= expected else 1)
PY
do
  if (( SECONDS > deadline )); then
    echo "Ray did not reach $EXPECTED_DEVICES {resource}s within $RAY_JOIN_TIMEOUT_S s" >&2
    exit 1
  fi
  sleep 2
done

eval "$GLOO_IFNAME_SETUP"
{train}
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=["slurm", "ray"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpus-per-node", type=int)
    # Overrides follow `--`, split off by hand: argparse cannot mix them with the options reliably.
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    launch = Launch(args.config, tuple(argv[split + 1 :]), args.nodes, args.gpus_per_node)
    env = dict(os.environ)
    # Nothing is rendered, so nothing is written or submitted, for a job that would fail before its first worker.
    code, spec_text = validate(launch, env)
    if code:
        return code
    if args.backend == "slurm":
        sys.stdout.write(render_sbatch(launch, env, resolved(spec_text, "placement", "device")))
    else:
        launch = absolute_run_dir(launch, spec_text)
        sys.stdout.write(shlex.join(render_ray_command(launch, env)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
