"""Processes as /proc shows them (Linux): which are alive, and which descend from a process."""
from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state, ppid, ...), or None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running or sleeping: not gone, and not a zombie waiting for a parent to reap it."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def open_files(pid: int) -> set[str]:
    """The paths `pid` holds open (empty once it is gone)."""
    found = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                found.add(str(fd.readlink()))
            except OSError:
                pass
    except OSError:
        pass
    return found
