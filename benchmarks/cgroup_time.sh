#!/usr/bin/env bash
# bash benchmarks/cgroup_time.sh NAME COMMAND...: runs COMMAND in a cgroup of its own (cgroup v1 cpuacct, as root) and
# prints its wall time and the CPU time of every process it started, those reparented to init included (Ray's
# daemons, ranks), which the shell's `time` does not see. Used for the suite's entry in benchmarks/RESULTS.md.
set -uo pipefail
name=$1; shift
group=/sys/fs/cgroup/cpuacct/rlm_$name
mkdir -p "$group"
start=$(date +%s.%N)
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$group" "$@"
code=$?
end=$(date +%s.%N)
sleep 2  # what the command left behind winds down
python3 -c "import sys; print(f'{sys.argv[1]}: exit {sys.argv[2]}, wall {float(sys.argv[4]) - float(sys.argv[3]):.1f} s, '
                                f'CPU {int(open(sys.argv[5]).read()) / 1e9:.1f} s')" \
  "$name" "$code" "$start" "$end" "$group/cpuacct.usage"
exit $code
