"""Commands of this repository (`rlm train ...`, `python -m tests.driver.jobs ...`, `python -c SCRIPT ...`) run as
fresh processes forked from the suite's fork server instead of new interpreters: `run` for subprocess.run, `popen`
for subprocess.Popen.

Why: a new interpreter that runs `rlm train` imports the driver's libraries (torch, transformers for the tokenizer,
MLflow, matplotlib, rlmegatron's driver) and starts its own fork server, which imports torch, Megatron-Core and
transformers again: tens of CPU-seconds before the job's first step, and the suite runs dozens of such jobs. The
suite's fork server (transport/fork_server.py; tests/conftest.py adds the driver's modules to what it imports) has
done all of that once. A process forked from it is a fresh process that ran nothing, as a new interpreter is, and
its ranks come from the same fork server, as run_ranks' do.

What still differs from a new interpreter, and why it does not matter to the tests that use this:
- Modules are imported already, with the environment the fork server started with. The child's environment is the
  command's (os.environ), which is what the driver and the ranks read (run_ranks' ranks take the caller's environment
  as it is when they start); PYTHONPATH's directories are put on sys.path as the interpreter would.
- The process is a child of the fork server, not of the test: the test waits on it through the fork server.
- /proc/PID/environ of the process and of its ranks shows the fork server's environment, not the command's: a mark
  put in the command's environment (test_train.processes_of_run) finds only what they start as new processes (Ray's
  daemons and actors, SGLang servers).
Tests whose subject is the process itself (a SIGKILLed driver, Ctrl-C during imports, what outlives a run, exit
without a traceback from a fresh import) keep subprocess.
"""
from __future__ import annotations

import atexit
import contextlib
import operator
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver
from pathlib import Path
from typing import IO, Any, Sequence

from rlmegatron.transport.fork_server import fork_server

# What a driver imports beyond the ranks' modules: tests/conftest.py has the suite's fork server import these.
DRIVER_MODULES = ("rlmegatron.entry.cli", "rlmegatron.driver.job", "rlmegatron.rank.policy_rank",
                  "rlmegatron.tracking.tracker", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
                  "matplotlib.backends.backend_agg", "transformers.models.auto.tokenization_auto")


def run(cmd: Sequence[str], *, cwd: str | Path, env: dict[str, str] | None = None, timeout: float | None = None,
        capture_output: bool = False, text: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, ...) for a command of this repository, forked warm (see the module's docstring)."""
    with contextlib.ExitStack() as files:
        out, err = ([files.enter_context(tempfile.TemporaryFile()) for _ in range(2)] if capture_output
                    else [None, None])
        process = popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            returncode = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        captured: list[bytes | str | None] = [None, None]
        if capture_output:
            for index, stream in enumerate((out, err)):
                stream.seek(0)
                captured[index] = stream.read().decode() if text else stream.read()
    return subprocess.CompletedProcess(list(cmd), returncode, *captured)


class WarmProcess:
    """The parts of subprocess.Popen the tests use, for a process forked from the fork server."""

    def __init__(self, cmd: Sequence[str], process: Any, stdout: IO | None, stderr: IO | None):
        self.args = list(cmd)
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None
        self.stdout, self.stderr = stdout, stderr  # the read ends of subprocess.PIPE, as text

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "WarmProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(cmd: Sequence[str], *, cwd: str | Path, env: dict[str, str] | None = None,
          stdout: IO | int | None = None, stderr: IO | int | None = None) -> WarmProcess:
    """subprocess.Popen(cmd, ...) for a command of this repository, forked warm. stdout and stderr: None (this
    process's), subprocess.DEVNULL, subprocess.PIPE (read as text), or an open file."""
    context = fork_server()
    pipes: list[tuple[int, int] | None] = [os.pipe() if stream == subprocess.PIPE else None for stream in (stdout, stderr)]
    streams = [_fd(stream, default, pipe) for stream, default, pipe in zip((stdout, stderr), (1, 2), pipes)]
    process = context.Process(target=_main, args=(list(cmd), str(cwd), dict(os.environ if env is None else env),
                                                  forkserver._forkserver._forkserver_address),
                              kwargs={"stdout": streams[0], "stderr": streams[1]})
    try:
        process.start()
    finally:
        for pipe in pipes:
            if pipe is not None:
                os.close(pipe[1])  # the child has its own copy: reading ends at its exit
    readers = [None if pipe is None else open(pipe[0]) for pipe in pipes]
    return WarmProcess(cmd, process, *readers)


def _fd(stream: IO | int | None, default: int, pipe: tuple[int, int] | None) -> Any:
    """What the child's fd 1 or 2 becomes: None for /dev/null, else a file descriptor handed over with the process."""
    if stream == subprocess.DEVNULL:
        return None
    if pipe is not None:
        return _Passed(pipe[1])
    return _Passed(default if stream is None else stream.fileno())


class _Passed:
    """A file descriptor of this process that reaches the forked child as its own: multiprocessing sends those that
    are pickled while the process starts along with it (reduction.DupFd). Unpickled by the standard library alone:
    a rank's sys.path may not reach this module."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return operator.methodcaller("detach"), (DupFd(self.fd),)


def _main(cmd: list[str], cwd: str, env: dict[str, str], fork_server_address: Any, stdout: Any, stderr: Any) -> None:
    """The child: become `cmd` as a new interpreter would, run it, and exit with its code."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    for target, stream in ((1, stdout), (2, stderr)):
        os.dup2(null if stream is None else stream, target)
    # A new interpreter's signal dispositions (the fork server ignores SIGINT and its children inherit that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _share_the_fork_server(fork_server_address)
    _exit_as_a_new_interpreter()

    target, argv, path0 = _interpret(cmd)
    sys.argv = argv
    sys.path[:] = [path0, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
                   *(entry for entry in sys.path if entry not in ("", cwd))]
    code: Any = 0
    try:
        target()
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, then exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # What an interpreter does at exit: wait for its non-daemon threads, run the atexit functions, flush.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _exit_as_a_new_interpreter() -> None:
    """At exit, run what this process registers, not what the fork server's imports did: those clean up the server's
    own resources (wandb's media directory, made at its import, is a temporary directory the server's children would
    all share: the first child to exit would delete it under the others). What a new interpreter's exit does that
    matters here is put back: logging's flush, and multiprocessing's joining of its children."""
    import logging
    import weakref
    from multiprocessing import util

    atexit._clear()
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]
    atexit.register(logging.shutdown)
    atexit.register(util._exit_function)


def _share_the_fork_server(address: Any) -> None:
    """The processes this one starts from a fork server (its ranks) come from the one it was forked from, as
    run_ranks' do, instead of a fork server of its own (whose imports cost as much as this module saves), and write to
    this process's stdout and stderr, as they would inherit them from a fork server of its own.

    multiprocessing only knows a fork server that the process itself started: give it that one's address, and no
    check of a pid that is not its child (the server lives as long as any of its clients, this one included: it
    holds the server's alive fd)."""
    from multiprocessing.context import ForkServerProcess

    server = forkserver._forkserver
    server._forkserver_address = address
    server.ensure_running = lambda: None  # connect_to_new_process calls it on the instance
    forkserver.ensure_running = server.ensure_running  # fork_server() calls the module's
    start = ForkServerProcess._Popen

    def with_this_stdio(process_obj):
        process_obj._warm_stdio = _Stdio()  # pickled with the process, so unpickled in the child before it runs
        return start(process_obj)

    ForkServerProcess._Popen = staticmethod(with_this_stdio)


class _Stdio:
    """This process's stdout and stderr, made the child's fds 1 and 2 as the child unpickles its process object."""

    def __reduce__(self):
        return tuple, ([_Dup2(1), _Dup2(2)],)


class _Dup2:
    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return os.dup2, (_Passed(self.fd), self.fd)


def _interpret(cmd: list[str]) -> tuple[Any, list[str], str]:
    """(run it, sys.argv, sys.path[0]) for `python [-B] [-W ...] (-m MODULE | -c CODE | SCRIPT) ARGS` or a script with
    a Python shebang (a console script such as `rlm`)."""
    program, *rest = cmd
    if Path(program).resolve() != Path(sys.executable).resolve():
        return (lambda: runpy.run_path(program, run_name="__main__")), cmd, str(Path(program).resolve().parent)
    while rest and rest[0] in ("-B", "-u") or rest and rest[0].startswith("-W"):
        rest = rest[2:] if rest[0] == "-W" else rest[1:]
    if rest[0] == "-m":
        module, *args = rest[1:]
        return (lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)), [module, *args], os.getcwd()
    if rest[0] == "-c":
        code, *args = rest[1:]
        return (lambda: exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})), ["-c", *args], ""
    script, *args = rest
    return (lambda: runpy.run_path(script, run_name="__main__")), [script, *args], str(Path(script).resolve().parent)
