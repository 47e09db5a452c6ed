"""A Divergence in any phase of a step (generation, values, log-probs, updates, validation) stops the fit loop as
TrainingStopped naming the step and the metric, before the step is logged or saved (the fit rig: no Megatron)."""
import pytest

from rlmegatron.driver.trainer import TrainingStopped
from rlmegatron.errors import Divergence
from tests.driver.fit_rig import FakeEngines, FakeRanks, failing_on_second_call, run_rig

# PPO with a critic, a KL loss and two epochs (so every phase runs, the old-log-prob pass too), a checkpoint every
# step, validation on step 2.
EVERY_PHASE = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4", "actor.use_kl_loss=true",
               "actor.ppo_epochs=2", "trainer.total_steps=3", "trainer.save_freq=1", "data.val_files=[val.jsonl]",
               "trainer.test_freq=2"]


def diverging_ranks(method: str) -> FakeRanks:
    """Fake ranks whose `method`'s second call (step 2's) diverges."""
    return failing_on_second_call(method, Divergence(f"{method}: 3 of 12 response tokens are NaN or infinite"))


class DivergingEngines(FakeEngines):
    """The second generation call labelled `label` diverges."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.diverging = label

    def generate(self, shares, progress=None):
        answers = super().generate(shares, progress)
        if sum(label == self.diverging for label, _ in self.calls) == 2:
            raise Divergence("rollout logits: NaN or inf for 1 of the 8 samples at response token 2")
        return answers


@pytest.mark.parametrize("phase", ["rollout", "compute_values", "compute_log_prob", "compute_ref_log_prob",
                                   "update_critic", "update_actor", "validation"])
def test_a_divergence_in_any_phase_stops_the_step_unsaved_naming_the_step_and_the_metric(tmp_path, phase):
    in_engines = phase in ("rollout", "validation")
    ranks = FakeRanks() if in_engines else diverging_ranks(phase)
    engines = DivergingEngines(phase) if in_engines else FakeEngines()
    # Validation's second call is step 2's when validation also runs before training.
    before = ["trainer.val_before_train=true"] if phase == "validation" else []
    with pytest.raises(TrainingStopped) as raised:
        run_rig(tmp_path, *EVERY_PHASE, *before, ranks=ranks, engines=engines, val_prompts=2)
    metric = "rollout logits: NaN or inf for 1 of the 8 samples at response token 2" if in_engines else \
        f"{phase}: 3 of 12 response tokens are NaN or infinite"
    assert str(raised.value) == (f"step 2: {metric}. No checkpoint is written for this step; the last complete one "
                                 f"is {tmp_path / 'checkpoints' / 'step_1'}")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]
    assert ranks.calls.count("save_checkpoint") == 1
