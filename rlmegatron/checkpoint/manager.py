"""Driver side of checkpoints: run_dir/checkpoints/step_N written atomically, a `latest` marker, pruning, resume lookup."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


class CheckpointManager:
    """Each checkpoint is written into a temporary directory, renamed into place, and only then named in `latest`,
    so a run killed mid-save leaves the previous checkpoint as the one a resume finds."""

    def __init__(self, run_dir: str | Path, max_to_keep: Optional[int] = None) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.max_to_keep = max_to_keep

    def save(self, step: int, workers, trainer_state: dict[str, Any]) -> str:
        final = self.root / f"step_{step}"
        staging = self.root / f".tmp_step_{step}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        workers.execute_all("save_checkpoint", str(staging))
        (staging / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        marker = self.root / f".{LATEST}.tmp"
        marker.write_text(final.name)
        os.replace(marker, self.root / LATEST)
        self._prune()
        return str(final)

    def latest(self) -> Optional[Path]:
        marker = self.root / LATEST
        if not marker.is_file():
            return None
        path = self.root / marker.read_text().strip()
        return path if (path / TRAINER_STATE).is_file() else None

    def find_resume_point(self, resume: str) -> Optional[Path]:
        """trainer.resume: `auto` (latest, if any), `disable`, or a checkpoint directory."""
        if resume == "disable":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / TRAINER_STATE).is_file():
            raise FileNotFoundError(f"trainer.resume={resume}: not a complete checkpoint (no {TRAINER_STATE})")
        return path

    def load(self, path: Path, workers) -> dict[str, Any]:
        workers.execute_all("load_checkpoint", str(path))
        return json.loads((path / TRAINER_STATE).read_text())

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        steps = sorted((int(p.name.split("_")[1]), p) for p in self.root.glob("step_*") if p.is_dir())
        for _, path in steps[: -self.max_to_keep]:
            shutil.rmtree(path, ignore_errors=True)
