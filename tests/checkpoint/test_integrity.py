"""Checkpoint integrity: the manifest's size check, and on 2 gloo ranks a load that fails midway (a file damaged in
place, its size intact) named by file, then a reload of the previous checkpoint that leaves nothing of it."""
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlmegatron.checkpoint.integrity import MANIFEST, manifest_problem, write_manifest
from rlmegatron.transport.local_ranks import run_ranks


def _training_state(actor) -> list[torch.Tensor]:
    """Every weight, and every Adam moment and step count, of this rank, in a fixed order."""
    from rlmegatron.rank.roles.megatron_step import unwrap

    tensors = [p.detach().clone() for chunk in actor.chunks for p in unwrap(chunk).parameters()]
    for optimizer in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.optimizer.state[param]
                tensors += [torch.as_tensor(state[key]).clone() for key in sorted(state)]
    return tensors


def _differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    assert len(a) == len(b)
    return sum(not torch.equal(x, y) for x, y in zip(a, b))


def fallback_job(workdir: str) -> dict:
    from rlmegatron.checkpoint.integrity import CheckpointLoadFailed, load_failures_named
    from rlmegatron.rank.checkpoint_state import load_training_state, save_training_state
    from rlmegatron.runtime import ParallelLayout
    from tests.rank.roles.jobs import make_actor, rollout_batch

    older, newer = os.path.join(workdir, "step_1"), os.path.join(workdir, "step_2")
    batch = rollout_batch()
    actor = make_actor(ParallelLayout())  # DP=2: each rank holds its own shard of the Adam state
    log_probs, _ = actor.compute_log_prob(batch)
    batch = replace(batch, old_log_probs=log_probs - 0.05 * batch.response_mask)
    actor.update(batch)
    save_training_state(actor, older)
    actor.update(batch)
    save_training_state(actor, newer)
    load_training_state(actor, older)
    clean = _training_state(actor)
    if torch.distributed.get_rank() == 0:
        for shard in Path(newer).glob("*.distcp"):  # the last eighth of every shard: the reader fails late
            size = shard.stat().st_size
            with open(shard, "r+b") as handle:
                handle.seek(size - size // 8)
                handle.write(b"\0" * (size // 8))
    torch.distributed.barrier()
    try:
        with load_failures_named(newer):
            load_training_state(actor, newer)
        message = None
    except CheckpointLoadFailed as failed:
        message = str(failed)
    half_loaded = _differing(_training_state(actor), clean)
    with load_failures_named(older):  # the fallback: the previous checkpoint, whole
        load_training_state(actor, older)
    return {"message": message, "half_loaded": half_loaded, "differing_after_reload": _differing(
        _training_state(actor), clean), "tensors": len(clean), "newer": newer}


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    return run_ranks(fallback_job, 2, str(tmp_path_factory.mktemp("fallback")), timeout_s=300)


def test_a_load_that_fails_midway_names_the_file_on_every_rank(fallback):
    for rank in fallback:
        assert rank["message"] is not None
        file, _, reason = rank["message"].partition(": ")
        assert Path(file).parent == Path(rank["newer"]) and file.endswith(".distcp"), rank["message"]
        assert reason and "\n" not in reason


def test_reloading_the_previous_checkpoint_leaves_nothing_of_the_failed_load(fallback):
    # The failed load did overwrite part of the state, so the reload has something to undo.
    assert sum(rank["half_loaded"] for rank in fallback) > 0
    assert [rank["differing_after_reload"] for rank in fallback] == [0, 0]
    assert all(rank["tensors"] > 10 for rank in fallback)


def _fake_checkpoint(directory: Path, step: int = 3) -> dict[str, int]:
    (directory / "actor").mkdir(parents=True)
    (directory / "actor" / "__0_0.distcp").write_bytes(b"x" * 100)
    (directory / "actor" / ".metadata").write_bytes(b"m" * 7)
    (directory / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(directory, step)
    return json.loads((directory / MANIFEST).read_text())["files"]


def test_manifest_lists_every_file_with_its_size(tmp_path):
    files = _fake_checkpoint(tmp_path / "step_3")
    assert files == {"actor/.metadata": 7, "actor/__0_0.distcp": 100, "trainer_state.json": 11}
    assert manifest_problem(tmp_path / "step_3") is None
    assert not list((tmp_path / "step_3").glob(".*.tmp"))  # written through a temporary file, replaced atomically


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / MANIFEST).unlink(), "no manifest.json (its save did not finish)"),
    (lambda d: os.truncate(d / "actor" / "__0_0.distcp", 60), "actor/__0_0.distcp has 60 bytes, its manifest says 100"),
    (lambda d: (d / "actor" / ".metadata").unlink(), "actor/.metadata is missing"),
    (lambda d: (d / MANIFEST).write_text("{\"files\": "), "manifest.json is unreadable (JSONDecodeError"),
], ids=["no-manifest", "truncated", "missing", "bad-manifest"])
def test_an_incomplete_checkpoint_says_why(tmp_path, damage, problem):
    _fake_checkpoint(tmp_path)
    damage(tmp_path)
    assert manifest_problem(tmp_path).startswith(problem)


def test_every_bad_file_is_counted(tmp_path):
    _fake_checkpoint(tmp_path)
    os.truncate(tmp_path / "actor" / "__0_0.distcp", 1)
    (tmp_path / "trainer_state.json").unlink()
    assert manifest_problem(tmp_path) == "actor/__0_0.distcp has 1 bytes, its manifest says 100 (and 1 more files)"
