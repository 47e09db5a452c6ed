"""RankProcesses: trainer ranks as local processes without Ray, failing as RayWorkerGroup fails (a rank's error raised
with its type, a dead rank named at once) and leaving no process behind. That none outlives a driver killed outright
is tested end to end, servers included: tests/driver/test_sigkill.py."""
import os
import signal
import threading
import time

import pytest
import torch

from rlmegatron.transport.local_ranks import RankDied
from rlmegatron.transport.rank_processes import RankProcesses
from rlmegatron.data import DatasetError
from rlmegatron.errors import UserError
from rlmegatron.transport.local_ranks import RankFailure
from rlmegatron.tracking.progress import ProgressBar, report
from tests.helpers.processes import alive


class Unpicklable(UserError):
    """A user error pickle cannot rebuild (its constructor takes more than its message)."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row


class Member:
    def __init__(self, offset: int) -> None:
        self.rank = torch.distributed.get_rank()
        self.offset = offset

    def summed(self, value: int) -> tuple[int, int, float]:
        """(rank, torch threads, the all-reduced value + rank + offset): a collective over both ranks."""
        total = torch.tensor([float(value + self.rank + self.offset)])
        torch.distributed.all_reduce(total)
        return self.rank, torch.get_num_threads(), total.item()

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise DatasetError(f"train.jsonl:3: not valid JSON (rank {rank})")
        return self.rank

    def fail_after_a_peers_bug(self) -> None:
        """Rank 0 fails first, as a peer does in a collective with a rank that made a user's mistake."""
        if self.rank == 0:
            raise RuntimeError("Connection closed by peer")
        time.sleep(0.5)
        raise DatasetError("train.jsonl:3: not valid JSON")

    def fail_unpicklable(self, user: bool) -> None:
        if user:
            raise Unpicklable("train.jsonl:7: bad row", 7)
        raise RuntimeError("a bug", threading.Lock())  # an argument pickle refuses

    def die_on(self, rank: int) -> None:
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.barrier()  # the peer waits for the dead rank, as in a collective of a real step

    def count_to(self, count: int, progress) -> int:
        for _ in range(count):
            report(progress)
        return count

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value):
        return value

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture
def ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's share for its workers (tests/conftest.py)
    group = RankProcesses("cpu", 2, Member, 10)
    yield group
    group.shutdown()


def test_two_ranks_run_a_collective_and_answer_in_rank_order(ranks):
    threads = max(1, os.cpu_count() // 2)
    # Each rank adds its rank and the offset it was built with: (5+0+10) + (5+1+10) = 31.
    assert ranks.call_all(Member.summed, 5) == [(0, threads, 31.0), (1, threads, 31.0)]
    assert ranks.call_each(Member.summed, {1: (1,), 0: (2,)}) == {1: (1, threads, 24.0), 0: (0, threads, 24.0)}


def test_tensors_travel_to_the_ranks_and_back_bit_for_bit(ranks):
    """CPU tensors travel as numpy arrays (torch's pickling is 20x slower); what numpy cannot hold (bfloat16, a
    tensor that requires grad) takes torch's way. Values, dtypes and shapes come back identical either way."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=generator)
    sent = {
        "float32": base, "float64": base.double(), "int64": torch.randint(0, 1000, (3, 5), generator=generator),
        "bool": base > 0, "uint8": torch.randint(0, 255, (4,), generator=generator, dtype=torch.uint8),
        "view": base[1::2, 3:], "bfloat16": base.bfloat16(), "grad": base.clone().requires_grad_(),
        "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
    }
    for rank, back in enumerate(ranks.call_all(Member.echo, sent)):
        assert back.keys() == sent.keys()
        for name, tensor in sent.items():
            assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, (rank, name)
            assert torch.equal(back[name].detach(), tensor.detach()), (rank, name)
        assert back["grad"].requires_grad and back["view"].is_contiguous()


def test_a_ranks_error_is_raised_with_its_type_and_the_group_goes_on(ranks):
    with pytest.raises(DatasetError, match=r"^train.jsonl:3: not valid JSON \(rank 1\)$") as raised:
        ranks.call_all(Member.fail_on, 1)
    assert "trainer rank 1 failed" in str(raised.value.__cause__)  # the rank's traceback, for RLM_DEBUG=1
    assert ranks.call_all(Member.fail_on, 5) == [0, 1]
    with pytest.raises(DatasetError, match=r"^train.jsonl:3: not valid JSON$"):  # the cause, not the first to fail
        ranks.call_all(Member.fail_after_a_peers_bug)


def test_an_error_pickle_cannot_carry_is_raised_as_its_text(ranks):
    with pytest.raises(UserError, match=r"^train.jsonl:7: bad row$"):  # still the user's one line
        ranks.call_all(Member.fail_unpicklable, True)
    with pytest.raises(RankFailure, match=r"^trainer rank [01] failed:\nTraceback") as raised:  # both raise: either
        ranks.call_all(Member.fail_unpicklable, False)
    assert "RuntimeError: ('a bug', <unlocked _thread.lock object" in str(raised.value)


def test_a_killed_rank_fails_the_call_at_once_naming_it(ranks):
    ranks.call_all(Member.pid)  # built
    started = time.monotonic()
    # Named with the call it died in: the phase of the step, in the trainer's calls.
    with pytest.raises(RankDied, match=r"^trainer rank 1 \(pid \d+\) was killed by SIGKILL during die_on$"):
        ranks.call_all(Member.die_on, 1)
    # Rank 0 waits in the barrier for ever: the call gives up on it after the peers' grace (5 s), not later.
    assert time.monotonic() - started < 10


def test_progress_reported_in_the_ranks_advances_the_drivers_bar(ranks):
    bar = ProgressBar("rollout", 7)
    assert ranks.call_each(Member.count_to, {0: (3, bar.advance), 1: (4, bar.advance)}) == {0: 3, 1: 4}
    assert bar.done == 7


def test_shutdown_leaves_no_rank_process():
    group = RankProcesses("cpu", 2, Member, 0)
    pids = group.call_all(Member.pid)
    group.shutdown()
    assert not any(map(alive, pids))


def test_ranks_busy_with_a_call_the_driver_gave_up_on_are_ended_at_shutdown_not_waited_for(ranks):
    """Ctrl-C (or SIGTERM, which rlm train turns into the same exit) while the ranks work: shutdown must not wait
    for the step to end."""
    pids = ranks.call_all(Member.pid)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            ranks.call_all(Member.sleep, 60)
    finally:
        signal.signal(signal.SIGALRM, previous)
    started = time.monotonic()
    ranks.shutdown()
    assert time.monotonic() - started < 4  # not the 5 s an orderly stop gives ranks to exit, nor a 60 s timeout
    assert not any(map(alive, pids))


# A rank whose driver was killed as it answered a call: the error reply finds the pipe broken.
DRIVER_GONE = """
import os, pickle
from multiprocessing import Pipe
from rlmegatron.transport import rank_processes

driver_end, rank_end = Pipe()
driver_end.send_bytes(pickle.dumps((1, "call", ("summed", 1), {})))  # before any build: it raises, the reply is sent
driver_end.close()
rank_processes._serve(rank_end, os.getppid(), dict(os.environ), os.getcwd(), {}, "cpu", 1, 60.0)
print("served")
"""


def test_a_rank_whose_driver_is_gone_ends_without_a_word():
    """Not "Process rank N:" and a BrokenPipeError or ConnectionResetError on the terminal of whoever killed it."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", DRIVER_GONE], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "served\n", "")
