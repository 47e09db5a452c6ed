"""rlmegatron against TRL's GRPOTrainer on TRL's own echo task, back to back on this machine.

    python benchmarks/peer_trl.py --peer-dir /work/shared/peers/trl_grpo

1. Writes the task with the peer's make_task.py (model, tokenizer, train.jsonl; nothing is changed afterwards) to
   runs/peer_trl/task/, unless it is there, and checks that rlmegatron's prompt token ids for it are TRL's.
2. Runs the peer's run.py (TRL, in its own venv) for --trl-steps steps; it writes a JSON.
3. Runs `rlm train benchmarks/peer_trl_echo/spec.yaml` for --rlm-steps steps in a child process that records, for
   every step, when the tracker logged it and the step's metrics (timing_s/* included).
4. Prints, for both: the training wall time to a 5-step mean reward of 0.8 (TRL's own measure, from the start of
   training), steps/s, the start-up time before step 1, and rlmegatron's per-phase breakdown; then the ratio.
   Everything also goes to runs/peer_trl/result.json.

Start-up is measured the same way on both sides: from the script's start (before torch is imported) to the start
of training (TRL: trainer.train(); rlmegatron: the fit loop, after Ray, the ranks, the model load and the first
weight sync).
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()  # before anything heavy is imported: the child's start-up clock

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC = "benchmarks/peer_trl_echo/spec.yaml"
TASK = "runs/peer_trl/task"  # where the spec's paths point
WINDOW, THRESHOLD = 5, 0.8
REWARD = "critic/score/mean"


def first_reach(rewards: list[float], times: list[float], threshold: float = THRESHOLD, window: int = WINDOW):
    """First step (1-based) whose trailing `window`-step mean reward is >= threshold, and its time: run.py's rule."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= threshold:
            return {"step": i + 1, "wall_s": round(times[i], 2)}
    return None


def median_step_s(times: list[float]) -> float:
    return statistics.median(b - a for a, b in zip([0.0, *times[:-1]], times))


# --- the rlmegatron side, in its own process -------------------------------------------------------------------

def rlm_child(out: str, argv: list[str]) -> int:
    """`rlm train ARGV`, recording the time each step is logged (from the start of the fit loop) and its metrics."""
    from rlmegatron.entry.cli import main
    from rlmegatron.tracking import Tracker

    record: dict = {"steps": []}
    start, log_metrics = Tracker.start, Tracker.log_metrics

    def started(self, step):
        record["startup_s"] = time.perf_counter() - STARTED
        record["loop_start"] = time.perf_counter()
        start(self, step)

    def logged(self, metrics, step):
        record["steps"].append({"step": step, "t": time.perf_counter() - record["loop_start"],
                                **{k: float(v) for k, v in metrics.items()}})
        log_metrics(self, metrics, step)

    Tracker.start, Tracker.log_metrics = started, logged
    load_before = os.getloadavg()[0]
    code = main(["train", *argv])
    record.update(exit_code=code, process_s=time.perf_counter() - STARTED,
                  loadavg_1m_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)])
    Path(out).write_text(json.dumps(record))
    return code


def summarize_rlm(record: dict) -> dict:
    steps = [s for s in record["steps"] if s["step"] >= 1 and REWARD in s]
    rewards, times = [s[REWARD] for s in steps], [s["t"] for s in steps]
    phases = sorted({k for s in steps for k in s if k.startswith("timing_s/")})
    per_step = {k.removeprefix("timing_s/"): statistics.mean(s.get(k, 0.0) for s in steps) for k in phases}
    # What the loop spends outside timing_s/step: the step's metrics, logging, tracing and the checkpoint check.
    per_step["between steps"] = times[-1] / len(steps) - per_step["step"]
    return {
        "steps": len(steps), "wall_s": round(times[-1], 3), "startup_s": round(record["startup_s"], 2),
        "steps_per_s": round(len(steps) / times[-1], 3), "steps_per_s_median": round(1 / median_step_s(times), 3),
        "reward_first": rewards[0], "reach_0.5": first_reach(rewards, times, 0.5),
        "reach_0.8": first_reach(rewards, times),
        "phase_s_per_step": {k: round(v, 4) for k, v in per_step.items()},
        "loadavg_1m_before_after": record["loadavg_1m_before_after"], "process_s": round(record["process_s"], 1),
        "reward_mean_per_step": rewards, "step_wall_s": [round(t, 3) for t in times],
    }


# --- the driver ------------------------------------------------------------------------------------------------

def ensure_task(peer: Path, peer_python: str, task: Path) -> None:
    if not (task / "task.json").is_file():
        made = subprocess.run([peer_python, str(peer / "make_task.py"), str(task)], capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"{peer / 'make_task.py'} failed:\n{made.stderr[-3000:]}")


def check_prompt_ids(task: Path) -> str:
    """rlmegatron's prompt ids for the first rows (data.prompt_format=plain) are what TRL feeds its model:
    tokenizer(text)['input_ids'], the tokenizer's own BOS included once."""
    from transformers import AutoTokenizer

    from rlmegatron.data import PromptEncoder

    tokenizer = AutoTokenizer.from_pretrained(str(task / "tokenizer"))
    encode = PromptEncoder(tokenizer, chat=False)
    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()[:16]]
    for row in rows:
        ours, trl = encode(row["prompt"]), tokenizer(row["prompt"])["input_ids"]
        if ours != trl:
            raise SystemExit(f"prompt ids differ for {row['prompt']!r}: rlmegatron {ours}, TRL {trl}")
    return f"prompt ids identical to TRL's on the first {len(rows)} rows, e.g. {encode(rows[0]['prompt'])}"


def run_trl(args, task: Path, out_dir: Path) -> dict:
    out = out_dir / "trl.json"
    with open(out_dir / "trl.log", "w") as log:
        subprocess.run([args.peer_python, str(args.peer_dir / "run.py"), "--task", str(task), "--steps",
                        str(args.trl_steps), "--seed", str(args.seed), "--json", str(out),
                        "--output-dir", str(out_dir / "trl_scratch")], check=True, stdout=log, stderr=log)
    result = json.loads(out.read_text())
    rewards, times = result["reward_mean_per_step"], result["step_wall_s"]
    return {**{k: result[k] for k in ("steps", "wall_s", "steps_per_s", "steps_per_s_median", "reward_first",
                                      "loadavg_1m_before_after", "config", "versions")},
            "startup_s": result["setup_s"], "reach_0.5": first_reach(rewards, times, 0.5),
            "reach_0.8": first_reach(rewards, times), "reward_mean_per_step": rewards, "step_wall_s": times}


def run_rlm(args, out_dir: Path) -> dict:
    out = out_dir / "rlm.json"
    run_dir = out_dir / "rlm_run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run every time: the spec resumes by default
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(out_dir / "rlm.log", "w") as log:
        subprocess.run([sys.executable, __file__, "--rlm-child", str(out), SPEC,
                        f"trainer.total_steps={args.rlm_steps}", f"trainer.run_dir={run_dir}", *args.overrides],
                       cwd=REPO_ROOT, env=env, check=True, stdout=log, stderr=log)
    return summarize_rlm(json.loads(out.read_text()))


def report(trl: dict, rlm: dict) -> str:
    def reach(side):
        r = side["reach_0.8"]
        return f"{r['wall_s']:.1f} s (step {r['step']})" if r else "not reached"

    lines = ["| | TRL | rlmegatron |", "|---|---:|---:|",
             f"| training wall time to 5-step mean reward {THRESHOLD} | {reach(trl)} | {reach(rlm)} |",
             f"| steps/s (whole run; median step) | {trl['steps_per_s']:.2f}; {trl['steps_per_s_median']:.2f} | "
             f"{rlm['steps_per_s']:.2f}; {rlm['steps_per_s_median']:.2f} |",
             f"| start-up before step 1 | {trl['startup_s']:.1f} s | {rlm['startup_s']:.1f} s |",
             f"| steps run | {trl['steps']} | {rlm['steps']} |",
             f"| load average (1 min) before, after | {trl['loadavg_1m_before_after']} | "
             f"{rlm['loadavg_1m_before_after']} |", "",
             "rlmegatron, mean seconds per step by phase (timing_s/*):", "",
             "| phase | s/step | share of the step |", "|---|---:|---:|"]
    phases = rlm["phase_s_per_step"]
    whole = phases["step"] + phases["between steps"]
    for name, value in sorted(phases.items(), key=lambda kv: -kv[1]):
        if name != "step":
            lines.append(f"| {name} | {value:.4f} | {value / whole:.0%} |")
    lines.append(f"| whole step (timing_s/step + between steps) | {whole:.4f} | 100% |")
    if trl["reach_0.8"] and rlm["reach_0.8"]:
        ratio = rlm["reach_0.8"]["wall_s"] / trl["reach_0.8"]["wall_s"]
        # Steps to the threshold times the median step: what the ratio is without bursts of load from other jobs.
        steady = (rlm["reach_0.8"]["step"] / rlm["steps_per_s_median"]) / (
            trl["reach_0.8"]["step"] / trl["steps_per_s_median"])
        lines += ["", f"ratio (rlmegatron / TRL training wall time to {THRESHOLD}): {ratio:.2f}x",
                  f"the same from steps to {THRESHOLD} x median step time: {steady:.2f}x"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-dir", type=Path,
                        default=Path(os.environ.get("PEER_TRL_DIR", "../shared/peers/trl_grpo")),
                        help="the TRL peer harness (make_task.py, run.py); default $PEER_TRL_DIR or that path")
    parser.add_argument("--peer-python", default=os.path.expanduser("~/.cache/peer-trl/venv/bin/python"),
                        help="the interpreter of the peer's venv (its setup.sh makes it)")
    parser.add_argument("--trl-steps", type=int, default=400, help="TRL's seed 0 reaches 0.8 at step 367")
    parser.add_argument("--rlm-steps", type=int, default=420)
    parser.add_argument("--seed", type=int, default=0, help="TRL's seed (its reward curve is deterministic per seed)")
    parser.add_argument("--out", type=Path, default=Path("runs/peer_trl"))
    parser.add_argument("--only", choices=["trl", "rlm"], help="run one side (its numbers alone, no ratio)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="rlm train overrides for the spec")
    if len(sys.argv) > 1 and sys.argv[1] == "--rlm-child":
        return rlm_child(sys.argv[2], sys.argv[3:])
    args = parser.parse_args()
    if not (args.peer_dir / "run.py").is_file():
        raise SystemExit(f"--peer-dir {args.peer_dir}: no run.py there; point it at the TRL peer harness")
    args.peer_dir = args.peer_dir.resolve()
    os.chdir(REPO_ROOT)
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    task = REPO_ROOT / TASK
    ensure_task(args.peer_dir, args.peer_python, task)
    print(check_prompt_ids(task), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "command": sys.argv}
    if args.only != "rlm":
        print(f"TRL: {args.trl_steps} steps (log: {out_dir / 'trl.log'})", flush=True)
        result["trl"] = run_trl(args, task, out_dir)
    if args.only != "trl":
        print(f"rlmegatron: {args.rlm_steps} steps (log: {out_dir / 'rlm.log'})", flush=True)
        result["rlmegatron"] = run_rlm(args, out_dir)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    if args.only is None:
        print(report(result["trl"], result["rlmegatron"]))
    else:
        side = result["trl" if args.only == "trl" else "rlmegatron"]
        print(json.dumps({k: v for k, v in side.items() if k not in ("reward_mean_per_step", "step_wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
