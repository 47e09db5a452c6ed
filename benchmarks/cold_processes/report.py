"""The census benchmarks/cold_processes/sitecustomize.py took: CPU seconds by kind of process and by test file."""
import ast
import collections
import os
import sys
from pathlib import Path


def kind(command: str) -> str:
    if "default_worker.py" in command:
        return "Ray worker (actors: trainer ranks, job supervisor)"
    if "/ray/" in command or command.startswith(("ray ", f"{Path(sys.executable).parent}/ray")):
        return "Ray daemon (dashboard, agents, log monitor, CLI)"
    if command.startswith("-c"):
        return "python -c (pytest-xdist workers, fork servers)"
    if "local_server" in command:
        return "local rollout server"
    if " train " in f" {command} " or "rlmegatron/__main__" in command:
        return "rlm CLI"
    return command.split(" ", 1)[0].rsplit("/", 1)[-1]


def main() -> None:
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RLM_COLD_DIR", "/tmp/rlm-cold"))
    rows = [line.rstrip("\n").split("\t") for path in directory.iterdir() if not path.name.endswith(".tmp")
            for line in path.read_text().splitlines()[:1]]
    by_kind, count, by_file, megatron = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for _pid, _parent, cpu, first, command, test in rows:
        by_kind[kind(command)] += float(cpu)
        count[kind(command)] += 1
        by_file[test.split("::")[0] or "(outside a test)"] += float(cpu)
        megatron += "megatron.core" in ast.literal_eval(first)
    print(f"{len(rows)} new interpreters, {sum(by_kind.values()):.0f} CPU-s; {megatron} imported megatron.core")
    for name, cpu in by_kind.most_common():
        print(f"{cpu:8.1f} CPU-s {count[name]:5d}  {name}")
    print("by test file:")
    for name, cpu in by_file.most_common(25):
        print(f"{cpu:8.1f} CPU-s  {name}")


if __name__ == "__main__":
    main()
