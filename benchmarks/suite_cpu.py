"""The CPU time of each test of a parallel suite run, every process it started included (ranks, fork servers' children,
servers, Ray's daemons): what to cut when the suite is CPU-bound, as it is on 2 cores.

    python -m pytest -q -n 2 -p benchmarks.suite_cpu        # writes runs/suite_cpu/<worker>.json ($RLM_SUITE_CPU_DIR)
    python -m benchmarks.suite_cpu [DIR] [--tests N]          # the files, then the N costliest tests

Each pytest-xdist worker moves itself into a cgroup of its own (cgroup v1 cpuacct, as root), so everything it starts
is counted there, whichever process reaps it; a test's CPU is that group's usage over its setup, call and teardown.
Wall-clock durations (`--durations`) on a loaded machine count the other worker's load too; these do not. The host's
steal is in the counter all the same (benchmarks/RESULTS.md), so compare runs back to back.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_state: dict = {}


def _out_dir() -> Path:
    return Path(os.environ.get("RLM_SUITE_CPU_DIR", "runs/suite_cpu"))


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:  # the controller runs no test
        if not os.access(CPUACCT, os.W_OK):
            raise pytest.UsageError(f"benchmarks.suite_cpu: {CPUACCT} is not writable; it needs root and cgroup v1's "
                                    "cpuacct")
        if not config.pluginmanager.hasplugin("xdist") or not config.getoption("numprocesses", None):
            raise pytest.UsageError("benchmarks.suite_cpu: run with -n N (it counts each xdist worker's cgroup)")
        return
    group = CPUACCT / f"rlm_suite_cpu_{os.getppid()}_{worker}"
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    _state.update(group=group, worker=worker, tests=[])


def _usage_s() -> float:
    return int((_state["group"] / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    if "group" not in _state:
        yield
        return
    cpu, wall = _usage_s(), time.monotonic()
    yield
    _state["tests"].append({"test": item.nodeid, "cpu_s": round(_usage_s() - cpu, 2),
                            "wall_s": round(time.monotonic() - wall, 2)})


def pytest_unconfigure(config: pytest.Config) -> None:
    if "group" in _state:
        out = _out_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{_state['worker']}.json").write_text(json.dumps(_state["tests"], indent=0))
        # Back to the root group, and the worker's group removed; it stays only while a process the suite left
        # behind is still in it.
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        try:
            _state["group"].rmdir()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="per-file and per-test CPU of a run with -p benchmarks.suite_cpu")
    parser.add_argument("dir", nargs="?", type=Path, default=_out_dir())
    parser.add_argument("--files", type=int, default=30)
    parser.add_argument("--tests", type=int, default=20)
    args = parser.parse_args(argv)
    tests = [test for path in sorted(args.dir.glob("*.json")) for test in json.loads(path.read_text())]
    cpu, wall = collections.Counter(), collections.Counter()
    for test in tests:
        name = test["test"].split("::")[0]
        cpu[name] += test["cpu_s"]
        wall[name] += test["wall_s"]
    print(f"{len(tests)} tests, {sum(cpu.values()):.0f} CPU-s, {sum(wall.values()):.0f} worker-s")
    print("| file | CPU-s | worker-s |\n|---|---:|---:|")
    for name, seconds in cpu.most_common(args.files):
        print(f"| {name} | {seconds:.1f} | {wall[name]:.1f} |")
    print("\n| test | CPU-s | worker-s |\n|---|---:|---:|")
    for test in sorted(tests, key=lambda t: -t["cpu_s"])[: args.tests]:
        print(f"| {test['test']} | {test['cpu_s']:.1f} | {test['wall_s']:.1f} |")


if __name__ == "__main__":
    main()
