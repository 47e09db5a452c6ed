"""curves.png: a run's curves by step (reward, validation score, KL, entropy, response length, step time), drawn at
the end of a run into its run directory, and redrawn from its MLflow store by `rlm report RUN_DIR` at any time.

The PNG carries what it plots: each line's steps and values, as JSON in its PLOTTED_KEY text entry
(`PIL.Image.open(path).text`), so what a picture shows can be checked, or read back, without the store."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from rlmegatron.errors import UserError
from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN, VALIDATION_PREFIX
from rlmegatron.tracking.mlflow_run import RUN_ID_FILE, damaged_store_is_the_users, mlflow_client

CURVES_FILE = "curves.png"
PLOTTED_KEY = "rlmegatron.curves"

History = Mapping[str, list[tuple[int, float]]]
"""Metric -> [(step, value)], as the Tracker keeps it."""


def _named(*keys: str) -> Callable[[str], bool]:
    return lambda key: key in keys


PANELS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("reward", _named(REWARD_SCORE_MEAN)),
    ("validation score", lambda key: key.startswith(VALIDATION_PREFIX) and key.endswith("/score/mean")),
    # To the reference (the KL loss or the reward's penalty, when the spec has one) and to the sampling policy.
    ("KL", _named("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
    ("entropy", _named("actor/entropy")),
    ("response length (tokens)", _named("response_length/mean")),
    ("step time (s)", _named("timing_s/step")),
)


def plotted_metrics(history: History) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """Each panel's title and the series of `history` it draws, by name, each sorted by step."""
    return [(title, {key: sorted(points) for key, points in sorted(history.items()) if shows(key) and points})
            for title, shows in PANELS]


def draw_curves(history: History, path: Path, title: str) -> dict[str, list[list[float]]]:
    """Write the panels to `path` (a PNG) and return what was drawn: each line's label -> [steps, values], read from
    the figure's own lines."""
    # Its note that it builds its font cache, on a machine's first drawing (seconds), would be the only line
    # on a run's stderr; the fonts it needs ship with it.
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    # lazy: matplotlib takes a second to import, and only the end of a run and `rlm report` draw. The figure is
    # rendered by Agg directly, with no pyplot and no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(15, 8))
    FigureCanvasAgg(figure)
    figure.suptitle(title)
    # Fixed margins: matplotlib's constrained layout measures every tick label, and that measuring was most of the
    # drawing time.
    axes = list(figure.subplots(2, 3, gridspec_kw={"left": 0.05, "right": 0.98, "bottom": 0.07, "top": 0.9,
                                                   "wspace": 0.2, "hspace": 0.3}).flat)
    for ax, (panel, series) in zip(axes, plotted_metrics(history)):
        for key, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, label=key, marker="." if len(points) <= 50 else None)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    plotted = {line.get_label(): [[int(step) for step in line.get_xdata()], [float(v) for v in line.get_ydata()]]
               for ax in axes for line in ax.get_lines()}
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80, metadata={PLOTTED_KEY: json.dumps(plotted)})
    return plotted


def mlflow_history(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], str, str]:
    """The history of the run directory's MLflow run (RUN_ID_FILE: the run a resumed run took over, too), its name
    and its status (RUNNING while it trains)."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow takes seconds to import

    saved_file = run_dir / RUN_ID_FILE
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such directory; rlm report takes a run's trainer.run_dir")
    if not saved_file.is_file():
        raise UserError(f"{run_dir}: no MLflow run here ({RUN_ID_FILE} is missing); rlm report reads the MLflow store "
                        "of a run directory whose run had mlflow in tracking.backends")
    saved = json.loads(saved_file.read_text())
    client = mlflow_client(saved["tracking_uri"])
    try:
        with damaged_store_is_the_users(saved["tracking_uri"]):
            run = client.get_run(saved["run_id"])
    except MlflowException as error:
        raise UserError(f"{run_dir}: its MLflow run {saved['run_id']} is not in {saved['tracking_uri']} "
                        f"({str(error).splitlines()[0]})") from error
    shown = {key for key in run.data.metrics if any(shows(key) for _, shows in PANELS)}
    history = {key: [(point.step, point.value) for point in client.get_metric_history(run.info.run_id, key)]
               for key in sorted(shown)}
    return history, run.info.run_name, run.info.status


def report(run_dir: str | Path) -> tuple[Path, str]:
    """`rlm report RUN_DIR`: curves.png redrawn from the run's MLflow store; its path, and a line saying what it
    shows."""
    run_dir = Path(run_dir)
    history, name, status = mlflow_history(run_dir)
    path = run_dir / CURVES_FILE
    draw_curves(history, path, f"{name} ({status.lower()})")
    steps = sorted({step for points in history.values() for step, _ in points})
    shown = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps yet"
    return path, f"curves: {path} ({shown} of run {name}, {status})"
