"""The CPU time of every process a command starts, grouped by kind (ranks, fork servers, Ray, SGLang servers, ...):
where a CPU-bound run such as the suite spends, which per-test figures (benchmarks/suite_cpu.py) do not say.

    python benchmarks/process_cpu.py [--out FILE.json] -- COMMAND...    # e.g. -- .venv/bin/python -m pytest -q -n 2

It runs COMMAND, reads /proc every 0.5 s meanwhile (each process's utime + stime, its command line and its parent's),
and prints a table by kind once COMMAND ends. A process that lives under half a second is missed, and each is
counted as of its last reading; processes that were running before COMMAND started are left out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
INTERVAL_S = 0.5


def _read(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()


def sample(seen: dict, skip: set[str]) -> None:
    """One reading of /proc into `seen` (key "pid:starttime", so a reused pid is another process)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = _read(f"/proc/{pid}/stat")
            fields = stat[stat.rfind(")") + 2:].split()
            key = f"{pid}:{fields[19]}"
            if key in skip:
                continue
            entry = seen.get(key)
            if entry is None:
                parent = fields[1]
                try:
                    parent_command = _read(f"/proc/{parent}/cmdline")
                except OSError:
                    parent_command = ""
                entry = seen[key] = {"parent_command": parent_command[:200]}
            # Re-read: Ray renames its workers once they run. A process that has ended (a zombie) reads empty.
            entry["command"] = _read(f"/proc/{pid}/cmdline")[:300] or entry.get("command", "")
            entry["cpu_s"] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, ValueError):
            pass  # it ended between the listing and the read


def kind(entry: dict) -> str:
    command, parent = entry["command"], entry["parent_command"]
    if "multiprocessing.forkserver import main" in command:
        return ("forked from a fork server (ranks, warm runs)" if "multiprocessing.forkserver import main" in parent
                else "fork server (its preload)")
    if command.startswith("ray::"):
        return f"Ray worker {command.split()[0]}"
    for daemon in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "default_worker"):
        if daemon in command:
            return f"Ray {daemon}"
    for part, name in (("sglang.launch_server", "SGLang server"), ("sglang_router", "SGLang router"),
                       ("local_server", "local engine server"), ("rlmegatron.supervision.lifeline", "lifeline"),
                       ("rlmegatron.supervision.reaper", "reaper"), ("pytest", "pytest and its workers"),
                       ("benchmarks", "benchmark children")):
        if part in command:
            return name
    if re.search(r"bin/rlm |-m rlmegatron ", command):
        return "cold rlm"
    return "other: " + (command.split(" ", 1)[0].rsplit("/", 1)[-1] or "?")


def table(seen: dict) -> str:
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for entry in seen.values():
        group = groups[kind(entry)]
        group[0] += 1
        group[1] += entry["cpu_s"]
    lines = [f"{sum(g[1] for g in groups.values()):.0f} CPU-s in {len(seen)} processes",
             "| kind | processes | CPU-s |", "|---|---:|---:|"]
    lines += [f"| {name} | {count} | {cpu:.1f} |" for name, (count, cpu) in
              sorted(groups.items(), key=lambda item: -item[1][1])]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write every process's record here, as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    before: dict = {}
    sample(before, set())
    seen: dict = {}
    running_before = set(before)
    process = subprocess.Popen(command)
    while process.poll() is None:
        sample(seen, running_before)
        time.sleep(INTERVAL_S)
    if args.out:
        args.out.write_text(json.dumps(seen, indent=1))
    print(table(seen))
    return process.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
