"""Whether a checkpoint is whole: its manifest (every file and its size, written last) on the driver, and on the
ranks, when a load fails all the same, the file it failed in."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"


class CheckpointLoadFailed(Exception):
    """A rank could not load a checkpoint whose manifest is intact (a file damaged in place, its size unchanged).
    The message starts with the file the reader failed in, where it was in one, else the checkpoint directory."""


class _UnreadableFile(Exception):
    """One file's read failed; travels inside torch's CheckpointException, so its one argument is the message."""


def write_manifest(directory: Path, step: int) -> None:
    """List every file under `directory` with its size; called once everything else is written, and atomic, so a
    checkpoint with a manifest is one whose every file was complete."""
    files = {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}
    staging = directory / f".{MANIFEST}.tmp"
    with open(staging, "w") as handle:
        json.dump({"step": step, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, directory / MANIFEST)


def manifest_problem(directory: Path) -> Optional[str]:
    """Why `directory` is not a complete checkpoint, or None. Sizes only, not hashes: a stat per file costs
    microseconds, where reading a multi-GB checkpoint back costs minutes on every start; a file damaged in place
    with its size intact fails the load itself, which then falls back (CheckpointManager.load_resume_point)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (its save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
        problems = [_file_problem(directory / name, name, int(size)) for name, size in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{MANIFEST} is unreadable ({type(error).__name__}: {error})"
    problems = [problem for problem in problems if problem]
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more files)" if len(problems) > 1 else "")


def _file_problem(path: Path, name: str, size: int) -> Optional[str]:
    if not path.is_file():
        return f"{name} is missing"
    actual = path.stat().st_size
    return None if actual == size else f"{name} has {actual} bytes, its manifest says {size}"


@contextmanager
def load_failures_named(path: str):
    """Turn any failure of a rank's load of checkpoint `path` into one CheckpointLoadFailed naming the file.
    torch's dist-checkpoint reader fails on a damaged shard with the decoder's error (an EOFError, an unpickling
    error) and no file name, gathered from every rank into one CheckpointException; so while this load runs, each
    file it reads is wrapped to say which it was (the rank's gathered exceptions keep their messages only)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystem

    opened = FileSystem.create_stream

    @contextmanager
    def create_stream(self, file, mode):
        with opened(self, file, mode) as stream:
            try:
                yield stream
            except Exception as error:
                raise _UnreadableFile(f"{file}: {_brief(error)}") from error

    FileSystem.create_stream = create_stream
    try:
        yield
    except CheckpointException as error:  # a BaseException: `except Exception` would let it through
        failures = [failure for failure, _ in error.failures.values()]
        named = [str(failure) for failure in failures if isinstance(failure, _UnreadableFile)]
        raise CheckpointLoadFailed(named[0] if named else f"{path}: {_brief(failures[0])}") from None
    except Exception as error:
        raise CheckpointLoadFailed(str(error) if isinstance(error, _UnreadableFile) else f"{path}: {_brief(error)}") \
            from error
    finally:
        FileSystem.create_stream = opened


def _brief(error: BaseException) -> str:
    """The error's type and first sentence: torch's unpickling errors go on for a paragraph."""
    lines = str(error).strip().splitlines()
    first = (lines[0] if lines else "").split(". ")[0]
    return f"{type(error).__name__}: {first[:200]}"
