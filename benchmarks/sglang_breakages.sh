#!/bin/bash
# Issue 24: put back each SGLang-protocol breakage alone into a worktree and run the conformance tests that must fail
# on it (benchmarks/RESULTS.md, "SGLang 0.5.23's own code"). It edits the worktree's rlmegatron/rollout and restores it.
#   git worktree add /tmp/check HEAD && PYTHON=$PWD/.venv/bin/python bash benchmarks/sglang_breakages.sh /tmp/check
worktree="${1:?usage: benchmarks/sglang_breakages.sh WORKTREE (a git worktree of this repository, at the commit to check)}"
cd "$worktree"
check() {  # name, tests: the conformance tests that must now fail
  echo "== $1"
  PYTHONPATH="$worktree" timeout 400 "${PYTHON:-python}" -m pytest -q -p no:cacheprovider --timeout 60 -x \
    tests/rollout/test_sglang_conformance.py -k "$2" 2>&1 | grep -E "^E  |passed|failed" | cut -c1-200 | head -4
}
put_back() {  # name, tests, fixed, broken: rlmegatron/rollout/sglang.py with `broken` back in place of `fixed`
  git checkout -q -f -- rlmegatron/rollout
  FIXED="$3" BROKEN="$4" "${PYTHON:-python}" -c "
import os
p = 'rlmegatron/rollout/sglang.py'
s = open(p).read()
assert os.environ['FIXED'] in s, 'the fix is not in ' + p + ': this script is out of date'
open(p, 'w').write(s.replace(os.environ['FIXED'], os.environ['BROKEN']))"
  check "$1" "$2"
}
put_back "1 no weight-update session" "colocated_push" $'        if self._has_sessions():\n            self._post_checked("/begin_weight_update", {})' \
  '        pass'
put_back "2 flush refusal fatal" "adapter_loads" $'            if "HTTP 400" not in str(error):\n                raise\n            return False' \
  '            raise'
put_back "3 /health as liveness" "pause_keeps" 'return self.process.alive and self.client.alive()' \
  'return self.process.alive and self.client.health()'
put_back "4 resume of every tag" "lora_mode_sleep" \
  'released = [tag for tag in check_memory_tags(tags) if tag in self.released]' \
  'released = list(check_memory_tags(tags))'
# 5: the packing before alignment, as it was at d92712c.
git checkout -q -f -- rlmegatron/rollout
git checkout -q d92712c -- rlmegatron/rollout/buckets.py
check "5 unaligned buckets" "colocated_push or disaggregated_push"
git checkout -q -f -- rlmegatron/rollout
