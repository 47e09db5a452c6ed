"""Runs the GPU harness's parts, each in a process of its own with a time limit, and writes results.json and
results.md into the results directory. Started by benchmarks/gpu/run.sh (which installs the carried wheels first).

Parts:
- actor (benchmarks/gpu/actor.py): the Megatron actor's forward+backward MFU at the largest micro-batch that fits,
  the colocated weight sync of that actor into a second process through CUDA-IPC buckets, and local-engine
  generation in that second process;
- grpo (benchmarks/gpu/grpo.py): the quickstart's GRPO job for a few steps on one rank of the device;
- async (benchmarks/async_modes.py, not in the default set: with the others it would not fit one 10-minute call): the
  quickstart in trainer.mode sync, one_step_off and async, disaggregated, same steps, each mode in a fresh process,
  with one GPU split between the trainer rank (in that process, no Ray) and the local engine (a process of its own).

`--device cpu` is the rehearsal: tiny sizes, CPU shared memory instead of CUDA IPC, no MFU without --peak-tflops.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.async_modes import TARGET_REWARD

REPO = Path(__file__).resolve().parents[2]
TARGETS = {"mfu": 0.40, "sync_vs_device_copy": 0.8}
PARTS = ("actor", "grpo", "async")
DEFAULT_PARTS = ("actor", "grpo")

# Sizes per device. cuda: one H100/H200 within one 10-minute command; cpu: the rehearsal, seconds.
DEFAULTS = {
    "cuda": dict(model="configs/models/qwen2.5-0.5b", prompt_len=1024, response_len=1024, accumulation=2, repeats=3,
                 max_micro_batch=1024, mfu_budget_s=150.0, bucket_mb=None, gen_batch=64, gen_prompt_len=256,
                 gen_new_tokens=256, grpo_steps=20, actor_timeout_s=390, grpo_timeout_s=150,
                 # 150 steps: where the quickstart's 5-step mean reward reached 0.8 on CPU (steps 126-143).
                 async_steps=150, async_timeout_s=480),
    "cpu": dict(model="configs/models/tiny-qwen3", prompt_len=16, response_len=16, accumulation=2, repeats=1,
                max_micro_batch=2, mfu_budget_s=60.0, bucket_mb=1 / 16, gen_batch=4, gen_prompt_len=8,
                gen_new_tokens=8, grpo_steps=2, actor_timeout_s=240, grpo_timeout_s=240, async_steps=2,
                async_timeout_s=240),
}


def spec_bucket_mb() -> float:
    """The spec's default bucket size, the one a colocated run uses unless told otherwise."""
    from rlmegatron.config.spec import RolloutConfig

    return float(RolloutConfig.model_fields["update_weights_bucket_mb"].default)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default=os.environ.get("OUT"),
                        help="where results.json and results.md go (default: $OUT)")
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cuda")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS))
    parser.add_argument("--model", help="directory with an HF config.json (random init)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak, where it is not detected")
    parser.add_argument("--mfu-modes", nargs="+", choices=["packed", "padded"], default=["packed", "padded"])
    for name in ("prompt_len", "response_len", "accumulation", "repeats", "max_micro_batch", "gen_batch",
                 "gen_prompt_len", "gen_new_tokens", "grpo_steps", "actor_timeout_s", "grpo_timeout_s", "async_steps",
                 "async_timeout_s"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    parser.add_argument("--mfu-budget-s", type=float)
    parser.add_argument("--bucket-mb", type=float, help="default: the spec's rollout.update_weights_bucket_mb")
    parser.add_argument("--grpo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a further spec override for the GRPO run (repeatable)")
    args = parser.parse_args(argv)
    if not args.results_dir:
        parser.error("give a results directory (or set OUT)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; --device cpu runs the rehearsal")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, str(REPO / value) if name == "model" else value)
    args.model = str(Path(args.model).resolve())
    if args.bucket_mb is None:
        args.bucket_mb = spec_bucket_mb()
    return args


def run_part(name: str, command: list[str], timeout_s: int, log: Path) -> dict:
    """Runs a part in its own session (so a timeout ends its children too), its output teed to `log`."""
    print(f"== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        deadline = time.monotonic() + timeout_s

        def pump():
            for line in process.stdout:
                handle.write(line)
                handle.flush()
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # timed out, or this process interrupted: the part and its receiver go too
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        reader.join(timeout=10)
    status = {"returncode": process.returncode, "timed_out": timed_out, "wall_s": time.perf_counter() - start,
              "log": log.name}
    print(f"== {name}: exit {process.returncode}{' (timed out)' if timed_out else ''} "
          f"after {status['wall_s']:.0f} s", flush=True)
    return status


def actor_command(args, result: Path) -> list[str]:
    command = [sys.executable, "-m", "benchmarks.gpu.actor", "--device", args.device, "--model", args.model,
               "--dtype", args.dtype, "--result", str(result), "--bucket-mb", str(args.bucket_mb),
               "--mfu-modes", *args.mfu_modes, "--mfu-budget-s", str(args.mfu_budget_s)]
    for name in ("prompt_len", "response_len", "accumulation", "repeats", "max_micro_batch", "gen_batch",
                 "gen_prompt_len", "gen_new_tokens"):
        command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.peak_tflops:
        command += ["--peak-tflops", str(args.peak_tflops)]
    return command


def grpo_command(args, result: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu.grpo", "--device", args.device, "--steps", str(args.grpo_steps),
            "--run-dir", str(run_dir), "--result", str(result), *args.grpo_override]


def async_command(args, result: Path, run_dir: Path) -> list[str]:
    # Sync and async first: a part cut by its time limit keeps the modes it finished, and those two are the comparison.
    return [sys.executable, "-m", "benchmarks.async_modes", "--device", args.device, "--steps", str(args.async_steps),
            "--modes", "sync", "async", "one_step_off", "--out-dir", str(run_dir), "--result", str(result)]


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def verdict(value, target) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= target else "not met"


def g(value: float) -> str:
    """Three significant digits: GPU and CPU rehearsal numbers differ by orders of magnitude."""
    return f"{value:.3g}"


def async_rows(found: dict) -> list[str]:
    """One row per mode of the `async` part; steps/s also as a multiple of sync's."""
    rows = []
    sync = next((row for row in found.get("modes", []) if row["mode"] == "sync" and "error" not in row), None)
    target = f"5-step mean reward >= {TARGET_REWARD}"
    for row in found.get("modes", []):
        where = (f"{row['mode']}, quickstart, disaggregated on one {found['device']} (trainer rank and local engine in "
                 f"two processes, no Ray), {found['steps']} steps")
        if "error" in row:
            rows.append(f"| {where} | failed, {row['error']} (async.log) | {target} | not measured |")
            continue
        versus = f" = {g(row['steps_per_s'] / sync['steps_per_s'])} x sync" if sync and sync is not row else ""
        reached = row["first_step_5_mean_ge_0.8"]
        rows.append(
            f"| {where} | {g(row['steps_per_s'])} steps/s{versus}, median step {g(row['step_s_median'])} s; busy: "
            f"trainer {row['trainer_busy']:.2f}, engine {row['engine_busy']:.2f}; mean reward "
            f"{row['reward_first']:.3f} -> {row['reward_last']:.3f}, 5-step mean >= {TARGET_REWARD} "
            f"{f'from step {reached}' if reached else 'not reached'}; staleness max {row['staleness_max']:g}; "
            f"start-up {row['startup_s']:.0f} s | {target} | {'met' if reached else 'not met'} |")
    return rows


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [f"# GPU harness results ({report['device']})", "",
             f"{report['date']}; {machine.get('device_name', 'device unknown')}; python {machine['python']}, "
             f"torch {machine.get('torch', '?')} (CUDA {machine.get('cuda') or '-'}), megatron-core "
             f"{machine.get('megatron_core', '?')}, transformers {machine.get('transformers', '?')}.",
             f"Command: `{report['command']}`", "",
             "| measure | value | target | verdict |", "|---|---|---|---|"]
    actor = report["parts"].get("actor", {})
    mfu = actor.get("mfu", {})
    mfu_target = f">= {TARGETS['mfu']:.2f}"
    for mode, found in mfu.get("modes", {}).items():
        best = found["largest"]
        if best is None:
            lines.append(f"| actor fwd+bwd MFU, {mode} | nothing fit ({found['search_stopped']}) | {mfu_target} | "
                         "not met |")
            continue
        value = best.get("fwd_bwd_mfu")
        shown = g(value) if value is not None else f"n/a ({mfu['peak_source']})"
        lines.append(
            f"| actor fwd+bwd MFU, {mode}, micro-batch {best['micro_batch']} x {mfu['seq_len']} tokens (largest that "
            f"fit; search stopped: {found['search_stopped']}) | {shown}; {g(best['fwd_bwd_tflops'])} TFLOP/s "
            f"(peak {mfu['peak_tflops'] or 'n/a'}), {g(best['update_tflops'])} with the optimizer step | "
            f"{mfu_target} | {verdict(value, TARGETS['mfu'])} |")
    if "error" in mfu:
        lines.append(f"| actor fwd+bwd MFU | failed (actor.log) | {mfu_target} | not measured |")
    sync = actor.get("sync", {})
    sync_target = f">= {TARGETS['sync_vs_device_copy']:.1f} x a device copy"
    if "gb_per_s" in sync:
        rates = sync["gb_per_s"]
        lines.append(
            f"| colocated weight sync through {sync['bucket_bytes'] / 2**20:g} MB buckets, {g(sync['bytes'] / 1e9)} GB "
            f"| {g(rates['sync'])} GB/s = {g(sync['sync_vs_device_copy'])} x a device copy ({g(rates['device_copy'])} "
            f"GB/s); arrived bitwise: {sync['arrived_bitwise']}, receiver holds them: {sync['receiver_equal_after']} "
            f"| {sync_target} | {verdict(sync['sync_vs_device_copy'], TARGETS['sync_vs_device_copy'])} |")
        lines.append(f"| sync, sender side alone: export / export + buckets | {g(rates['export_only'])} / "
                     f"{g(rates['export_and_bucket'])} GB/s | - | - |")
        parts = ", ".join(f"{name} {g(value * 1e3)} ms" for name, value in sync["receiver_bucket_s"].items())
        lines.append(f"| sync with the receiver keeping the IPC mapping; receiver's time per bucket | "
                     f"{g(rates['sync_receiver_keeps_mapping'])} GB/s; {parts} | - | - |")
    elif sync:
        lines.append(f"| colocated weight sync | failed (actor.log) | {sync_target} | not measured |")
    generate = actor.get("generate", {})
    for mode in ("sampled", "greedy"):
        if mode in generate:
            row = generate[mode]
            lines.append(f"| local-engine generation, {mode}, {row['batch']} prompts x {row['prompt_tokens']} tokens, "
                         f"{row['new_tokens']} new each | {g(row['tokens_per_s'])} new tokens/s | - | - |")
    grpo = report["parts"].get("grpo", {})
    if "steps" in grpo:
        lines.append(f"| GRPO, quickstart, {grpo['steps']} steps, one rank | mean reward {grpo['reward_first']:.3f} -> "
                     f"{grpo['reward_last']:.3f}; median step {g(grpo['step_s_median'])} s; start-up "
                     f"{grpo['startup_s']:.0f} s | - | - |")
    lines += async_rows(report["parts"].get("async", {}))
    for name, status in report["status"].items():
        if status["returncode"] != 0:
            lines.append(f"| part {name} | exit {status['returncode']}{', timed out' if status['timed_out'] else ''} "
                         f"({status['log']}) | - | failed |")
    model = actor.get("model", {})
    if "parameters" in model:
        shown_model = os.path.relpath(model["model"], REPO) if model["model"].startswith(str(REPO)) else model["model"]
        lines += ["", f"Model: `{shown_model}`, {g(model['parameters'] / 1e6)} M parameters, {model['dtype']}, "
                      "random init, local (non-TE) layer spec, TP=PP=1."]
    if mfu.get("modes"):
        lines += ["", f"FLOPs: {mfu['flops_formula']}; N = {g(mfu['matmul_parameters'] / 1e6)} M; "
                      f"{mfu['accumulation']} micro-batches per optimizer step.", "",
                  "| layout | micro-batch | tokens | fwd+bwd s | optimizer s | fwd+bwd TFLOP/s | MFU | peak GB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for mode, found in mfu["modes"].items():
            for trial in found["trials"]:
                if trial.get("oom"):
                    lines.append(f"| {mode} | {trial['micro_batch']} | - | out of memory | | | | |")
                    continue
                mfu_value, peak_gb = trial.get("fwd_bwd_mfu"), trial.get("peak_memory_gb")
                lines.append(f"| {mode} | {trial['micro_batch']} | {trial['tokens_per_micro_batch']} | "
                             f"{g(trial['fwd_bwd_s'])} | {g(trial['optimizer_s'])} | {g(trial['fwd_bwd_tflops'])} | "
                             f"{'n/a' if mfu_value is None else g(mfu_value)} | "
                             f"{'-' if peak_gb is None else f'{peak_gb:.1f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.results_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    report = {"device": args.device, "date": now.strftime("%Y-%m-%d %H:%M UTC"),
              "command": "benchmarks/gpu/run.sh " + " ".join(argv), "targets": TARGETS,
              "settings": {k: v for k, v in vars(args).items() if k != "results_dir"},
              "machine": {"python": platform.python_version(), "platform": platform.platform()},
              "parts": {}, "status": {}}
    if "actor" in args.parts:
        result = out / "actor.json"
        report["status"]["actor"] = run_part("actor", actor_command(args, result), args.actor_timeout_s,
                                             out / "actor.log")
        report["parts"]["actor"] = load(result)
        report["machine"].update(report["parts"]["actor"].pop("machine", {}))
    for part, command in (("grpo", grpo_command), ("async", async_command)):
        if part not in args.parts:
            continue
        result = out / f"{part}.json"
        # Its run directories (logs, the final HF export) stay out of the results: the device tool returns 8 files.
        with tempfile.TemporaryDirectory(prefix=f"rlm-gpu-{part}-") as run_dir:
            report["status"][part] = run_part(part, command(args, result, Path(run_dir)),
                                              getattr(args, f"{part}_timeout_s"), out / f"{part}.log")
        report["parts"][part] = load(result)
    if "device_name" not in report["machine"]:  # the actor part, which says it, did not run (or failed early)
        from benchmarks.gpu.actor import machine_info

        report["machine"].update(machine_info(args.device))
    (out / "results.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "results.md").write_text(table)
    print("\n" + table, flush=True)
    return 0 if all(status["returncode"] == 0 for status in report["status"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
