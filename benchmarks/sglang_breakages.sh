#!/bin/bash
# Issue 24: put back each SGLang-protocol breakage alone into a worktree and run the conformance tests that must fail
# on it (benchmarks/RESULTS.md, "SGLang 0.5.23's own code"). It edits the worktree's rlmegatron/rollout and restores it.
#   git worktree add /tmp/check HEAD && PYTHON=$PWD/.venv/bin/python bash benchmarks/sglang_breakages.sh /tmp/check
worktree="${1:?usage: benchmarks/sglang_breakages.sh WORKTREE (a git worktree of this repository, at the commit to check)}"
cd "$worktree"
run() {  # name, python-mutation, tests
  git checkout -q -f -- rlmegatron/rollout
  "${PYTHON:-python}" -c "$2"
  echo "== $1"
  PYTHONPATH="$worktree" timeout 400 "${PYTHON:-python}" -m pytest -q -p no:cacheprovider --timeout 60 -x \
    tests/rollout/test_sglang_conformance.py -k "$3" 2>&1 | grep -E "^E  |passed|failed" | cut -c1-200 | head -4
}
run "1 no weight-update session" "
p='rlmegatron/rollout/sglang.py'; s=open(p).read()
s=s.replace('        if self._has_sessions():\n            self._post_checked(\"/begin_weight_update\", {})', '        pass')
open(p,'w').write(s)" "colocated_push"
run "2 flush refusal fatal" "
p='rlmegatron/rollout/sglang.py'; s=open(p).read()
s=s.replace('            if \"HTTP 400\" not in str(error):\n                raise\n            return False', '            raise')
open(p,'w').write(s)" "adapter_loads"
run "3 /health as liveness" "
p='rlmegatron/rollout/sglang.py'; s=open(p).read()
s=s.replace('return self.process.alive and self.client.alive()', 'return self.process.alive and self.client.health()')
open(p,'w').write(s)" "pause_keeps"
run "4 resume of every tag" "
p='rlmegatron/rollout/sglang.py'; s=open(p).read()
s=s.replace('released = [tag for tag in check_memory_tags(tags) if tag in self.released]', 'released = list(check_memory_tags(tags))')
open(p,'w').write(s)" "lora_mode_sleep"
run "5 unaligned buckets" "
import subprocess
subprocess.run(['git', 'checkout', '-q', 'd92712c', '--', 'rlmegatron/rollout/buckets.py'], check=True)" "colocated_push or disaggregated_push"
git checkout -q -f -- rlmegatron/rollout
