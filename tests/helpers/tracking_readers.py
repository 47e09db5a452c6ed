"""What each tracking backend holds, read back with its own library's reader: W&B's transaction-log inspector
(`wandb leet inspect`) on an offline run, TensorBoard's EventAccumulator on the event files, and the lines a
curves.png carries."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

from rlmegatron.tracking.curves import PLOTTED_KEY
from rlmegatron.tracking.wandb_run import SAMPLES_KEY


def wandb_runs(run_dir: Path) -> list[list[dict]]:
    """The records of each W&B run directory under run_dir/wandb, oldest first, as W&B's own inspector reads its
    transaction log (.wandb)."""
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*")):
        inspected = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                                   capture_output=True, text=True, timeout=60, check=True)
        runs.append([json.loads(line) for line in inspected.stdout.splitlines()])
    return runs


def wandb_history(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Metric -> [(step, value)] from a run's history records (W&B's own _keys and the table's entries left out)."""
    history: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record["type"] == "history":
            step = record["history"]["step"]["num"]
            for key, value in record["history"]["item"].items():
                if not key.startswith(("_", f"{SAMPLES_KEY}.")):
                    history.setdefault(key, []).append((int(step), float(value)))
    return history


def tensorboard_events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tensorboard_history(events) -> dict[str, list[tuple[int, float]]]:
    return {key: [(event.step, event.value) for event in events.Scalars(key)] for key in events.Tags()["scalars"]}


def plotted(path: Path) -> dict[str, list[tuple[int, float]]]:
    """What a curves.png shows: each line's label -> [(step, value)], from the PNG's own text entry."""
    with Image.open(path) as image:
        image.load()  # decodes the pixels: a truncated file fails here
        assert image.size[0] > 0 and image.size[1] > 0
        lines = json.loads(image.text[PLOTTED_KEY])
    return {label: list(zip(steps, values)) for label, (steps, values) in lines.items()}
