"""A member on another node moves into the driver's directory and reads the driver's token in the run directory;
a node that sees neither is one line naming it."""
import os
import sys

import pytest

from rlmegatron.transport.shared_files import MARK, NotShared, SharedFiles


@pytest.fixture
def back_here():
    here, path = os.getcwd(), list(sys.path)
    yield
    os.chdir(here)
    sys.path[:] = path


def test_a_member_that_shares_the_files_works_where_the_driver_does(tmp_path, back_here):
    workdir = tmp_path / "repo"
    workdir.mkdir()
    os.chdir(workdir)
    shared = SharedFiles.write("runs/job")  # relative, as a spec's run_dir is: the driver's directory resolves it
    assert shared.run_dir == str(workdir / "runs" / "job") and (workdir / "runs" / "job" / MARK).is_file()
    os.chdir(tmp_path)  # where a raylet started
    shared.enter("10.0.0.2")
    assert os.getcwd() == str(workdir) and sys.path[0] == str(workdir)


def test_a_node_without_the_directory_or_the_run_directory_is_named(tmp_path, back_here):
    os.chdir(tmp_path)
    shared = SharedFiles.write(str(tmp_path / "run"))
    elsewhere = SharedFiles(str(tmp_path / "not-mounted"), shared.run_dir, shared.token)
    with pytest.raises(NotShared, match=rf"^node 10.0.0.3 has no directory {tmp_path}/not-mounted \(where rlm "
                                        r"train runs\); every node needs the run's files at the same path"):
        elsewhere.enter("10.0.0.3")
    # The run directory of another run, or a local one that only looks the same.
    stale = SharedFiles(shared.workdir, shared.run_dir, "another run's token")
    with pytest.raises(NotShared, match=rf"^node 10.0.0.4 does not see trainer.run_dir={tmp_path}/run as the driver "
                                        rf"does \(its {MARK} holds another run's token\)"):
        stale.enter("10.0.0.4")
    (tmp_path / "run" / MARK).unlink()
    with pytest.raises(NotShared, match=r"is not there\)"):
        shared.enter("10.0.0.4")
