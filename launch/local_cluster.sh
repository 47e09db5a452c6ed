#!/usr/bin/env bash
# A real multi-node cluster on one machine: Ray nodes and Slurm nodes on loopback addresses (127.0.0.2, .3, ...),
# each with its own address, ports and devices. Try multi-node runs on a laptop; the test suite's multi-node tests
# run on it. Nothing it starts listens beyond 127.0.0.0/8, and it never touches another Ray or Slurm on the machine
# (its own ports, state directory and processes; never `ray stop`).
#
#   launch/local_cluster.sh up [--nodes N] [--cpus-per-node C] [--no-slurm]   start (N=3 nodes of C=2 CPU "devices")
#   launch/local_cluster.sh status                                           what runs, and the variables to use it
#   launch/local_cluster.sh env                                              export lines: eval "$(... env)"
#   launch/local_cluster.sh stop-node I | start-node I                       lose node I outright, or bring it back
#   launch/local_cluster.sh down                                             stop everything it started
#
# Node 0 is Ray's head (GCS and dashboard) and Slurm's controller; every node, the head included, is a Ray node and a
# Slurm node with C CPUs. A placement with device cpu takes CPUs as its devices, so gpus_per_node <= C.
# Environment: RLM_CLUSTER_DIR (state, default /tmp/rlm-cluster), RLM_CLUSTER_PORT (first of its ports,
# default 26300; it uses about 100 from there, and a Slurm job's Ray 100 more from +1700), RLM_CLUSTER_WORKER_PORT
# (Ray's worker ports, 200 per node, default 17000; a Slurm job's Ray takes its nodes' from +1000),
# RLM_VENV (the environment whose ray and python it runs, default this repository's .venv).
set -euo pipefail

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$LAUNCH_DIR")"
STATE="${RLM_CLUSTER_DIR:-/tmp/rlm-cluster}"
BASE="${RLM_CLUSTER_PORT:-26300}"
# Ray's worker ports below 20000, as Ray's own defaults are: rlmegatron draws the ports its servers and rendezvous
# take at random from 20000 up (runtime.distributed.free_port), and one drawn from a raylet's range could be taken
# from under a worker before it starts.
WORKER_BASE="${RLM_CLUSTER_WORKER_PORT:-17000}"
VENV="${RLM_VENV:-$REPO_ROOT/.venv}"
RAY="$VENV/bin/ray"
PYTHON="$VENV/bin/python"

say() { echo "local_cluster: $*" >&2; }
fail() { say "$*"; exit 2; }

node_ip() { echo "127.0.0.$(( $1 + 2 ))"; }
gcs_address() { echo "$(node_ip 0):$BASE"; }
dashboard_url() { echo "http://$(node_ip 0):$(( BASE + 1 ))"; }
# Every process of node I carries this in its environment (inherited by Ray's workers, the ranks and what they
# start), so stop-node finds all of them, and nothing else (rlmegatron/supervision/reaper.py's sweep).
node_mark() { echo "local-cluster-$(basename "$STATE")-node$1"; }

nodes_configured() { cat "$STATE/nodes" 2>/dev/null || echo 0; }
cpus_configured() { cat "$STATE/cpus" 2>/dev/null || echo 0; }

ray_alive() {  # node I's `ray start --block` still runs
  local pid
  pid="$(cat "$STATE/ray/node$1.pid" 2>/dev/null)" || return 1
  kill -0 "$pid" 2>/dev/null
}

wait_for_ray_node() {  # I: until node I's `ray start` says it runs (the node registered with the GCS)
  local i="$1" deadline=$((SECONDS + 90))
  until grep -q "Ray runtime started" "$STATE/ray/node$i.log" 2>/dev/null; do
    if ! ray_alive "$i" || (( SECONDS > deadline )); then
      say "Ray node $i ($(node_ip "$i")) did not start; the end of its log:"
      tail -5 "$STATE/ray/node$i.log" >&2
      return 1
    fi
    sleep 0.3
  done
}

# Token authentication with a token of its own (not ~/.ray/auth_token, another Ray's): every node, driver and `ray
# job submit` of this cluster presents it (`env` exports it).
ray_auth() { echo "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$STATE/ray/auth_token"; }

start_ray_node() {  # I CPUS
  local i="$1" cpus="$2" ip ports
  ip="$(node_ip "$i")"
  # Each node's own ports: a Ray node binds some of them on every address, and all nodes share this machine.
  ports=(--node-manager-port=$((BASE + 10 + i)) --object-manager-port=$((BASE + 20 + i))
         --dashboard-agent-listen-port=$((BASE + 30 + i)) --dashboard-agent-grpc-port=$((BASE + 40 + i))
         --runtime-env-agent-port=$((BASE + 50 + i)) --metrics-export-port=$((BASE + 60 + i))
         --min-worker-port=$((WORKER_BASE + 200 * i)) --max-worker-port=$((WORKER_BASE + 199 + 200 * i)))
  local role=(--address="$(gcs_address)")
  if (( i == 0 )); then
    role=(--head --port="$BASE" --dashboard-host="$ip" --dashboard-port=$((BASE + 1))
          --ray-client-server-port=$((BASE + 2)))
  fi
  # Its own files (--temp-dir): nodes that share one directory also share the working directories Ray unpacks
  # for a job, and one node's clean-up removes another's. Its own session (setsid): a Ctrl-C in the shell that ran `up` does not reach it. PATH leads with the venv, so a
  # Ray job's entrypoint (`rlm train`, launch/submit.sh --backend ray) finds the project's commands.
  env RLM_SESSION_MARK="$(node_mark "$i")" PATH="$VENV/bin:$PATH" RAY_USAGE_STATS_ENABLED=0 $(ray_auth) \
    RAY_health_check_period_ms=1000 RAY_health_check_timeout_ms=1000 RAY_health_check_failure_threshold=3 \
    setsid "$RAY" start "${role[@]}" --node-ip-address="$ip" --num-cpus="$cpus" --num-gpus=0 \
      --temp-dir="$STATE/ray/n$i" --object-store-memory=$((256 * 1024 * 1024)) --disable-usage-stats \
      --include-log-monitor=false "${ports[@]}" --block </dev/null >"$STATE/ray/node$i.log" 2>&1 &
  echo $! >"$STATE/ray/node$i.pid"
}

stop_ray_node() {  # SIGKILL every process of node I: its raylet, agents, workers and what they started
  "$PYTHON" -c "import sys; from rlmegatron.supervision.reaper import sweep; sweep(sys.argv[1], sys.argv[2])" \
    "$(node_mark "$1")" "$STATE/ray/no-session-dir"
  rm -f "$STATE/ray/node$1.pid"
}

# --- Slurm: slurmctld, slurmdbd (on MariaDB, for sacct) and a slurmd per node, each in its own UTS namespace whose
# hostname is its node's name (rlm-nodeI), so a job step's `hostname` is the node it runs on ---

SLURM_PACKAGES=(slurmctld slurmd slurm-client slurmdbd mariadb-server)

have_slurm() { [[ -f "$STATE/slurm/slurm.conf" ]]; }

ensure_slurm_packages() {  # prints why not, in one line, when it cannot
  local missing=() tool
  for tool in slurmctld slurmd sbatch slurmdbd mariadbd mariadb-install-db; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  (( ${#missing[@]} == 0 )) && return 0
  if (( EUID != 0 )); then
    echo "Slurm is not installed (no ${missing[*]}) and installing it needs root: apt-get install ${SLURM_PACKAGES[*]}"
    return 1
  fi
  if ! command -v apt-get >/dev/null; then
    echo "Slurm is not installed (no ${missing[*]}) and this machine has no apt-get to install it with"
    return 1
  fi
  say "installing Slurm and MariaDB from Debian (${SLURM_PACKAGES[*]})"
  # The packages' own services may start (where the machine lets them): they use Slurm's default ports and
  # /etc/slurm, not this cluster's; this script runs daemons of its own.
  local install=(apt-get install -y -q --no-install-recommends "${SLURM_PACKAGES[@]}")
  # A machine whose package lists are stale or missing gets them first, once the install says so.
  if ! DEBIAN_FRONTEND=noninteractive "${install[@]}" >"$STATE/apt.log" 2>&1 &&
     ! { apt-get update -q >>"$STATE/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive "${install[@]}" \
         >>"$STATE/apt.log" 2>&1; }; then
    echo "apt-get install ${SLURM_PACKAGES[*]} failed (see $STATE/apt.log)"
    return 1
  fi
}

slurm_port() { echo $(( BASE + 100 + $1 )); }  # 0: slurmctld, 1: slurmdbd, 2: MariaDB, 10+I: node I's slurmd

write_slurm_conf() {  # N CPUS
  local nodes="$1" cpus="$2" dir="$STATE/slurm" i
  cat >"$dir/slurm.conf" <<CONF
# Written by launch/local_cluster.sh: a cluster on one machine, its nodes on loopback addresses.
ClusterName=rlmlocal
SlurmctldHost=rlm-node0($(node_ip 0))
SlurmctldPort=$(slurm_port 0)
SlurmUser=$(id -un)
SlurmdUser=root
# One machine, one identity: no munge (auth/none is still in Slurm 22.05).
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/%n/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/%n/slurmd.log
# No cgroup hierarchy of its own in a container: processes are tracked by their parents.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$(node_ip 0)
AccountingStoragePort=$(slurm_port 1)
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Every node has C CPUs whatever this machine has; the slurmds' own view of the hardware is the machine's.
SlurmdParameters=config_overrides
DebugFlags=NO_CONF_HASH
KillWait=10
# Job ids go on from one cluster to the next (its state starts empty each time): a job's output file,
# runs/slurm/<name>-<id>.out, is never an earlier cluster's job's.
FirstJobId=$(( $(date +%s) % 60000000 + 1 ))
CONF
  for (( i = 0; i < nodes; i++ )); do
    echo "NodeName=rlm-node$i NodeHostname=rlm-node$i NodeAddr=$(node_ip "$i") Port=$(slurm_port $((10 + i)))" \
      "CPUs=$cpus State=UNKNOWN" >>"$dir/slurm.conf"
  done
  echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$dir/slurm.conf"
  (umask 077 && cat >"$dir/slurmdbd.conf" <<CONF
AuthType=auth/none
DbdHost=rlm-node0
DbdAddr=$(node_ip 0)
DbdPort=$(slurm_port 1)
SlurmUser=$(id -un)
PidFile=$dir/slurmdbd.pid
LogFile=$dir/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=$(node_ip 0)
StoragePort=$(slurm_port 2)
StorageUser=root
StorageLoc=slurm_acct_db
CONF
  )
}

on_node() {  # I COMMAND...: COMMAND in a UTS namespace of its own named as node I, carrying node I's Slurm mark
  local i="$1"
  shift
  env RLM_SESSION_MARK="$(node_mark "$i")-slurm" SLURM_CONF="$STATE/slurm/slurm.conf" \
    unshare --uts -- bash -c 'hostname "$0" && exec "$@"' "rlm-node$i" "$@"
}

wait_until() {  # SECONDS WHAT COMMAND...: poll COMMAND until it succeeds
  local limit="$1" what="$2" deadline=$((SECONDS + $1))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS > deadline )); then say "$what: not ready after $limit s; logs in $STATE/slurm/"; return 1; fi
    sleep 0.3
  done
}

start_slurm() {  # N CPUS
  local nodes="$1" cpus="$2" dir="$STATE/slurm" i
  mkdir -p "$dir/state" "$dir/db"
  write_slurm_conf "$nodes" "$cpus"
  # sacct reads slurmdbd, which keeps its records in MariaDB: a server of its own, on node 0's address.
  mariadb-install-db --datadir="$dir/db" --user="$(id -un)" --auth-root-authentication-method=normal \
    --skip-test-db >"$dir/mariadb-install.log" 2>&1
  env RLM_SESSION_MARK="$(node_mark 0)-slurm" setsid mariadbd --no-defaults --datadir="$dir/db" \
    --socket="$dir/mariadb.sock" --port="$(slurm_port 2)" --bind-address="$(node_ip 0)" --user="$(id -un)" \
    --pid-file="$dir/mariadb.pid" --log-error="$dir/mariadb.log" --skip-grant-tables --skip-log-bin \
    --innodb-buffer-pool-size=16M </dev/null >/dev/null 2>&1 &
  wait_until 60 MariaDB mariadb --no-defaults -h "$(node_ip 0)" -P "$(slurm_port 2)" -u root -e "select 1" || return 1
  on_node 0 slurmdbd
  wait_until 60 slurmdbd env SLURM_CONF="$dir/slurm.conf" sacctmgr -n list cluster || return 1
  SLURM_CONF="$dir/slurm.conf" sacctmgr -i add cluster rlmlocal >/dev/null 2>&1 || true
  on_node 0 slurmctld
  for (( i = 0; i < nodes; i++ )); do
    mkdir -p "$dir/rlm-node$i"
    on_node "$i" slurmd -N "rlm-node$i"
  done
  wait_until 60 "Slurm's nodes" slurm_nodes_idle "$nodes"
}

slurm_nodes_idle() { (( $(SLURM_CONF="$STATE/slurm/slurm.conf" sinfo -h -N -t idle -o %N | wc -l) >= $1 )); }

stop_slurm() {
  local dir="$STATE/slurm" i pidfile
  [[ -d "$dir" ]] || return 0
  # The jobs first: a job's steps stop in order (their Ray nodes shut down), then the daemons.
  if [[ -f "$dir/slurm.conf" ]]; then
    SLURM_CONF="$dir/slurm.conf" scancel --quiet --user="$(id -un)" 2>/dev/null || true
    wait_until 30 "the jobs' end" slurm_jobs_gone || true
  fi
  for pidfile in "$dir"/rlm-node*/slurmd.pid "$dir/slurmctld.pid" "$dir/slurmdbd.pid" "$dir/mariadb.pid"; do
    [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  # Whatever is left of a node's daemons and job steps (they carry its mark), outright.
  for (( i = 0; i < $(nodes_configured); i++ )); do
    "$PYTHON" -c "import sys; from rlmegatron.supervision.reaper import sweep; sweep(sys.argv[1], sys.argv[2])" \
      "$(node_mark "$i")-slurm" "$dir/no-session-dir"
  done
}

slurm_jobs_gone() { [[ -z "$(SLURM_CONF="$STATE/slurm/slurm.conf" squeue -h -o %i 2>/dev/null)" ]]; }

# --- commands ---

cmd_up() {
  local nodes=3 cpus=2 slurm=1
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --nodes) nodes="$2"; shift 2 ;;
      --cpus-per-node) cpus="$2"; shift 2 ;;
      --no-slurm) slurm=0; shift ;;
      *) fail "up: unknown option '$1' (--nodes N, --cpus-per-node C, --no-slurm)" ;;
    esac
  done
  [[ "$nodes" =~ ^[1-9][0-9]?$ ]] && (( nodes <= 20 )) || fail "up: --nodes must be 1..20, got '$nodes'"
  [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || fail "up: --cpus-per-node must be a positive integer, got '$cpus'"
  [[ -x "$RAY" ]] || fail "no ray in $VENV; run bash launch/install.sh --cpu first, or set RLM_VENV"
  if [[ -f "$STATE/nodes" ]]; then
    fail "a cluster is already up in $STATE (launch/local_cluster.sh status); take it down first"
  fi
  local port busy=()
  for port in "$BASE" $((BASE + 1)) $((BASE + 2)) $((BASE + 100)) $((BASE + 101)) $((BASE + 102)); do
    (exec 3<>"/dev/tcp/$(node_ip 0)/$port") 2>/dev/null && busy+=("$port")
  done
  (( ${#busy[@]} == 0 )) || fail "port(s) ${busy[*]} on $(node_ip 0) are taken (another cluster?); set RLM_CLUSTER_PORT"
  mkdir -p "$STATE/ray"
  (umask 077 && "$PYTHON" -c "import secrets; print(secrets.token_hex(32))" >"$STATE/ray/auth_token")
  echo "$nodes" >"$STATE/nodes"
  echo "$cpus" >"$STATE/cpus"
  local i
  # One after another: a node starting beside another on a loaded machine can miss Ray's 30 s for its raylet to
  # register, and a worker needs the head's GCS up. A node that did not start gets a second try.
  for (( i = 0; i < nodes; i++ )); do
    start_ray_node "$i" "$cpus"
    if ! wait_for_ray_node "$i"; then
      say "starting node $i again"
      stop_ray_node "$i"
      start_ray_node "$i" "$cpus"
      wait_for_ray_node "$i" || { cmd_down; exit 3; }
    fi
  done
  if (( slurm )); then
    local why
    if why="$(ensure_slurm_packages)"; then
      if ! start_slurm "$nodes" "$cpus"; then cmd_down; exit 3; fi
    else
      echo "$why" >"$STATE/no-slurm"
      say "no Slurm: $why"
    fi
  else
    echo "not asked for (up --no-slurm)" >"$STATE/no-slurm"
  fi
  cmd_status
}

cmd_env() {
  [[ -f "$STATE/nodes" ]] || fail "no cluster is up in $STATE (launch/local_cluster.sh up)"
  echo "export RAY_ADDRESS=$(gcs_address) $(ray_auth)"
  echo "export RLM_RAY_DASHBOARD=$(dashboard_url)"
  if have_slurm; then
    echo "export SLURM_CONF=$STATE/slurm/slurm.conf"
    # For the Ray a Slurm job starts across its nodes (launch/submit.sh's batch script): ports and files of its
    # own, apart from this cluster's Ray, and a port each for nodes that share this machine.
    echo "export RAY_PORT=$((BASE + 1700)) RAY_DASHBOARD_PORT=$((BASE + 1701)) RLM_RAY_NODE_PORTS=$((BASE + 1710))"
    echo "export RLM_RAY_WORKER_PORTS=$((WORKER_BASE + 1000))"
    echo "export RAY_TMPDIR=$STATE/sray"
  fi
  echo "export PATH=$VENV/bin:\$PATH"
}

cmd_status() {
  if [[ ! -f "$STATE/nodes" ]]; then
    echo "no cluster is up in $STATE"
    return 0
  fi
  local i nodes
  nodes="$(nodes_configured)"
  echo "local cluster in $STATE: $nodes nodes of $(cpus_configured) CPUs"
  for (( i = 0; i < nodes; i++ )); do
    local ray=down head=""
    ray_alive "$i" && ray=up
    (( i == 0 )) && head=" (head: $(gcs_address), dashboard $(dashboard_url))"
    echo "  node $i  $(node_ip "$i")  ray $ray$head"
  done
  if have_slurm; then
    SLURM_CONF="$STATE/slurm/slurm.conf" sinfo -N -o "  %N %T %c CPUs" 2>&1 | sed 's/^/  slurm: /'
  else
    echo "  slurm: $(cat "$STATE/no-slurm" 2>/dev/null || echo 'not started')"
  fi
  echo "use it: eval \"\$(launch/local_cluster.sh env)\""
}

cmd_stop_node() {
  local i="${1:-}"
  [[ "$i" =~ ^[0-9]+$ ]] && (( i < $(nodes_configured) )) ||
    fail "stop-node: give a node index below $(nodes_configured)"
  stop_ray_node "$i"
  say "node $i ($(node_ip "$i")) stopped outright: its Ray processes and everything they started were killed"
}

cmd_start_node() {
  local i="${1:-}"
  [[ "$i" =~ ^[0-9]+$ ]] && (( i > 0 && i < $(nodes_configured) )) ||
    fail "start-node: give a worker node index (1..$(( $(nodes_configured) - 1 )))"
  ray_alive "$i" && fail "start-node: node $i is up"
  start_ray_node "$i" "$(cpus_configured)"
  wait_for_ray_node "$i" || exit 3
  say "node $i ($(node_ip "$i")) started"
}

cmd_down() {
  [[ -d "$STATE" ]] || { echo "no cluster is up in $STATE"; return 0; }
  stop_slurm
  local i
  # The workers first, the head last: a worker whose head is gone retries for a while before it exits.
  for (( i = $(nodes_configured) - 1; i >= 0; i-- )); do stop_ray_node "$i"; done
  rm -rf "$STATE"
  echo "local cluster down"
}

command="${1:-}"
shift || true
case "$command" in
  up) cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  stop-node) cmd_stop_node "$@" ;;
  start-node) cmd_start_node "$@" ;;
  *) echo "usage: launch/local_cluster.sh up [--nodes N] [--cpus-per-node C] [--no-slurm] | status | env" \
          "| stop-node I | start-node I | down" >&2
     exit 2 ;;
esac
