"""trainer.mode=async end to end on CPU, without Ray: the local engine in its own process (placement.mode=disaggregate),
rollouts generated ahead of the trainer within trainer.max_staleness, weights pushed mid-generation (partial rollout),
the stale samples corrected by rollout importance weights."""
import math

from tests.controller.test_train import train

ASYNC = ["trainer.total_steps=4", "placement.gpus_per_node=1", "placement.mode=disaggregate",
         "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1", "trainer.save_freq=-1",
         "trainer.test_freq=-1", "data.val_files=[]", "tracking.backends=[console]", "trainer.mode=async",
         "trainer.max_staleness=2", "trainer.partial_rollout=true", "algorithm.rollout_correction.rollout_is=token"]


def test_async_trains_within_its_staleness_bound_and_logs_it(tmp_path):
    result = train(tmp_path, "async", "local", *ASYNC, f"trainer.run_dir={tmp_path / 'run'}")
    history = result["history"]
    lags = [value for _, value in history["training/staleness/max"]]
    assert [step for step, _ in history["training/staleness/mean"]] == [1, 2, 3, 4]
    assert lags[0] == 0 and max(lags) <= 2 and max(lags) >= 1  # the engines really ran ahead
    assert all(mean <= lag for (_, mean), lag in zip(history["training/staleness/mean"], lags))
    # Older samples carry importance weights: the trainer's recomputed policy differs from the one that sampled.
    assert all(math.isfinite(v) for _, v in history["rollout_corr/is_weight_mean"])
    assert all(math.isfinite(v) for _, v in history["actor/pg_loss"])
    assert len(history["timing_s/wait_rollout"]) == 4
