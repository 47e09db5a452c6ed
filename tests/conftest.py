"""Suite-wide settings for the parallel run the README gives (`pytest -n 2`, pytest-xdist, a whole file per worker:
pytest.ini's --dist loadfile, so a module's shared fixture, such as one trained run checked by several tests, is built
once).

- Each worker's own torch gets its share of the cores: two workers at torch's default of one thread per core would
  run four compute threads on two cores, and OpenMP threads that lose their core spin instead of working.
- The workers take files in collection order, two at a time. The end-to-end files of a minute or more (FIRST) go
  first, so that none is left for last to run alone while the other worker idles; in FIRST, those that start a Ray
  cluster alternate with those that do not, so the two workers do not start their clusters at the same moment (on a
  loaded machine Ray's 30 s wait for its raylet then ran out).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

FIRST = (
    "tests/agent/test_tool_lookup.py",  # rank processes (placement.transport=auto)
    "tests/models/test_conversion.py",
    "tests/driver/test_train.py",  # Ray
    "tests/runtime/test_parallel_parity.py",
    "tests/launch/test_ray_job.py",  # Ray
    "tests/rank/roles/test_actor.py",
    "tests/driver/test_vision_quickstart.py",  # rank processes
)
REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # W&B runs write to their run directory and never reach the network (the wandb backend's tests read them back
    # from there); its caches and artifact staging go to a directory of this session, not the user's home.
    os.environ["WANDB_MODE"] = "offline"
    scratch = tempfile.mkdtemp(prefix="rlm-tests-wandb-")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        os.environ[name] = os.path.join(scratch, name.lower())
    if missing := [path for path in FIRST if not (REPO_ROOT / path).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py: FIRST names files that do not exist: {', '.join(missing)}")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def position(item: pytest.Item) -> int:
        path = Path(str(item.path)).resolve().relative_to(REPO_ROOT).as_posix()
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=position)  # stable: the other files keep their order
