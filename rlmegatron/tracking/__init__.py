"""Experiment tracking: MLflow (local sqlite store by default) and console backends, and text plots."""
from rlmegatron.tracking.ascii_plot import ascii_plot
from rlmegatron.tracking.tracker import (
    ConsoleBackend,
    MlflowBackend,
    Tracker,
    TrackingSetup,
    flatten,
    format_metrics_table,
    format_step_line,
    resolve_tracking_uri,
)

__all__ = [
    "ConsoleBackend",
    "MlflowBackend",
    "Tracker",
    "TrackingSetup",
    "ascii_plot",
    "flatten",
    "format_metrics_table",
    "format_step_line",
    "resolve_tracking_uri",
]
