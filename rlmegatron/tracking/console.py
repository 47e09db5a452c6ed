"""The console backend: a line per step, the table of every metric every trainer.log_freq steps, rollout samples."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN
from rlmegatron.tracking.samples import format_samples


class ConsoleBackend:
    """One line per step (the step, its mean score, response length and time, and any validation scores); every
    `log_freq` trained steps the compact table of every metric instead: a rule naming the step, then the metrics
    sorted, three to a line."""

    COLUMNS = 3

    def __init__(self, stream: TextIO, log_freq: int = -1) -> None:
        self.stream, self.log_freq = stream, log_freq

    def start(self, step: int) -> None:
        pass  # a stream has no earlier attempt to continue

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.log_freq > 0 and step > 0 and step % self.log_freq == 0:  # step 0: validation before training
            self.stream.write(format_metrics_table(metrics, step, self.COLUMNS))
        else:
            self.stream.write(format_step_line(metrics, step))
        self.stream.flush()

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        self.stream.write(format_samples(samples, step))
        self.stream.flush()

    def finish(self, status: str) -> None:
        pass  # nothing buffered


STEP_LINE_METRICS = (REWARD_SCORE_MEAN, "response_length/mean", "timing_s/step")
"""What a step's one console line shows, with every validation score (val/<source>/score/mean) of the step."""


def format_step_line(metrics: Mapping[str, float], step: int) -> str:
    """`step 12  critic/score/mean 0.4375  response_length/mean 1  timing_s/step 0.07131`: the metrics' own names,
    as the table and the MLflow run show them."""
    shown = [key for key in STEP_LINE_METRICS if key in metrics]
    shown += sorted(key for key in metrics if key.startswith("val/") and key.endswith("/score/mean"))
    return "  ".join([f"step {step}", *(f"{key} {_format_value(metrics[key])}" for key in shown)]) + "\n"


def format_metrics_table(metrics: Mapping[str, float], step: int, columns: int = 3) -> str:
    cells = [(key, _format_value(value)) for key, value in sorted(metrics.items())]
    key_width = max((len(key) for key, _ in cells), default=0)
    value_width = max((len(value) for _, value in cells), default=0)
    lines = [f"── step {step} " + "─" * max(0, (key_width + value_width + 3) * columns - len(str(step)) - 8)]
    for start in range(0, len(cells), columns):
        row = cells[start : start + columns]
        lines.append("   ".join(f"{key:<{key_width}} {value:>{value_width}}" for key, value in row).rstrip())
    return "\n".join(lines) + "\n"


def _format_value(value: float) -> str:
    # Throughputs and token counts read better whole than as 1.235e+04.
    return f"{value:.0f}" if 1e4 <= abs(value) < 1e12 else f"{value:.4g}"
