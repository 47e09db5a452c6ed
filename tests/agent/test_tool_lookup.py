"""configs/tool_lookup_cpu.yaml learns on CPU: a random tiny model learns to call `lookup` with the prompt's key and
answer with the digit it returns (a guess is right 1 in 10), through multi-turn rollouts on two gloo ranks with
token-budget micro-batches; the agent's metrics and its traced trajectories show what it did."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tool_lookup_learns_to_call_the_tool_and_answer_with_its_result(tmp_path):
    out = tmp_path / "report.json"
    # The MLflow store is the run directory's own (no MLFLOW_TRACKING_URI).
    env = {name: value for name, value in os.environ.items() if name != "MLFLOW_TRACKING_URI"}
    run = warm_runs.run([sys.executable, "-m", "tests.agent.tool_lookup_job", str(out),
                          f"trainer.run_dir={tmp_path / 'run'}"],
                         cwd=REPO_ROOT, timeout=900, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    history = {name: [value for _, value in points] for name, points in json.loads(out.read_text())["history"].items()}
    score = history["critic/score/mean"]
    assert len(score) == 150
    assert sum(score[:5]) / 5 < 0.15  # a guess without the call is right 1 in 10
    assert sum(score[-10:]) / 10 >= 0.8
    validation = history["val/tool_lookup/score/mean"]  # greedy, 64 prompts: before training, then every 50 steps
    assert validation[0] == 0.0 and validation[-1] >= 0.9
    # It got there by calling: one call per trajectory, with the prompt's key, and two turns.
    assert history["agent/tool_calls/mean"][-1] >= 0.9 and history["agent/lookup/right_key/mean"][-1] >= 0.9
    assert history["agent/turns/mean"][-1] >= 1.9 and history["agent/tool_errors/sum"][-1] == 0
    # The last step's trajectories as text (the console trace): the call, the tool's digit, that digit again.
    last = run.stdout[run.stdout.rindex("step 150: rollout samples"):]
    assert '<tool_call>{"name": "lookup", "arguments": {"key": "' in last and "score 1, reward 1.2" in last
