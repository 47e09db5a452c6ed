"""One quickstart run, checked for what issue 25 found missing: a second `rlm train` on its live run directory is
refused (started 4 s after it, and again once it has a checkpoint) and its MLflow run stays whole; the export loads
and generates with the README's lines; the console prints one line a step (a table every trainer.log_freq steps)
and no library warning."""
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.driver.test_train import QUICKSTART, REPO_ROOT, RLM
from tests.helpers.checkpoints import wait_for_checkpoint

# 4 prompts x 4 samples a step, validation before training only, checkpoints at steps 2, 4 and 6 (the last kept).
RUN = ["trainer.total_steps=6", "trainer.save_freq=2", "trainer.log_freq=3", "data.train_batch_size=4",
       "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4"]


def start(run_dir: Path, name: str) -> tuple[subprocess.Popen, Path]:
    out = run_dir.parent / name
    env = {key: value for key, value in os.environ.items() if key != "RLM_DEBUG"}
    with open(f"{out}.stdout", "w") as stdout, open(f"{out}.stderr", "w") as stderr:
        return subprocess.Popen([RLM, "train", QUICKSTART, *RUN, f"trainer.run_dir={run_dir}"], cwd=REPO_ROOT,
                                env=env, stdout=stdout, stderr=stderr), out


def ended(process: subprocess.Popen, out: Path) -> dict:
    return {"pid": process.pid, "code": process.returncode, "stdout": Path(f"{out}.stdout").read_text(),
            "stderr": Path(f"{out}.stderr").read_text()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`first`, then `second` 4 s later (issue 25: the two collided in MLflow's migration), then `third` once the one
    that got the run directory has written a checkpoint (issue 25: it resumed from it and deleted its MLflow run)."""
    run_dir = tmp_path_factory.mktemp("live") / "run"
    first = start(run_dir, "first")
    time.sleep(4)
    second = start(run_dir, "second")
    try:
        deadline = time.monotonic() + 240
        while first[0].poll() is None and second[0].poll() is None:  # the one refused ends first
            assert time.monotonic() < deadline
            time.sleep(0.1)
        refused, running = (first, second) if first[0].poll() is not None else (second, first)
        wait_for_checkpoint(running[0], run_dir, 2, timeout_s=240)
        # Held still (its driver only: the ranks finish their call and wait for the next) so that it is still running
        # when the third gets to the run directory, however fast its remaining steps would be.
        running[0].send_signal(signal.SIGSTOP)
        try:
            third = start(run_dir, "third")
            third[0].wait(timeout=120)
        finally:
            running[0].send_signal(signal.SIGCONT)
        running[0].wait(timeout=300)
    finally:
        for process, _ in (first, second):
            if process.poll() is None:
                process.kill()
    return run_dir, ended(*running), ended(*refused), ended(*third)


def test_a_second_run_on_a_live_run_directory_is_refused_naming_it_and_its_mlflow_run_stays_whole(runs):
    run_dir, running, refused, third = runs
    assert running["code"] == 0, running["stderr"][-3000:]
    for late in (refused, third):
        assert late["code"] == 2 and late["stdout"] == ""
        assert re.fullmatch(
            rf"trainer\.run_dir={re.escape(str(run_dir))}: another run is using it \(rlm train, pid {running['pid']} "
            rf"on host {re.escape(socket.gethostname())}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it "
            r"to end or stop it, or give this run its own trainer\.run_dir\n", late["stderr"]), late["stderr"]
    with sqlite3.connect(run_dir / "mlflow.db") as store:
        assert store.execute("SELECT lifecycle_stage, status FROM runs").fetchall() == [("active", "FINISHED")]
        steps = store.execute("SELECT step FROM metrics WHERE key = 'critic/score/mean' ORDER BY step").fetchall()
    assert [step for (step,) in steps] == [1, 2, 3, 4, 5, 6]
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["latest", "step_6"]  # keeps 1


def readme_lines_that_load_the_export() -> str:
    """The README's Python block that loads runs/quickstart/hf_policy and generates."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    [block] = [block for block in blocks if "runs/quickstart/hf_policy" in block]
    return block


def test_the_export_holds_its_tokenizer_and_generates_with_the_readmes_lines(runs, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = runs[0]
    export = run_dir / "hf_policy"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (export / name).is_file(), name
    exec(readme_lines_that_load_the_export().replace("runs/quickstart/hf_policy", str(export)), {})
    printed = capsys.readouterr().out
    # What the README's generate() printed is the exported model's own greedy next token.
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "model"))
    model = AutoModelForCausalLM.from_pretrained(export)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "next:3"}], add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    with torch.no_grad():
        greedy = model(**prompt).logits[0, -1].argmax()
    assert printed == tokenizer.decode(greedy) + "\n"


def test_a_run_prints_one_line_a_step_and_a_table_every_log_freq_steps_and_no_library_warning(runs):
    _, running, _, _ = runs
    assert running["stderr"] == ""  # no FutureWarning, no TE/Apex notice, no MLflow INFO, no progress bar
    lines = running["stdout"].splitlines()
    summary = next(index for index, line in enumerate(lines) if line == "critic/score/mean")  # the plot's title
    steps = lines[:summary]
    assert re.fullmatch(r"step 0  val/next_digit/score/mean \S+", steps[0])
    for step in (1, 2, 4, 5):  # one line each: the step, its mean score, response length and time
        [line] = [line for line in steps if line.startswith(f"step {step}  ")]
        assert re.fullmatch(rf"step {step}  critic/score/mean \S+  response_length/mean 1  timing_s/step \S+", line)
    headers = [index for index, line in enumerate(steps) if line.startswith("── step ")]
    assert [steps[index].split()[2] for index in headers] == ["3", "6"]  # the table every trainer.log_freq=3 steps
    table = headers[1] - headers[0] - 2  # step 3's table, then the lines of steps 4 and 5
    assert table > 10 and len(steps) == 5 + 2 * table  # five step lines, and two tables of every metric
