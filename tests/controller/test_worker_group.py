"""RayWorkerGroup's gather: a failure on one rank is raised once, and the other ranks' failures are not printed
later as Ray's unhandled errors (each with its traceback)."""
import gc
import time

import pytest

from rlmegatron.data import DatasetError


def _rank(index: int):
    time.sleep(index)  # the second rank fails a second after the first
    raise DatasetError(f"train.jsonl:3: not valid JSON (rank {index})")


def test_the_first_failure_is_raised_and_the_others_are_not_printed_as_unhandled(capfd):
    ray = pytest.importorskip("ray")
    from rlmegatron.controller.worker_group import gather
    from rlmegatron.errors import user_error_in

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        task = ray.remote(_rank)
        refs = [task.remote(0), task.remote(1)]
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            gather(refs)
        assert str(user_error_in(raised.value)) == "train.jsonl:3: not valid JSON (rank 0)"
        del refs, raised
        gc.collect()
        time.sleep(2)  # Ray reports an error nobody fetched when its last reference goes
    finally:
        ray.shutdown()
    assert "Unhandled error" not in capfd.readouterr().err
