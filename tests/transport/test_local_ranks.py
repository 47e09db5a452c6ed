"""run_ranks: values come back per rank; a raising, crashing or hung rank fails fast with a clear report."""
import os
import subprocess
import sys
import time

import pytest
import torch

from rlmegatron.data import DatasetError
from rlmegatron.errors import UserError
from rlmegatron.transport.local_ranks import RankFailure, run_ranks


def _all_reduce_rank():
    rank = torch.distributed.get_rank()
    value = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(value)
    return {"rank": rank, "world": torch.distributed.get_world_size(), "sum": value}


def _rank1_raises():
    if torch.distributed.get_rank() == 1:
        raise ValueError("bad shard on rank one")
    torch.distributed.barrier()  # rank 0 waits on the dead peer, as a real job would


def _rank1_reads_a_bad_file():
    if torch.distributed.get_rank() == 1:
        raise DatasetError("train.jsonl:3: not valid JSON")
    torch.distributed.barrier()


def _rank0_hangs():
    if torch.distributed.get_rank() == 0:
        time.sleep(600)


def _rank1_crashes():
    if torch.distributed.get_rank() == 1:
        os._exit(17)
    time.sleep(600)


def _threads():
    return torch.get_num_threads()


@pytest.mark.parametrize("given, expected", [(None, None), ("3", 3), ("0", None), ("two", None)])
def test_cpu_ranks_take_their_share_of_the_cores_or_what_omp_num_threads_gives(monkeypatch, given, expected):
    """Each of 2 ranks: half the cores, or OMP_NUM_THREADS threads where it is a positive count (a caller that runs
    other work beside the job gives each process its share so)."""
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    share = max(1, (os.cpu_count() or 1) // 2)
    assert run_ranks(_threads, 2, timeout_s=60) == [expected or share] * 2


def test_each_rank_returns_its_value_through_a_real_gloo_group():
    results = run_ranks(_all_reduce_rank, 3, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and float(r["sum"]) == 6.0 for r in results)


def test_a_raising_rank_is_reported_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_raises, 2, timeout_s=120)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "ValueError: bad shard on rank one" in message
    assert not isinstance(info.value, UserError)  # a bug keeps the ranks' tracebacks
    assert time.monotonic() - start < 60  # does not wait for the whole timeout


def test_a_users_mistake_in_a_rank_is_its_message_with_the_tracebacks_as_cause():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_reads_a_bad_file, 2, timeout_s=120)
    assert isinstance(info.value, UserError) and str(info.value) == "train.jsonl:3: not valid JSON"
    assert "--- rank 1 ---" in str(info.value.__cause__) and "DatasetError" in str(info.value.__cause__)


def test_a_hung_rank_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0 --- did not finish within 8 s \(hung\)"):
        run_ranks(_rank0_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 40


def test_a_crashed_rank_is_reported_with_its_exit_code():
    with pytest.raises(RankFailure, match="rank 1 ---\nprocess exited with code 17"):
        run_ranks(_rank1_crashes, 2, timeout_s=120)


def test_importing_rlmegatron_leaves_torch_cuda_untouched():
    """The CPU layer is opt-in: importing the package (as a GPU job does) patches nothing."""
    code = (
        "import torch; before = (torch.cuda.current_device, torch.cuda.Stream, torch.Tensor.record_stream);"
        "import rlmegatron, rlmegatron.runtime, rlmegatron.models.spec, rlmegatron.config;"
        "assert before == (torch.cuda.current_device, torch.cuda.Stream, torch.Tensor.record_stream);"
        "from torch.overrides import _get_current_function_mode_stack as s; assert not s(), s()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


_DRIVER_INTERRUPTED_WHILE_THE_FORK_SERVER_IMPORTS = """
import sys, time
from rlmegatron.transport.fork_server import fork_server
try:
    fork_server()
    print("started", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(130)
"""



def test_ctrl_c_while_the_fork_server_imports_prints_no_traceback_of_it():
    """Ctrl-C reaches the driver's whole process group; the fork server, seconds into importing torch, Megatron and
    transformers, used to print its KeyboardInterrupt traceback under the driver's one-line report."""
    import signal

    driver = subprocess.Popen([sys.executable, "-c", _DRIVER_INTERRUPTED_WHILE_THE_FORK_SERVER_IMPORTS],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert driver.stdout.readline().strip() == "started"
    time.sleep(0.3)  # the server is importing: that takes seconds
    os.killpg(driver.pid, signal.SIGINT)
    assert driver.wait(timeout=60) == 130
    # A server that took the interrupt prints its traceback at once; one that ignores it would import on for
    # seconds (and then end, its driver gone): a second is enough to see, and the rest is not waited for.
    time.sleep(1.0)
    os.killpg(driver.pid, signal.SIGKILL)
    _, stderr = driver.communicate(timeout=60)
    assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr, stderr
