"""The TensorBoard backend: event files in trainer.run_dir/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`),
every metric a scalar under its own name, each step's rollout samples a text summary."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlmegatron.tracking.samples import format_samples

if TYPE_CHECKING:
    from rlmegatron.tracking.setup import TrackingSetup

LOG_DIR = "tensorboard"
SAMPLES_TAG = "rollout_samples"
"""The text summary's tag (torch's writer stores it as rollout_samples/text_summary)."""


class TensorBoardBackend:
    """A run resumed in the same run directory writes a new event file beside the earlier ones, starting with a
    restart mark at the step after its checkpoint's (the writer's purge_step): TensorBoard's reader drops what an
    earlier attempt logged from that step on, so each step shows once, as this run logged it. A fresh start (step 0)
    drops everything before it."""

    def __init__(self, setup: TrackingSetup) -> None:
        self.log_dir = setup.run_dir / LOG_DIR
        self.writer = None

    def start(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: needs the optional tensorboard package

        self.writer = SummaryWriter(str(self.log_dir), purge_step=step + 1 if step else 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        # TensorBoard renders text as Markdown: a fenced block keeps the samples' lines as they are.
        self.writer.add_text(SAMPLES_TAG, f"```\n{format_samples(samples, step)}```", step)

    def finish(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
