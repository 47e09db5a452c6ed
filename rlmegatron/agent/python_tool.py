"""The built-in `python` tool: runs the model's code in a sandboxed subprocess and answers with what it printed.

The child is a fresh interpreter (`-I -S`: no site, no user paths, no environment beyond a minimal PATH) in a fresh
temporary directory that is removed afterwards, in its own session so the wall limit kills everything it started.
Before the model's code runs it lowers its own limits: CPU seconds, address space, file size (its stdout and stderr go
to files in that directory, so a huge print ends at `max_output_bytes`), open files, and processes; as root it also
becomes `nobody`, so the process limit binds and the file system is the world's view (an interpreter installed
under root's home is then unreadable to it: the usual modules of a calculation, math, fractions, decimal,
statistics, itertools, collections, json, re and a few more, are imported before the switch). An audit hook refuses what a
sandboxed snippet has no business doing: new processes (fork, exec, spawn, subprocess), sockets, and ctypes.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

RUNNER = r"""
import os, resource, sys
cpu_s, memory_bytes, output_bytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU first, SIGKILL a second later
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if os.getuid() == 0:
    # nobody may not read root's interpreter tree: the usual modules of a calculation are imported before.
    import bisect, collections, datetime, decimal, fractions, functools, heapq, itertools, json, math, random, re
    import statistics, string
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
code = open("snippet.py").read()
REFUSED = ("os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system", "os.kill", "os.killpg",
           "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
           "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "sys.addaudithook")
def audit(event, args):
    if event in REFUSED or (event == "import" and args[0] in ("_posixsubprocess", "_ctypes", "ctypes")):
        raise PermissionError(f"the python tool does not allow {event} {args[0] if event == 'import' else ''}")
sys.addaudithook(audit)
del os, resource
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


class PythonTool:
    """Runs a Python snippet; its answer is what the snippet printed (stdout, then stderr), cut to
    `max_output_bytes`, with a note when a limit ended it."""

    schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python 3 snippet and return what it prints. Print the values you need.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code"}},
                       "required": ["code"]},
    }}

    def __init__(self, cpu_s: int = 5, memory_mb: int = 512, wall_s: float = 10.0, max_output_bytes: int = 4096):
        if cpu_s < 1 or memory_mb < 32 or wall_s <= 0 or max_output_bytes < 1:
            raise ValueError("python tool limits: cpu_s >= 1, memory_mb >= 32, wall_s > 0, max_output_bytes >= 1")
        self.cpu_s, self.memory_bytes, self.wall_s = cpu_s, memory_mb << 20, wall_s
        self.max_output_bytes = max_output_bytes

    async def execute(self, args: dict[str, Any], context: Any) -> tuple[str, float, dict[str, float]]:
        code = args.get("code")
        if not isinstance(code, str):
            return 'Error: call python with {"code": "<python source>"}', 0.0, {"python/errors": 1.0}
        workdir = tempfile.mkdtemp(prefix="rlm_python_tool_")
        try:
            return await self._run(code, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run(self, code: str, workdir: str) -> tuple[str, float, dict[str, float]]:
        with open(os.path.join(workdir, "snippet.py"), "w") as snippet:
            snippet.write(code)
        os.chmod(workdir, 0o777)  # the child may run as nobody
        with open(os.path.join(workdir, "stdout"), "wb") as out, open(os.path.join(workdir, "stderr"), "wb") as err:
            os.chmod(out.name, 0o666)
            os.chmod(err.name, 0o666)
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", RUNNER, str(self.cpu_s), str(self.memory_bytes),
                str(self.max_output_bytes), cwd=workdir, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}, start_new_session=True)
            try:
                await asyncio.wait_for(process.wait(), self.wall_s)
                wall_limit = False
            except asyncio.TimeoutError:
                wall_limit = True
            finally:
                # Whatever the snippet left behind in its session goes with it.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        stdout, stderr = (_head(os.path.join(workdir, name), self.max_output_bytes) for name in ("stdout", "stderr"))
        text = (stdout + ("\n" + stderr if stderr else "")).strip()
        limit = (f"wall time limit of {self.wall_s:g} s" if wall_limit else
                 f"CPU time limit of {self.cpu_s} s" if process.returncode == -signal.SIGXCPU else
                 f"output limit of {self.max_output_bytes} bytes" if process.returncode == -signal.SIGXFSZ else None)
        if limit:
            text += f"\n[stopped: the {limit}]"
        metrics = {"python/limit_hits": float(limit is not None), "python/errors": float(process.returncode != 0)}
        return text, 0.0, metrics


def _head(path: str, limit: int) -> str:
    with open(path, "rb") as file:
        return file.read(limit).decode(errors="replace")

