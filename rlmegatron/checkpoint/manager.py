"""Driver side of checkpoints: run_dir/checkpoints/step_N, complete once its manifest is in; which one a run resumes
from; pruning. A complete checkpoint is never overwritten, and one that is not is never silently skipped."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from rlmegatron.checkpoint.integrity import CheckpointLoadFailed, manifest_problem, write_manifest
from rlmegatron.errors import UserError
from rlmegatron.checkpoint.run_dir import no_space_left

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
SET_ASIDE = ".invalid"
"""Suffix of a checkpoint that is not usable, renamed out of the way of the steps a run writes; never deleted."""
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(UserError):
    """A checkpoint problem that is the user's to fix (none usable, a bad trainer.resume path, a run_dir that already
    holds what a run would overwrite): `rlm train` prints the message, one line per problem, and exits 2."""


class CheckpointedRanks(Protocol):
    """The trainer ranks as a checkpoint needs them (driver.trainer_client.TrainerClient): each writes or reads its
    share of the checkpoint directory."""

    def save_checkpoint(self, path: str) -> None:
        ...

    def load_checkpoint(self, path: str) -> None:
        ...


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CheckpointManager:
    """Each checkpoint is written into a staging directory; its manifest (every file and its size) is written last,
    then the directory is renamed into place and named in `latest`, so a run killed mid-save leaves no step_N that
    claims to be complete. Resuming trusts the manifests, not `latest`, which is kept for people and tools."""

    def __init__(self, run_dir: str | Path, max_to_keep: Optional[int] = None,
                 warn: Callable[[str], None] = _warn) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.max_to_keep = max_to_keep
        self.warn = warn
        self.resume_setting: Optional[str] = None
        self.candidates: list[Checkpoint] = []
        self.broken: list[tuple[str, str]] = []
        """(name, why) of every step_N that is not complete, and of a `latest` that names none."""

    def save(self, step: int, ranks: CheckpointedRanks, trainer_state: dict[str, Any]) -> str:
        final = self.root / f"step_{step}"
        if final.exists():
            # plan_resume leaves no step_N at or after the resumed step, so only another writer can have put it here.
            raise CheckpointError(f"{final} already exists; not overwriting it. Is another run writing to "
                                  f"trainer.run_dir={self.root.parent}? Give this one its own run_dir")
        staging = self.root / f".tmp_step_{step}"
        shutil.rmtree(staging, ignore_errors=True)  # a save that was killed: never a checkpoint (no manifest)
        try:
            staging.mkdir(parents=True)
            ranks.save_checkpoint(str(staging))
            (staging / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
            write_manifest(staging, step)
            os.rename(staging, final)
        except BaseException as error:
            # Looked at while what the save wrote still fills the disk; the ranks' errors may not say it (and torch's
            # CheckpointException is a BaseException).
            full = not isinstance(error, (KeyboardInterrupt, SystemExit)) and no_space_left(self.root)
            # A save that failed (a full disk, a rank that died) leaves nothing: what it wrote is no checkpoint, and
            # on a full disk it holds the space the next save needs.
            shutil.rmtree(staging, ignore_errors=True)
            if full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(final)) from error
            raise
        self._mark_latest(final.name)
        self._prune()
        return str(final)

    def checkpoints(self) -> list[tuple[Checkpoint, Optional[str]]]:
        """Every step_N directory, newest first, with why it is not complete (None when it is)."""
        found = []
        if self.root.is_dir():
            for path in self.root.iterdir():
                match = _STEP_DIR.fullmatch(path.name)
                if match and path.is_dir():
                    found.append((Checkpoint(int(match[1]), path), manifest_problem(path)))
        return sorted(found, key=lambda item: -item[0].step)

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint."""
        return next((checkpoint.path for checkpoint, problem in self.checkpoints() if problem is None), None)

    # --- resume: plan_resume before any worker starts, load_resume_point once the ranks are up ---

    def plan_resume(self, resume: str) -> Optional[Checkpoint]:
        """What trainer.resume (`auto`, `disable` or a checkpoint path) may load, newest first; returns the newest
        (None: a fresh start). Names every checkpoint that is not complete. Raises CheckpointError where starting
        would lose data or ignore the user: checkpoints exist but none is complete (auto), a complete one exists
        (disable), the path is not a complete checkpoint or newer complete ones are in run_dir (a path)."""
        found = self.checkpoints()
        complete = [checkpoint for checkpoint, problem in found if problem is None]
        self.broken = [(checkpoint.path.name, problem) for checkpoint, problem in found if problem is not None]
        marker = self.root / LATEST
        if marker.is_file() and not (self.root / marker.read_text().strip()).is_dir():
            self.broken.append((LATEST, f"names {marker.read_text().strip()!r}, which does not exist"))
        self.resume_setting = resume
        if resume == "disable":
            if complete:
                raise CheckpointError(
                    f"trainer.resume=disable, but {self.root} holds complete checkpoints "
                    f"({_names(complete)}) that a fresh start would overwrite; give a new trainer.run_dir to start "
                    f"fresh, or trainer.resume=auto to continue from {complete[0].path.name}")
            self.candidates = []
        elif resume == "auto":
            if self.broken and not complete:
                raise CheckpointError(self._none_usable(self.broken))
            self.candidates = complete
        else:
            path = Path(resume)
            problem = manifest_problem(path) if path.is_dir() else "not a directory"
            if problem:
                raise CheckpointError(f"trainer.resume={resume}: not a complete checkpoint: {problem}; "
                                      f"name a checkpoint directory (step_N), or use trainer.resume=auto")
            try:
                step = int(_trainer_state(path)["step"])
            except CheckpointLoadFailed as error:
                raise CheckpointError(f"trainer.resume={resume}: {error}") from None
            newer = [c for c in complete if c.step > step and c.path.resolve() != path.resolve()]
            if newer:
                raise CheckpointError(
                    f"trainer.resume={resume} is step {step}, but {self.root} holds newer complete checkpoints "
                    f"({_names(newer)}) that resuming here would overwrite; give a new trainer.run_dir, or use "
                    f"trainer.resume=auto to continue from {newer[0].path.name}")
            self.candidates = [Checkpoint(step, path)]
        for name, problem in self.broken:
            self.warn(f"checkpoint {self.root / name}: {problem}; skipped")
        return self.candidates[0] if self.candidates else None

    def load_resume_point(self, ranks: CheckpointedRanks) -> Optional[tuple[Path, dict[str, Any]]]:
        """Load the newest planned checkpoint that every rank can load; returns its path and trainer state (None:
        a fresh start). One whose load fails all the same (a file damaged in place, its size intact) is named and
        passed over for the next, unless the user named it: every rank then loads the next one whole, model,
        optimizer and RNG, so nothing of the failed load survives. Checkpoints passed over are renamed to
        step_N.invalid (kept, out of the way of the steps this run writes)."""
        assert self.resume_setting is not None, "plan_resume comes first"
        failed: list[tuple[Checkpoint, str]] = []
        for checkpoint in self.candidates:
            try:
                state = _trainer_state(checkpoint.path)
                ranks.load_checkpoint(str(checkpoint.path))
            except CheckpointLoadFailed as error:
                cause = str(getattr(error, "cause", error))  # the rank's own message, without Ray's traceback
                reason = "does not load: " + cause.replace(f"{checkpoint.path}{os.sep}", "")
                if self.resume_setting not in ("auto", "disable"):
                    raise CheckpointError(f"trainer.resume={self.resume_setting}: {reason}; name another "
                                          f"checkpoint, or use trainer.resume=auto") from None
                self.warn(f"checkpoint {checkpoint.path}: {reason}; falling back to the one before it")
                failed.append((checkpoint, reason))
                continue
            self._set_aside([c.path.name for c, _ in failed] + [name for name, _ in self.broken])
            return checkpoint.path, state
        if failed:
            raise CheckpointError(self._none_usable([(c.path.name, r) for c, r in failed] + self.broken))
        self._set_aside([name for name, _ in self.broken])
        return None

    def _none_usable(self, problems: list[tuple[str, str]]) -> str:
        lines = [f"trainer.resume=auto: no usable checkpoint in {self.root}:"]
        lines += [f"  {name}: {problem}" for name, problem in problems]
        lines.append("fix: trainer.resume=disable starts fresh in this run_dir (these are kept, renamed to "
                     f"step_N{SET_ASIDE}), a new trainer.run_dir starts fresh elsewhere, and trainer.resume=PATH "
                     "loads a checkpoint you name")
        return "\n".join(lines)

    def _set_aside(self, names: list[str]) -> None:
        """Rename unusable checkpoints out of the way of the steps this run will write, then point `latest` at the
        newest complete one left (none: no marker)."""
        for name in names:
            if name == LATEST:
                continue
            target = self.root / f"{name}{SET_ASIDE}"
            copies = 1
            while target.exists():
                copies += 1
                target = self.root / f"{name}{SET_ASIDE}.{copies}"
            os.rename(self.root / name, target)
            self.warn(f"checkpoint {self.root / name} renamed to {target.name}")
        newest = self.latest()
        if newest is not None:
            self._mark_latest(newest.name)
        else:
            (self.root / LATEST).unlink(missing_ok=True)

    def _mark_latest(self, name: str) -> None:
        marker = self.root / f".{LATEST}.tmp"
        marker.write_text(name)
        os.replace(marker, self.root / LATEST)

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        steps = [checkpoint.path for checkpoint, problem in self.checkpoints() if problem is None]
        for path in steps[self.max_to_keep :]:
            shutil.rmtree(path, ignore_errors=True)


def _trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:  # its size can be right and its text not JSON
        raise CheckpointLoadFailed(f"{path / TRAINER_STATE}: {type(error).__name__}: {error}") from None


def _names(checkpoints: list[Checkpoint]) -> str:
    return ", ".join(checkpoint.path.name for checkpoint in checkpoints)
