"""`rlm train` with rollout.weight_sync=delta and trainer.check_sync_every=1: after every step's sync each engine's
weights are checked, tensor by tensor, against what a full push gives (a mismatch would stop the run, exit 3), while
the pushes carry a fraction of the bytes: colocated and disaggregated (the local engine's server, the records through
its custom weight loader), at actor TP=2 and on the MoE model at EP=2, bf16 and fp32, with FP8 rollout, and with a
full push every 2."""
import re

import pytest

from tests.driver.test_moe_fit import MOE_MODEL
from tests.driver.test_train import QUICKSTART, REPO_ROOT, RLM
from tests.helpers import warm_runs

STEPS = 4
RUN = [f"trainer.total_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1", "~data.val_files",
       "trainer.log_freq=1", "tracking.backends=[console]", "rollout.weight_sync=delta", "trainer.check_sync_every=1",
       "actor.optim.lr=1e-6"]


def _metric(stdout: str, name: str) -> list[float]:
    return [float(value) for value in re.findall(rf"{re.escape(name)}\s+([-\d.e]+)", stdout)]


def _train(tmp_path, *overrides: str):
    run = warm_runs.run([RLM, "train", QUICKSTART, f"trainer.run_dir={tmp_path / 'run'}", *RUN, *overrides],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"trained steps 1-{STEPS}" in run.stdout
    return run.stdout


DISAGGREGATED = ("placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1")
MOE_EP2 = (f"model.path={MOE_MODEL}", "placement.gpus_per_node=2", "actor.megatron.expert_model_parallel_size=2")
TP2 = ("placement.gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2")


@pytest.mark.parametrize("dtype, layout", [
    pytest.param("bf16", (*TP2, "rollout.quantization=fp8"), id="colocated-tp2-bf16-fp8-rollout"),
    pytest.param("fp32", TP2, id="colocated-tp2-fp32"),
    pytest.param("bf16", MOE_EP2, id="colocated-moe-ep2-bf16"),
    pytest.param("bf16", (*TP2, *DISAGGREGATED), id="disaggregated-tp2-bf16"),
    pytest.param("fp32", (*MOE_EP2, *DISAGGREGATED), id="disaggregated-moe-ep2-fp32"),
])
def test_delta_sync_holds_the_full_push_weights_at_every_step(tmp_path, dtype, layout):
    stdout = _train(tmp_path, f"model.dtype={dtype}", *layout)
    ratios = _metric(stdout, "weight_sync/sent_ratio")
    # The initial push (whole, as the ranks or the servers started) is no step's: every logged sync is a delta.
    assert len(ratios) == STEPS and _metric(stdout, "weight_sync/full_pushes") == [0.0] * STEPS
    if dtype == "bf16":  # fp32 weights change in nearly every element: most tensors go whole, exactly all the same
        assert all(ratio < 0.5 for ratio in ratios), ratios


def test_disaggregated_delta_sync_on_an_moe_at_ep2_pushes_whole_every_full_sync_every(tmp_path):
    stdout = _train(tmp_path, "model.dtype=bf16", *MOE_EP2, *DISAGGREGATED, "rollout.full_sync_every=2")
    full = _metric(stdout, "weight_sync/full_pushes")
    ratios = _metric(stdout, "weight_sync/sent_ratio")
    # Syncs 2 and 4 of the run are whole.
    assert full == [0.0, 1.0, 0.0, 1.0], full
    assert ratios[0] < 0.5 and ratios[2] < 0.5, ratios
    assert ratios[1] == pytest.approx(1.0) and ratios[3] == pytest.approx(1.0), ratios


def test_an_engine_found_holding_other_weights_stops_the_run_in_one_line(tmp_path):
    """What the rank's check raises (rank/weight_push.WeightSyncMismatch) is a step that must not be trained on: the
    run stops naming the step, the tensor and the last checkpoint (TrainingStopped: exit 3, one line)."""
    from rlmegatron.driver.trainer import TrainingStopped
    from rlmegatron.errors import WeightSyncMismatch
    from tests.driver.fit_rig import FakeRanks, run_rig

    class MismatchedRanks(FakeRanks):
        def sync_weights(self, version, engines=None, fresh=False):
            report = super().sync_weights(version, engines, fresh)
            if version == "step_2":
                raise WeightSyncMismatch("after the sync of step_2, rollout engine 0 holds 1 of 24 tensors other "
                                         "than a full push gives, first lm_head.weight (trainer.check_sync_every)")
            return report

    with pytest.raises(TrainingStopped) as raised:
        run_rig(tmp_path, "trainer.total_steps=3", ranks=MismatchedRanks())
    assert str(raised.value) == ("step 2: after the sync of step_2, rollout engine 0 holds 1 of 24 tensors other than "
                                 "a full push gives, first lm_head.weight (trainer.check_sync_every). No checkpoint "
                                 "is written for this step; the last complete one is none")
