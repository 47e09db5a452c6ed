"""Imported by the fork server only (the last of its preloads): when it leaves, it leaves at once.

The fork server ends when its driver does (multiprocessing's serving loop raises SystemExit once the driver's end of
its pipe closes, a SIGKILL of the driver included). Python's ordinary exit would then run the finalizers of torch,
Megatron-Core and transformers and collect a heap of their objects: on a loaded machine that took the server more than
ten seconds after its driver was gone (tests/driver/test_sigkill.py). It holds nothing to save or close: the ranks it
forked are processes of their own, and it writes nothing but what is already flushed below."""
import atexit
import os
import sys


_SERVER = os.getpid()


def _leave_now() -> None:
    if os.getpid() != _SERVER:  # a process forked from the server that exits the ordinary way keeps its exit code
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


# Registered after every other preload's handler, so it runs first (atexit runs last-in first-out). The ranks this
# server forks leave by os._exit (multiprocessing's children do); a child that ran it anyway is let be (above).
atexit.register(_leave_now)
