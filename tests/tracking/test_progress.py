"""Progress bars: what a log file shows, and ranks reporting through a sink."""
import io

from rlmegatron.tracking.progress import ProgressBar, ProgressCounter, progress_sink, report


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_leaves_no_line_behind_unless_asked():
    """A step prints one line of its own: a log file gets nothing of its bars, a terminal sees each drawn in place
    and erased once done."""
    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        bar = ProgressBar("rollout", 2, stream=stream, width=4)
        bar.advance(1)
        bar.complete()
    assert log.getvalue() == ""
    drawn = terminal.getvalue()
    assert "\n" not in drawn and drawn.startswith("\rrollout        [##..] 1/2 ")
    assert drawn.endswith("\r" + " " * len(drawn.split("\r")[2]) + "\r")  # the finished bar, blanked


def test_a_log_file_gets_one_line_per_quarter_and_the_bar_never_overshoots(monkeypatch):
    monkeypatch.setattr(ProgressBar, "log_lines", True)  # rlm train --verbose
    stream = io.StringIO()
    bar = ProgressBar("rollout", 8, stream=stream, width=8)
    for _ in range(10):  # a resent share reports its samples twice
        bar.advance(1)
    lines = stream.getvalue().splitlines()
    assert [line.split("]")[0] for line in lines] == [
        "rollout        [##......", "rollout        [####....", "rollout        [######..", "rollout        [########"]
    assert lines[-1].split("] ")[1].startswith("8/8 ")


def test_ranks_report_through_the_sink_without_ray():
    stream = io.StringIO()
    bar = ProgressBar("update_actor", 4, stream=stream)
    with progress_sink(bar) as progress:
        for _ in range(3):
            report(progress)
        report(None)  # ranks that are not asked to report
        assert bar.done == 3
    assert bar.done == 4  # the phase ended: all of it is done


def test_the_counter_hands_over_what_accumulated_once():
    counter = ProgressCounter()
    counter.add(3)
    counter.add(2)
    assert (counter.take(), counter.take()) == (5, 0)
