#!/usr/bin/env bash
# Submits an rlmegatron job to Slurm (a batch script that brings up Ray on the allocation) or to a
# running Ray cluster (ray job submit). The generated text comes from launch/render.py.
set -euo pipefail

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$LAUNCH_DIR")"
PYTHON="${PYTHON:-python3}"

usage() {
  cat <<'EOF'
usage: launch/submit.sh --backend slurm|ray --config CONFIG [--nodes N] [--gpus-per-node G] [--dry-run] [-- KEY=VALUE ...]

  --backend slurm   write runs/slurm/<job>.sbatch and submit it with sbatch; the script starts a Ray
                    head on the first node and workers on the others, waits for N×G GPUs, runs
                    `rlm train CONFIG overrides placement.nnodes=N placement.gpus_per_node=G`, and
                    stops Ray on exit or cancellation. N defaults to 1, G to 8.
  --backend ray     ray job submit --address "$RAY_ADDRESS" to a running cluster; placement
                    overrides are added only for the flags given.
  --dry-run         print what would run (the batch script and the sbatch command, or the ray
                    command) and submit nothing.
  -- KEY=VALUE ...  dotted overrides passed to `rlm train`, e.g. -- rollout.n=8 actor.optim.lr=1e-6

  Before anything is written or submitted, `rlm validate` checks the job as it will run: the spec with
  its overrides and the placement of --nodes/--gpus-per-node, from the repository root, with
  $RLM_VENV/bin/python (else $PYTHON). Its problems are printed and submit.sh exits 2.

environment: RAY_ADDRESS (ray backend), RLM_VENV (a venv the batch script activates),
  SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_TIMELIMIT (read by sbatch itself),
  RAY_PORT, RAY_DASHBOARD_PORT, RAY_JOIN_TIMEOUT_S, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME
  (defaults in the batch script), MLFLOW_TRACKING_URI and HF_HOME (forwarded to the job).
EOF
}

fail() {
  echo "submit.sh: $*" >&2
  echo "run launch/submit.sh --help for usage" >&2
  exit 2
}

need_value() {  # the flag $1 must be followed by a value
  [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || fail "$1 needs a value"
}

positive_int() {  # flag name, value
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || fail "$1 must be a positive integer, got '$2'"
}

backend="" config="" nodes="" gpus_per_node="" dry_run=0
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --backend) need_value "$@"; backend="$2"; shift 2 ;;
    --config) need_value "$@"; config="$2"; shift 2 ;;
    --nodes) need_value "$@"; positive_int --nodes "$2"; nodes="$2"; shift 2 ;;
    --gpus-per-node) need_value "$@"; positive_int --gpus-per-node "$2"; gpus_per_node="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; overrides=("$@"); break ;;
    *) fail "unknown argument '$1' (overrides go after --)" ;;
  esac
done

[[ -n "$backend" ]] || fail "--backend is required (slurm or ray)"
[[ "$backend" == slurm || "$backend" == ray ]] || fail "--backend must be slurm or ray, got '$backend'"
[[ -n "$config" ]] || fail "--config is required"
[[ -f "$config" ]] || fail "--config $config is not a file"
# The job runs from the repository root, so a path relative to elsewhere is made absolute.
if [[ "$config" != /* && "$PWD" != "$REPO_ROOT" ]]; then
  config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
fi
for override in "${overrides[@]+"${overrides[@]}"}"; do
  [[ "$override" == *=* ]] || fail "override '$override' must look like key=value"
done

render_args=("$backend" --config "$config")
if [[ "$backend" == slurm ]]; then
  render_args+=(--nodes "${nodes:-1}" --gpus-per-node "${gpus_per_node:-8}")
else
  [[ -n "${RAY_ADDRESS:-}" ]] || fail "RAY_ADDRESS is not set; export RAY_ADDRESS=http://HEAD:8265 (the Ray dashboard)"
  [[ -n "$nodes" ]] && render_args+=(--nodes "$nodes")
  [[ -n "$gpus_per_node" ]] && render_args+=(--gpus-per-node "$gpus_per_node")
fi
if (( ! dry_run )); then
  if [[ "$backend" == slurm ]]; then
    command -v sbatch >/dev/null || fail "sbatch is not on PATH; run this on a Slurm login node"
  else
    command -v ray >/dev/null || fail "ray is not on PATH; activate the project's environment"
  fi
fi
# render.py runs `rlm validate` on the job as submitted first: a spec that would fail exits 2 here (set -e),
# before anything is written or submitted.
rendered="$("$PYTHON" "$LAUNCH_DIR/render.py" "${render_args[@]}" -- "${overrides[@]+"${overrides[@]}"}")"

if [[ "$backend" == slurm ]]; then
  script="runs/slurm/rlm-$(basename "${config%.*}")-$(date +%Y%m%d-%H%M%S).sbatch"
  if (( dry_run )); then
    echo "# --- $script ---"
    echo "$rendered"
    echo "# --- command ---"
    echo "sbatch $script"
    exit 0
  fi
  cd "$REPO_ROOT"
  mkdir -p runs/slurm
  printf '%s\n' "$rendered" > "$script"
  exec sbatch "$script"
fi

if (( dry_run )); then
  echo "$rendered"
  exit 0
fi
cd "$REPO_ROOT"  # working_dir "." uploads the repository
eval "exec $rendered"
