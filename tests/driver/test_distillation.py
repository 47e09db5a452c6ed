"""On-policy distillation (algorithm.distill, the `teacher` role): the advantage the fit loop trains on, worked out by
hand on the pure-Python rig (tests/driver/fit_rig.py), and a real run: the quickstart's random model distilled from a
quickstart run that solves the task, with no task reward in its advantages."""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.driver.fit_rig import FakeRanks, run_rig
from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[2]
TEACHER = "teacher.path=configs/quickstart/model"  # the rig's ranks are fake: only its config.json is read


def distilled(tmp_path, *overrides, log_prob=0.0, teacher_log_prob=-2.0, reward=None):
    ranks = FakeRanks(log_prob=log_prob, teacher_log_prob=teacher_log_prob)
    kwargs = {"reward": reward} if reward is not None else {}
    return run_rig(tmp_path, TEACHER, *overrides, ranks=ranks, **kwargs)


def test_distillation_alone_trains_on_minus_coef_times_the_reverse_kl_and_ignores_the_reward(tmp_path):
    """The fake engine samples with log-prob -0.5 per token and the teacher scores -2: each response token's advantage
    is -3 * (-0.5 - (-2)) = -4.5, 0 outside the response, whatever the reward; the teacher runs once a step."""
    rig = distilled(tmp_path / "a", "algorithm.distill.coef=3", "algorithm.distill.only=true")
    other = distilled(tmp_path / "b", "algorithm.distill.coef=3", "algorithm.distill.only=true",
                      reward=lambda inputs: [float(i % 3) for i in range(len(inputs))])
    for run in (rig, other):
        assert run.ranks.calls.count("compute_teacher_log_prob") == 2
        assert "compute_log_prob" not in run.ranks.calls  # on-policy: the engine's log-probs are the student's
        for batch in run.ranks.updates["actor"]:
            mask = batch.response_mask.bool()
            assert mask.any() and (~mask).any()
            assert torch.equal(batch.advantages[mask], torch.full((int(mask.sum()),), -4.5))
            assert (batch.advantages[~mask] == 0).all() and torch.equal(batch.returns, batch.advantages)
        assert run.history["distill/reverse_kl"] == [(1, 1.5), (2, 1.5)]
        assert run.history["distill/teacher_logp_mean"] == [(1, -2.0), (2, -2.0)]
    assert rig.history["critic/score/mean"] != other.history["critic/score/mean"]  # the rewards did differ


def test_distillation_adds_to_the_task_advantage_and_reads_the_old_log_probs_when_the_step_has_them(tmp_path):
    """only=false: GRPO's advantage of the reward plus the teacher's term. With two PPO epochs the step computes the
    actor's old log-probs (0 here), and the term is the one of those: -1 * (0 - (-2)) = -2 on every response token."""
    plain = run_rig(tmp_path / "plain", "actor.ppo_epochs=2")
    rig = distilled(tmp_path / "added", "actor.ppo_epochs=2", "algorithm.distill.coef=1")
    assert "compute_log_prob" in rig.ranks.calls and "compute_teacher_log_prob" not in plain.ranks.calls
    for base, batch in zip(plain.ranks.updates["actor"], rig.ranks.updates["actor"]):
        mask = batch.response_mask.bool()
        assert torch.equal(batch.advantages[mask], base.advantages[mask] - 2.0)
        assert torch.equal(batch.returns, base.returns)
        assert base.advantages[mask].abs().max() > 0
    assert rig.history["distill/reverse_kl"] == [(1, 2.0), (2, 2.0)]


# --- a real run: the quickstart's model distilled from a solved quickstart run, against GRPO ---

VALIDATION = "val/next_digit/score/mean"
# Both runs validate every 5 steps (greedy, 64 prompts), no checkpoints; the teacher is the quickstart's GRPO run.
COMMON = ["trainer.test_freq=5", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume=disable",
          "tracking.backends=[console]"]
TEACHER_STEPS = 150  # the quickstart's length; GRPO reaches 0.8 at step 65 on the way
DISTILL_STEPS = 60


def train(out: Path, *overrides: str) -> dict:
    run = warm_runs.run([sys.executable, "-m", "tests.driver.jobs", str(out), "launched", *COMMON, *overrides],
                        cwd=REPO_ROOT, timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """GRPO from the reward alone (the quickstart, which becomes the teacher: its HF export), then the same random
    model distilled from it with algorithm.distill.only=true (and the group-mean baseline)."""
    tmp = tmp_path_factory.mktemp("distill")
    grpo = train(tmp / "grpo.json", f"trainer.run_dir={tmp / 'grpo'}", f"trainer.total_steps={TEACHER_STEPS}")
    distill = train(tmp / "distill.json", f"trainer.run_dir={tmp / 'distill'}",
                    f"trainer.total_steps={DISTILL_STEPS}", f"teacher.path={grpo['exported_hf']}",
                    "algorithm.distill.only=true", "algorithm.distill.baseline=group_mean")
    return grpo, distill


def first_step_at(history: dict, threshold: float) -> int | None:
    return next((step for step, value in history[VALIDATION] if value >= threshold), None)


def test_the_quickstart_model_distilled_from_a_solved_run_reaches_0_8_in_fewer_steps_than_grpo(runs):
    grpo, distill = runs
    assert grpo["history"][VALIDATION][-1][1] == 1.0  # the teacher solves the task (greedy, every prompt)
    history = distill["history"]
    distilled, rewarded = first_step_at(history, 0.8), first_step_at(grpo["history"], 0.8)
    assert distilled is not None and rewarded is not None, (history[VALIDATION], grpo["history"][VALIDATION])
    assert distilled < rewarded, (history[VALIDATION], grpo["history"][VALIDATION])
    kl = [value for _, value in history["distill/reverse_kl"]]
    teacher = [value for _, value in history["distill/teacher_logp_mean"]]
    assert len(kl) == DISTILL_STEPS
    # The student's samples move towards the teacher: the reverse KL falls, the teacher likes them more.
    assert sum(kl[-10:]) / 10 < 0.8 * sum(kl[:10]) / 10
    assert sum(teacher[-10:]) / 10 > sum(teacher[:10]) / 10 + 1.0
