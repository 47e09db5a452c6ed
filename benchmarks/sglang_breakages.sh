#!/bin/bash
# Put back each SGLang-protocol breakage alone into a worktree and run the conformance tests, against SGLang 0.5.23's
# own server code, that must fail on it (benchmarks/RESULTS.md, "SGLang 0.5.23's own code" and "Weight updates
# that are atomic against SGLang"). It edits the worktree's rlmegatron/rollout and restores it after each.
#   git worktree add /tmp/check HEAD && PYTHON=$PWD/.venv/bin/python bash benchmarks/sglang_breakages.sh /tmp/check
worktree="${1:?usage: benchmarks/sglang_breakages.sh WORKTREE (a git worktree of this repository, at the commit to check)}"
cd "$worktree"
check() {  # name, tests: the conformance tests that must now fail
  echo "== $1"
  PYTHONPATH="$worktree" timeout 600 "${PYTHON:-python}" -m pytest -q -p no:cacheprovider -x \
    tests/rollout/test_sglang_conformance.py -k "$2" 2>&1 | grep -E "^E  |passed|failed" | cut -c1-200 | head -4
}
edit() {  # file, fixed, broken: `broken` back in `file` in place of `fixed`
  FILE="$1" FIXED="$2" BROKEN="$3" "${PYTHON:-python}" -c "
import os
p = os.environ['FILE']
s = open(p).read()
assert os.environ['FIXED'] in s, 'the fix is not in ' + p + ': this script is out of date'
open(p, 'w').write(s.replace(os.environ['FIXED'], os.environ['BROKEN']))"
}
put_back() {  # name, tests, file, fixed, broken: that one breakage alone, then its tests
  git checkout -q -f -- rlmegatron/rollout
  edit "$3" "$4" "$5"
  check "$1" "$2"
}
CLIENT=rlmegatron/rollout/sglang/client.py
ENGINE=rlmegatron/rollout/sglang/engine.py
PUSH=rlmegatron/rollout/sglang/weight_push.py
# Issue 24.
put_back "no weight-update session" "colocated_push" "$CLIENT" \
  $'        if self._has_sessions():\n            self._post_checked("/begin_weight_update", {})' '        pass'
put_back "a refused flush fatal" "adapter_loads" "$CLIENT" \
  $'            if "HTTP 400" not in str(error):\n                raise\n            return False' '            raise'
put_back "resume of every tag" "lora_mode_sleep" "$ENGINE" \
  'released = [tag for tag in check_memory_tags(tags) if tag in self.released]' \
  'released = list(check_memory_tags(tags))'
# Issue 42.
put_back "42.1 a push not held (no pause)" "between_two_buckets" "$PUSH" \
  $'                    client.pause_generation()\n                    paused.append(key)\n' ''
# 42.2 is the push as it was: no pause, and a flush at once whose refusal is ignored.
git checkout -q -f -- rlmegatron/rollout
edit "$PUSH" $'                    client.pause_generation()\n                    paused.append(key)\n' ''
edit "$PUSH" 'flushed = self.servers[key][0].flush_cache(FLUSH_TIMEOUT_S)' \
  'flushed = self.servers[key][0].flush_cache() or True'
check "42.2 a refused flush ignored, no pause" "flushes_the_cache"
put_back "42.3 a session left open after a refusal" "refused_half_way" "$PUSH" \
  '            for key in begun:' '            for key in [key for key in begun if key not in down]:'
put_back "42.5 a waiting-queue abort read as a missing flag" "waiting_in_sglangs_queue" "$CLIENT" \
  '    if reason == "abort" and not output_ids:' '    if False:'
put_back "42.6 /ping alone as liveness" "marked_unhealthy" "$ENGINE" \
  '        if self.client.alive():
            return True' '        return self.client.alive()'
git checkout -q -f -- rlmegatron/rollout
