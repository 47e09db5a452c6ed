"""The run directory's lock (rlmegatron/checkpoint/run_dir.py): a second holder is refused with the first one named, and the lock
is free the moment its holder dies, SIGKILL included, with nothing to clean up; and the write check preflight runs."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from rlmegatron.checkpoint.run_dir import RunDirBusy, refuse_if_busy, run_dir_lock, unwritable

HOLD = ("import sys, time\nfrom rlmegatron.checkpoint.run_dir import run_dir_lock\n"
        "with run_dir_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(120)\n")


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_is_free_once_it_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunDirBusy) as refused:
            with run_dir_lock(run_dir):
                pass
        with pytest.raises(RunDirBusy) as refused_early:  # what rlm train checks first, taking nothing
            refuse_if_busy(run_dir)
        assert str(refused_early.value) == str(refused.value)
        message = str(refused.value)
        assert message.startswith(f"trainer.run_dir={run_dir}: another run is using it (rlm train, pid {holder.pid} "
                                  f"on host {socket.gethostname()}, started ")
        assert message.endswith("); wait for it to end or stop it, or give this run its own trainer.run_dir")
        holder.send_signal(signal.SIGKILL)  # as the OOM killer would
        holder.wait()
        refuse_if_busy(run_dir)
        with run_dir_lock(run_dir):  # at once: the kernel dropped the lock with the process
            assert f'"pid": {os.getpid()}' in (run_dir / ".rlm_run.lock").read_text()
        refuse_if_busy(tmp_path / "never_run")
        assert not (tmp_path / "never_run").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_write_check_names_what_is_in_the_way_and_changes_nothing(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert unwritable(a_file) == "is a file, not a directory"
    assert unwritable(a_file / "run") == f"cannot be created: {a_file} is a file"
    assert unwritable(tmp_path / "new" / "run") is None and not (tmp_path / "new").exists()
    assert unwritable(tmp_path) is None and os.listdir(tmp_path) == ["a_file"]  # its probe file is gone
