"""A census of the new interpreters a command starts: `PYTHONPATH=benchmarks/cold_processes COMMAND` (a test run, `rlm
train`, a Ray job), then `python benchmarks/cold_processes/report.py`.

Python imports `sitecustomize` at start-up from its path, so every new interpreter of the command (not a process forked
from one, which starts warm) writes, once a second, one line to $RLM_COLD_DIR (default /tmp/rlm-cold/): its pid, parent,
CPU seconds so far, the CPU second at which torch, megatron.core, transformers, ray and rlmegatron first appear in
sys.modules, its command line and the pytest test it runs under (PYTEST_CURRENT_TEST, inherited from the test). A
process that replaces PYTHONPATH (the loopback SGLang server's tests do) is not counted.
"""
import os
import sys
import threading
import time

_DIR = os.environ.get("RLM_COLD_DIR", "/tmp/rlm-cold")
_WATCHED = ("torch", "megatron.core", "transformers", "ray", "rlmegatron")


def _record(path: str) -> None:
    first: dict = {}
    while True:
        try:
            times = os.times()
            cpu = times.user + times.system
            for name in _WATCHED:
                if name not in first and name in sys.modules:
                    first[name] = round(cpu, 1)
            with open(path + ".tmp", "w") as out:
                out.write("\t".join([str(os.getpid()), str(os.getppid()), f"{cpu:.2f}", repr(first),
                                     " ".join(sys.argv)[:300], os.environ.get("PYTEST_CURRENT_TEST", "")]) + "\n")
            os.replace(path + ".tmp", path)
        except OSError:
            pass
        time.sleep(1)


try:
    os.makedirs(_DIR, exist_ok=True)
    # pid and start time: a long run wraps the pid space.
    threading.Thread(target=_record, args=(f"{_DIR}/{os.getpid()}-{time.time_ns()}",), daemon=True).start()
except OSError:
    pass
