"""CheckpointManager against fake ranks: the manifest is written last, nothing complete is overwritten, resume=auto
skips (and names) what is incomplete or does not load, and refuses where starting would lose data; then the same
refusals through `rlm train`: exit 2, one line per problem, no traceback, no worker started."""
import json
import os
from pathlib import Path

import pytest

from rlmegatron.checkpoint import CheckpointError, CheckpointLoadFailed, CheckpointManager
from rlmegatron.checkpoint import manager as manager_module
from rlmegatron.checkpoint.integrity import MANIFEST

REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeRanks:
    """2 trainer ranks: each saves one shard, a load fails (as a rank's would) for the named steps."""

    def __init__(self, unloadable: tuple[str, ...] = ()) -> None:
        self.unloadable = set(unloadable)
        self.loads: list[str] = []

    def save_checkpoint(self, path: str) -> None:
        directory = Path(path)
        (directory / "actor").mkdir()
        for rank in range(2):
            (directory / "actor" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 64)

    def load_checkpoint(self, path: str) -> None:
        directory = Path(path)
        self.loads.append(directory.name)
        if directory.name in self.unloadable:
            raise CheckpointLoadFailed(f"{directory / 'actor' / '__1_0.distcp'}: EOFError: Ran out of input")


def saved(tmp_path: Path, steps, max_to_keep=None) -> tuple[CheckpointManager, list[str]]:
    warnings: list[str] = []
    manager = CheckpointManager(tmp_path, max_to_keep, warn=warnings.append)
    for step in steps:
        manager.save(step, FakeRanks(), {"step": step})
    return manager, warnings


def listing(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_manifest_is_written_last_and_the_checkpoint_appears_only_after_it(tmp_path, monkeypatch):
    seen = {}
    write_manifest = manager_module.write_manifest

    def spy(directory, step):
        seen["files"] = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
        seen["published"] = (directory.parent / f"step_{step}").exists()
        write_manifest(directory, step)

    monkeypatch.setattr(manager_module, "write_manifest", spy)
    manager, _ = saved(tmp_path, [1])
    step_1 = tmp_path / "checkpoints" / "step_1"
    assert seen == {"files": ["actor/__0_0.distcp", "actor/__1_0.distcp", "trainer_state.json"], "published": False}
    manifest = json.loads((step_1 / MANIFEST).read_text())
    assert manifest == {"step": 1, "files": {"actor/__0_0.distcp": 64, "actor/__1_0.distcp": 64,
                                             "trainer_state.json": len(json.dumps({"step": 1}, indent=2))}}
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_1" and manager.latest() == step_1


def test_a_save_stopped_before_its_manifest_leaves_the_previous_checkpoint_the_newest(tmp_path, monkeypatch):
    manager, _ = saved(tmp_path, [1])

    def killed(directory, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(manager_module, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, FakeRanks(), {"step": 2})
    assert [c.step for c, _ in manager.checkpoints()] == [1]
    assert manager.latest() == tmp_path / "checkpoints" / "step_1"
    assert manager.plan_resume("auto").step == 1


def test_a_save_never_overwrites_an_existing_checkpoint(tmp_path):
    manager, _ = saved(tmp_path, [1, 2])
    before = listing(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'checkpoints' / 'step_2'} already exists; not overwriting"):
        manager.save(2, FakeRanks(), {"step": 2})
    assert listing(tmp_path) == before


def test_resume_auto_skips_incomplete_checkpoints_naming_each_and_resumes_from_the_newest_complete(tmp_path):
    manager, warnings = saved(tmp_path, [1, 2, 3, 4, 5])
    root = tmp_path / "checkpoints"
    (root / "step_5" / MANIFEST).unlink()
    os.truncate(root / "step_4" / "actor" / "__1_0.distcp", 10)
    (root / "step_3" / "trainer_state.json").unlink()
    (root / "latest").write_text("step_9")
    assert manager.plan_resume("auto").step == 2
    assert warnings == [
        f"checkpoint {root / 'step_5'}: no manifest.json (its save did not finish); skipped",
        f"checkpoint {root / 'step_4'}: actor/__1_0.distcp has 10 bytes, its manifest says 64; skipped",
        f"checkpoint {root / 'step_3'}: trainer_state.json is missing; skipped",
        f"checkpoint {root / 'latest'}: names 'step_9', which does not exist; skipped",
    ]
    ranks = FakeRanks()
    path, state = manager.load_resume_point(ranks)
    assert (path, state, ranks.loads) == (root / "step_2", {"step": 2}, ["step_2"])
    # Kept under another name, out of the way of steps 3-5, which this run writes again.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2", "step_3.invalid",
                                                      "step_4.invalid", "step_5.invalid"]
    assert (root / "latest").read_text() == "step_2"
    manager.save(3, FakeRanks(), {"step": 3})
    assert (root / "step_3.invalid" / "actor").is_dir() and manager.latest() == root / "step_3"


def test_a_complete_checkpoint_that_does_not_load_falls_back_to_the_one_before(tmp_path):
    manager, warnings = saved(tmp_path, [1, 2, 3])
    root = tmp_path / "checkpoints"
    assert manager.plan_resume("auto").step == 3
    ranks = FakeRanks(unloadable=("step_3",))
    path, state = manager.load_resume_point(ranks)
    assert (path, state["step"], ranks.loads) == (root / "step_2", 2, ["step_3", "step_2"])
    assert warnings == [f"checkpoint {root / 'step_3'}: does not load: actor/__1_0.distcp: EOFError: Ran out of "
                        "input; falling back to the one before it",
                        f"checkpoint {root / 'step_3'} renamed to step_3.invalid"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2", "step_3.invalid"]


def test_when_no_checkpoint_is_usable_the_run_refuses_and_moves_nothing(tmp_path):
    manager, _ = saved(tmp_path, [1, 2])
    root = tmp_path / "checkpoints"
    (root / "step_2" / MANIFEST).unlink()
    os.truncate(root / "step_1" / "actor" / "__0_0.distcp", 0)
    before = listing(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        manager.plan_resume("auto")
    assert str(refused.value).splitlines() == [
        f"trainer.resume=auto: no usable checkpoint in {root}:",
        "  step_2: no manifest.json (its save did not finish)",
        "  step_1: actor/__0_0.distcp has 0 bytes, its manifest says 64",
        "fix: trainer.resume=disable starts fresh in this run_dir (these are kept, renamed to step_N.invalid), a new "
        "trainer.run_dir starts fresh elsewhere, and trainer.resume=PATH loads a checkpoint you name",
    ]
    assert listing(tmp_path) == before


def test_when_no_complete_checkpoint_loads_the_run_refuses_and_moves_nothing(tmp_path):
    manager, _ = saved(tmp_path, [1, 2])
    manager.plan_resume("auto")
    before = listing(tmp_path)
    ranks = FakeRanks(unloadable=("step_1", "step_2"))
    with pytest.raises(CheckpointError) as refused:
        manager.load_resume_point(ranks)
    lines = str(refused.value).splitlines()
    assert lines[1:3] == ["  step_2: does not load: actor/__1_0.distcp: EOFError: Ran out of input",
                          "  step_1: does not load: actor/__1_0.distcp: EOFError: Ran out of input"]
    assert ranks.loads == ["step_2", "step_1"] and listing(tmp_path) == before


def test_resume_disable_refuses_to_start_over_complete_checkpoints_and_sets_incomplete_ones_aside(tmp_path):
    manager, warnings = saved(tmp_path, [2, 4])
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as refused:
        manager.plan_resume("disable")
    assert str(refused.value) == (
        f"trainer.resume=disable, but {root} holds complete checkpoints (step_4, step_2) that a fresh start would "
        f"overwrite; give a new trainer.run_dir to start fresh, or trainer.resume=auto to continue from step_4")
    for step in (2, 4):
        (root / f"step_{step}" / MANIFEST).unlink()
    assert manager.plan_resume("disable") is None
    assert manager.load_resume_point(FakeRanks()) is None
    assert sorted(p.name for p in root.iterdir()) == ["step_2.invalid", "step_4.invalid"]  # no `latest`: none left
    assert warnings[-2:] == [f"checkpoint {root / 'step_4'} renamed to step_4.invalid",
                             f"checkpoint {root / 'step_2'} renamed to step_2.invalid"]


def test_an_explicit_resume_path_must_be_complete_loadable_and_the_newest(tmp_path):
    manager, _ = saved(tmp_path / "a", [1, 2])
    a = tmp_path / "a" / "checkpoints"
    (a / "step_2" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError) as refused:
        CheckpointManager(tmp_path / "b").plan_resume(str(a / "step_2"))
    assert str(refused.value).startswith(f"trainer.resume={a / 'step_2'}: not a complete checkpoint: "
                                         "trainer_state.json has 2 bytes, its manifest says ")
    # Complete but it does not load: no fallback to step_1, the user asked for step_2.
    other = CheckpointManager(tmp_path / "b")
    assert other.plan_resume(str(a / "step_1")).step == 1
    ranks = FakeRanks(unloadable=("step_1",))
    with pytest.raises(CheckpointError, match=r"^trainer.resume=.*step_1: does not load: actor/__1_0.distcp: "
                                              r"EOFError: Ran out of input; name another checkpoint"):
        other.load_resume_point(ranks)
    assert ranks.loads == ["step_1"]
    fresh = CheckpointManager(tmp_path / "d")  # a new run_dir: nothing there to overwrite
    assert fresh.plan_resume(str(a / "step_1")).step == 1
    assert fresh.load_resume_point(FakeRanks()) == (a / "step_1", {"step": 1})
    # Resuming from step_1 inside a run_dir whose step_2 is complete would overwrite step_2.
    manager, _ = saved(tmp_path / "c", [1, 2])
    c = tmp_path / "c" / "checkpoints"
    with pytest.raises(CheckpointError, match=r"is step 1, but .* holds newer complete checkpoints \(step_2\)"):
        manager.plan_resume(str(c / "step_1"))


def test_max_to_keep_deletes_only_the_oldest_complete_checkpoints(tmp_path):
    manager, _ = saved(tmp_path, [1, 2, 3], max_to_keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    (root / "step_1.invalid").mkdir()  # set aside by an earlier resume: never pruned
    manager.save(4, FakeRanks(), {"step": 4})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1.invalid", "step_3", "step_4"]


# --- through `rlm train`: the user's problems are one line each, exit 2, before any worker starts ---


@pytest.fixture
def rlm_train(monkeypatch):
    from rlmegatron.entry.cli import main
    from rlmegatron.driver import job

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(job, "start_ray", lambda spec: pytest.fail("a worker was started"))
    monkeypatch.setattr(job, "RankProcesses", lambda *args: pytest.fail("a worker was started"))
    return lambda *overrides: main(["train", "configs/quickstart.yaml", *overrides])


def test_rlm_train_refuses_a_run_dir_with_no_usable_checkpoint(tmp_path, rlm_train, capsys):
    saved(tmp_path, [1])
    (tmp_path / "checkpoints" / "step_1" / MANIFEST).unlink()
    assert rlm_train(f"trainer.run_dir={tmp_path}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"  step_1: no manifest.json (its save did not finish)\nfix: trainer.resume=disable starts fresh" in err
    assert (tmp_path / "checkpoints" / "step_1").is_dir()


@pytest.mark.parametrize("resume, says", [
    ("disable", "trainer.resume=disable, but {root} holds complete checkpoints (step_1) that a fresh start would "
                "overwrite; give a new trainer.run_dir to start fresh, or trainer.resume=auto to continue from step_1"),
    ("{root}/step_1/actor", "trainer.resume={root}/step_1/actor: not a complete checkpoint: no manifest.json (its "
                            "save did not finish); name a checkpoint directory (step_N), or use trainer.resume=auto"),
], ids=["disable", "path"])
def test_rlm_train_names_a_resume_setting_that_would_lose_data_or_is_not_a_checkpoint(tmp_path, rlm_train, capsys,
                                                                                       resume, says):
    saved(tmp_path, [1])
    root = tmp_path / "checkpoints"
    assert rlm_train(f"trainer.run_dir={tmp_path}", f"trainer.resume={resume.format(root=root)}") == 2
    assert capsys.readouterr().err == says.format(root=root) + "\n"
