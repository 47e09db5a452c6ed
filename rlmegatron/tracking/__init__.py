"""Experiment tracking: one Tracker over the console, MLflow (local sqlite store by default), W&B and TensorBoard
backends, text plots, and the curves a run draws at its end."""
from rlmegatron.tracking.ascii_plot import ascii_plot
from rlmegatron.tracking.console import ConsoleBackend, format_metrics_table, format_step_line
from rlmegatron.tracking.mlflow_run import MlflowBackend, resolve_tracking_uri
from rlmegatron.tracking.tensorboard_events import TensorBoardBackend
from rlmegatron.tracking.setup import TrackingSetup
from rlmegatron.tracking.tracker import Tracker, flatten
from rlmegatron.tracking.wandb_run import WandbBackend

__all__ = [
    "ConsoleBackend",
    "MlflowBackend",
    "TensorBoardBackend",
    "Tracker",
    "TrackingSetup",
    "WandbBackend",
    "ascii_plot",
    "flatten",
    "format_metrics_table",
    "format_step_line",
    "resolve_tracking_uri",
]
