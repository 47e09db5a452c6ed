"""trainer.mode on the pure-Python rig (tests/driver/fit_rig.py): one_step_off generates step k+1 while step k
trains, async runs ahead within trainer.max_staleness, no trained sample is older than the bound, and the staleness
of every step is logged."""
import threading

import pytest

from rlmegatron.config import SpecError
from rlmegatron.rollout.engine import version_step
from tests.driver.fit_rig import FakeEngines, FakeRanks, rig_spec, run_rig

DISAGGREGATED = ("placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1")


class RecordingEngines(FakeEngines):
    """Records, per rollout generation, the step whose weights the engines held; signals each call."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[int] = []
        self.generated = threading.Condition()

    def generate(self, shares, progress=None):
        answers = super().generate(shares, progress)
        with self.generated:
            self.held.append(version_step(self.synced[-1] if self.synced else None))
            self.generated.notify_all()
        return answers


class OverlapRanks(FakeRanks):
    """The actor's update of step k returns only once the engines have generated step k+1's rollout (or, with
    nothing overlapping, after 10 s, which the test then sees)."""

    def __init__(self, engines: RecordingEngines, total_steps: int) -> None:
        super().__init__()
        self.engines, self.total_steps, self.overlapped = engines, total_steps, []

    def update_actor(self, batch, progress=None):
        step = len(self.updates["actor"]) + 1
        with self.engines.generated:
            self.overlapped.append(step == self.total_steps or self.engines.generated.wait_for(
                lambda: len(self.engines.held) > step, timeout=10))
        return super().update_actor(batch, progress)


def staleness(rig, stat: str) -> list[float]:
    return [value for _, value in rig.history[f"training/staleness/{stat}"]]


def test_one_step_off_generates_the_next_rollout_while_the_step_trains(tmp_path):
    engines = RecordingEngines()
    ranks = OverlapRanks(engines, total_steps=4)
    rig = run_rig(tmp_path, "trainer.mode=one_step_off", "trainer.total_steps=4", *DISAGGREGATED,
                  ranks=ranks, engines=engines)
    assert ranks.overlapped == [True] * 4
    # Step k's rollout came from the weights of step k - 2 at the oldest (the initial ones for steps 1 and 2).
    assert all(held >= step - 2 for step, held in enumerate(engines.held, start=1))
    assert engines.held[:2] == [0, 0]
    assert max(staleness(rig, "max")) == 1 and staleness(rig, "max")[0] == 0
    assert rig.engines.synced == ["step_1", "step_2", "step_3", "step_4"]


@pytest.mark.parametrize("bound", [1, 3])
def test_async_runs_ahead_within_max_staleness(tmp_path, bound):
    engines = RecordingEngines()
    rig = run_rig(tmp_path, "trainer.mode=async", f"trainer.max_staleness={bound}", "trainer.total_steps=6",
                  *DISAGGREGATED, engines=engines, train_prompts=24)
    assert all(held >= step - 1 - bound for step, held in enumerate(engines.held, start=1))
    lags = staleness(rig, "max")
    assert len(lags) == 6 and max(lags) <= bound
    for step, batch in enumerate(rig.ranks.updates["actor"], start=1):
        assert batch.response_mask.shape[0] == 8  # every step trains a whole rollout: 4 prompts x 2
    assert [value for _, value in rig.history["training/staleness/mean"]] <= lags


def test_sync_trains_only_fresh_samples(tmp_path):
    rig = run_rig(tmp_path, "trainer.total_steps=3")
    assert staleness(rig, "max") == [0.0, 0.0, 0.0] and staleness(rig, "mean") == [0.0, 0.0, 0.0]


def test_a_sample_past_the_bound_stops_the_step(tmp_path):
    class LateEngines(FakeEngines):
        def generate(self, shares, progress=None):
            self.synced.append("init")  # the engines claim the initial weights at every step
            return super().generate(shares, progress)

    with pytest.raises(RuntimeError, match="step 3 would train a sample 2 weight versions old; the bound is 1"):
        run_rig(tmp_path, "trainer.mode=one_step_off", "trainer.total_steps=3", *DISAGGREGATED,
                engines=LateEngines())


@pytest.mark.parametrize("overrides, message", [
    (("trainer.mode=async",), "trainer.mode=async: overlaps generation with training, so the engines need devices of "
                              "their own; set placement.mode=disaggregate"),
    (("trainer.mode=one_step_off", "trainer.max_staleness=3", *DISAGGREGATED),
     "trainer.max_staleness=3: only bounds trainer.mode=async (trainer.mode=one_step_off lags 1 weight versions)"),
    (("trainer.partial_rollout=true",), "trainer.partial_rollout=true: weights only arrive mid-generation when "
                                        "generation overlaps training"),
])
def test_combinations_that_cannot_run_are_spec_errors(overrides, message):
    with pytest.raises(SpecError) as error:
        rig_spec(*overrides)
    assert any(message in str(problem) for problem in error.value.problems), error.value.problems


def test_a_resumed_async_run_regenerates_what_was_buffered_and_trains_no_sample_twice(tmp_path, monkeypatch):
    """The checkpoint of step 2 holds the data loader as it was after step 2's prompts, not after the rollouts
    generated ahead of it: those are dropped, and the resumed run generates steps 3 and 4 again from the same
    prompts and seeds (rollout_buffer.Produced)."""
    from tests.driver.fit_rig import RigTrainer

    trained: dict[str, list[list[int]]] = {}
    original_next = RigTrainer.next_rollout

    def recording_next(self, rollouts, metrics):
        produced = original_next(self, rollouts, metrics)
        trained.setdefault(self.spec.trainer.resume, []).append(
            sorted({prompt.index for prompt in produced.rollout.prompts}))
        return produced

    monkeypatch.setattr(RigTrainer, "next_rollout", recording_next)
    run = ("trainer.mode=async", "trainer.max_staleness=2", *DISAGGREGATED, "trainer.save_freq=2")
    whole = run_rig(tmp_path / "whole", *run, "trainer.total_steps=4", train_prompts=16)
    first = run_rig(tmp_path / "resumed", *run, "trainer.total_steps=2", train_prompts=16)
    resumed = run_rig(tmp_path / "resumed", *run, "trainer.total_steps=4", "trainer.resume=auto", train_prompts=16)
    assert resumed.result.resumed_from == 2
    steps = trained["disable"]  # the whole run's 4 steps, then the first part's 2
    assert steps[4:] == steps[:2] and trained["auto"] == steps[2:4]
    prompts = [index for step in steps[4:] + trained["auto"] for index in step]
    assert sorted(prompts) == list(range(16))  # one epoch: every prompt trained exactly once
    assert first.history["training/staleness/max"] and whole.history["training/staleness/max"]


def test_an_engine_restarted_ahead_gets_its_weights_only_while_the_loop_waits(tmp_path):
    """A rollout made ahead finds its engine restarted (no weights): the push it needs uses the trainer ranks, so it
    waits until the loop is done with them for the step and waits for a rollout; then the share is sent again."""
    class WatchingRanks(FakeRanks):
        def __init__(self) -> None:
            super().__init__()
            self.updating, self.step_2_updating = False, threading.Event()

        def update_actor(self, batch, progress=None):
            self.updating = True
            if len(self.updates["actor"]) == 1:  # step 2, while step 3's rollout is being made
                self.step_2_updating.set()
                threading.Event().wait(1.0)  # room for a push that would not wait
            self.updating = False
            return super().update_actor(batch, progress)

    class RestartingEngines(FakeEngines):
        def __init__(self, ranks: WatchingRanks) -> None:
            super().__init__()
            self.ranks, self.rollouts, self.pushed_while_updating = ranks, 0, []

        def generate(self, shares, progress=None):
            self.rollouts += 1
            if self.rollouts == 3:  # step 3's rollout: its engine restarts while step 2 updates the actor
                assert self.ranks.step_2_updating.wait(timeout=10)
                return {engine: None for engine in shares}
            return super().generate(shares, progress)

        def relaunch(self, engines):
            super().relaunch(engines)  # the fleet's recovery, which then pushes the weights whole
            self.pushed_while_updating.append(self.ranks.updating)

    ranks = WatchingRanks()
    engines = RestartingEngines(ranks)
    rig = run_rig(tmp_path, "trainer.mode=one_step_off", "trainer.total_steps=4", *DISAGGREGATED, ranks=ranks,
                  engines=engines)
    assert engines.pushed_while_updating == [False]
    # Whole (fresh), and the latest weights: step 2 had pushed its own by the time the loop waited.
    assert [push for push in ranks.pushes if push[2]] == [("step_2", [0], True)]
    assert len(rig.ranks.updates["actor"]) == 4 and all(len(b) == 8 for b in rig.ranks.updates["actor"])


def test_a_divergence_in_a_rollout_made_ahead_stops_the_step_that_would_train_it(tmp_path):
    from rlmegatron.driver.trainer import TrainingStopped
    from rlmegatron.errors import Divergence

    class DivergingEngines(FakeEngines):
        def generate(self, shares, progress=None):
            if len(self.calls) == 2:  # step 3's rollout, made while step 2 trains
                raise Divergence("rollout logits: NaN or inf for 1 of the 8 samples at response token 2")
            return super().generate(shares, progress)

    ranks = FakeRanks()
    with pytest.raises(TrainingStopped) as raised:
        run_rig(tmp_path, "trainer.mode=one_step_off", "trainer.total_steps=4", "trainer.save_freq=1",
                *DISAGGREGATED, ranks=ranks, engines=DivergingEngines())
    assert str(raised.value) == ("step 3: rollout logits: NaN or inf for 1 of the 8 samples at response token 2. No "
                                 "checkpoint is written for this step; the last complete one is "
                                 f"{tmp_path / 'checkpoints' / 'step_2'}")
    assert ranks.calls.count("save_checkpoint") == 2
