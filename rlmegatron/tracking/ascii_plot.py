"""A small text plot of one metric series, for the end-of-run summary in a terminal or log."""
from __future__ import annotations

from collections.abc import Sequence


def ascii_plot(values: Sequence[float], *, steps: Sequence[int] | None = None, width: int = 60, height: int = 10,
               title: str = "") -> str:
    """`height` rows of `width` plot columns with the y range labelled, an x-axis line and the step
    range below (`steps`: each value's step, default 1, 2, ...; a resumed run's start later); longer
    series are averaged into `width` buckets so the plot keeps its shape."""
    if not values:
        return f"{title}: no data" if title else "no data"
    columns = _bucket_means(list(values), width)
    low, high = min(columns), max(columns)
    span = high - low or 1.0  # a flat series draws on the bottom row
    rows = [[" "] * len(columns) for _ in range(height)]
    for x, value in enumerate(columns):
        level = round((value - low) / span * (height - 1))
        rows[height - 1 - level][x] = "*"
    label_width = max(len(f"{high:.4g}"), len(f"{low:.4g}"))
    lines = [title] if title else []
    for index, row in enumerate(rows):
        label = f"{high:.4g}" if index == 0 else f"{low:.4g}" if index == height - 1 else ""
        lines.append(f"{label:>{label_width}} |{''.join(row)}")
    lines.append(f"{'':>{label_width}} +{'-' * len(columns)}")
    first, last = (steps[0], steps[-1]) if steps else (1, len(values))
    lines.append(f"{'':>{label_width}}  steps {first}-{last}")
    return "\n".join(lines)


def _bucket_means(values: list[float], width: int) -> list[float]:
    if len(values) <= width:
        return values
    buckets = []
    for column in range(width):
        start = column * len(values) // width
        stop = (column + 1) * len(values) // width
        chunk = values[start:stop]
        buckets.append(sum(chunk) / len(chunk))
    return buckets
