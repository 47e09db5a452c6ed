"""What the rollout tests share."""
import pytest
import torch


@pytest.fixture(scope="module")
def file_system_sharing():
    """CPU buckets reach an (unrelated) server process through named shared memory, which torch's file-descriptor
    strategy cannot pass to a process it did not start."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(previous)
