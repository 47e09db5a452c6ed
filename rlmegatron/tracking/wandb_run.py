"""The W&B backend: a run in trainer.run_dir/wandb, offline (nothing leaves the machine until `wandb sync`) when
WANDB_MODE=offline, with the spec as its config, every metric under its own name and each step's rollout samples as a
table."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlmegatron.errors import UserError
from rlmegatron.tracking.samples import sample_table

if TYPE_CHECKING:
    from rlmegatron.tracking.setup import TrackingSetup

RUN_ID_FILE = "wandb_run.json"
SAMPLES_KEY = "rollout_samples"
"""The table's key in the run, as the MLflow run's artifacts are named."""


class WandbBackend:
    """A run resumed in the same run directory continues that directory's W&B run (RUN_ID_FILE, W&B's resume="allow"
    on its id); a fresh start (step 0) is a new run. W&B ignores a step below the last one its run holds, so the steps
    a stopped attempt logged after its last checkpoint keep that attempt's values when the resumed one logs them again
    (W&B's rewind, which would replace them, is a preview feature of its cloud)."""

    def __init__(self, setup: TrackingSetup, params: Mapping[str, Any]) -> None:
        setup.run_dir.mkdir(parents=True, exist_ok=True)
        self.setup, self.params = setup, params
        self.run = None

    def start(self, step: int) -> None:
        import wandb  # lazy: an optional extra, and most commands never track

        saved = self.setup.run_dir / RUN_ID_FILE
        previous = json.loads(saved.read_text())["run_id"] if step > 0 and saved.is_file() else None
        try:
            self.run = wandb.init(project=self.setup.project_name, name=self.setup.experiment_name,
                                  dir=str(self.setup.run_dir), config=dict(self.params), id=previous,
                                  resume="allow" if previous else None)
        except wandb.errors.UsageError as error:  # W&B's word for a setup to fix: no API key outside offline mode, ...
            raise UserError(f"tracking.backends: wandb: {error} Or log offline, without an account: WANDB_MODE=offline "
                            f"keeps the run in {self.setup.run_dir / 'wandb'} for `wandb sync`") from error
        saved.write_text(json.dumps({"run_id": self.run.id}))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        import wandb  # lazy: imported by start already

        if samples:
            columns, rows = sample_table(samples, step)
            self.run.log({SAMPLES_KEY: wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self, status: str) -> None:
        if self.run is not None:  # None: the run stopped before training started
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)
