"""Suite-wide settings for the parallel run the README gives (`pytest -n 2`, pytest-xdist, one file per worker at a
time: pytest.ini's --dist loadfile keeps each module's shared fixtures, such as a trained run, built once).

- Each worker's own torch gets its share of the cores: two workers at torch's default of one thread per core would
  run four compute threads on two cores, and OpenMP threads that lose their core spin instead of working.
- Modules marked `long` (an end-to-end run of minutes) are handed out first. The workers take files in this order,
  so a long file left for last would run alone while the other worker sits idle.
"""
from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order
