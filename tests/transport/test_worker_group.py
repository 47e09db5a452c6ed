"""RayWorkerGroup: a failure on one rank is raised once, and the other ranks' failures are not printed later as Ray's
unhandled errors (each with its traceback); CPU ranks share the machine's cores."""
import gc
import os
import time

import pytest
import torch

from rlmegatron.data import DatasetError


def _rank(index: int):
    # The second rank fails 3 s after the first: a second was less than the gap between two Ray workers' starts while
    # the other test worker kept both cores busy, and the second failed first. Within gather's 5 s grace still.
    time.sleep(3 * index)
    raise DatasetError(f"train.jsonl:3: not valid JSON (rank {index})")


class Threads:
    def count(self) -> int:
        return torch.get_num_threads()


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def test_cpu_ranks_take_an_equal_share_of_the_cores(ray, monkeypatch):
    """Also: the ranks' process group forms when a probe placed like rank 0 reports rank 0's address (another node's,
    here pretended), not the driver. One group of two ranks, each a Ray worker that imports torch from cold: the
    driver is made to see six cores, so each rank's share is 3 threads, which neither torch's default on this
    machine nor Ray's for a one-CPU actor gives."""
    import dataclasses

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's share for its workers (tests/conftest.py)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)  # the driver's count, which rank_threads divides

    from ray.util.placement_group import remove_placement_group

    from rlmegatron.transport.placement import create_pool
    from rlmegatron.transport.worker_group import RayWorkerGroup

    pool = dataclasses.replace(create_pool("trainer", 1, 2, "cpu"), nodes=("another node",) * 2)
    group = RayWorkerGroup(pool, Threads)
    try:
        assert group.call_all(Threads.count) == [3, 3]
    finally:
        group.shutdown()
        remove_placement_group(pool.placement_group)


def test_the_first_failure_is_raised_and_the_others_are_not_printed_as_unhandled(ray, capfd):
    from rlmegatron.transport.worker_group import gather
    from rlmegatron.errors import user_error_in

    task = ray.remote(_rank)
    refs = [task.remote(0), task.remote(1)]
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        gather(refs)
    assert str(user_error_in(raised.value)) == "train.jsonl:3: not valid JSON (rank 0)"
    del refs, raised
    gc.collect()
    time.sleep(2)  # Ray reports an error nobody fetched when its last reference goes
    assert "Unhandled error" not in capfd.readouterr().err


def test_a_rank_on_a_node_without_the_run_directory_stops_the_group_in_one_line(ray, tmp_path):
    """Ray keeps only the text of what an actor's constructor raises: the rank says the node's mistake at its first
    call instead, so it reaches the driver as itself; its peer, waiting in the rendezvous for it, is ended."""
    import dataclasses

    from ray.util.placement_group import remove_placement_group

    from rlmegatron.errors import user_error_in
    from rlmegatron.transport.placement import create_pool
    from rlmegatron.transport.shared_files import SharedFiles
    from rlmegatron.transport.worker_group import RayWorkerGroup

    written = SharedFiles.write(str(tmp_path / "run"))
    (tmp_path / "run" / ".shared_by_every_node").write_text("another run's token")  # as a node's own disk would
    pool = dataclasses.replace(create_pool("trainer", 1, 2, "cpu"), shared=written)
    try:
        with pytest.raises(Exception) as raised:
            RayWorkerGroup(pool, Threads, collective_timeout_s=60)
        mistake = user_error_in(raised.value)
        node = ray.util.get_node_ip_address()  # the address Ray gave this one-node cluster
        assert mistake is not None and str(mistake).startswith(
            f"node {node} does not see trainer.run_dir={tmp_path / 'run'} as the driver does")
    finally:
        remove_placement_group(pool.placement_group)
