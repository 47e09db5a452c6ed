"""The export stream yields, on every rank and at every layout, exactly the HF tensors the model holds (bitwise)."""
import os
import stat

import pytest
import torch

from rlmegatron.resharding.export import save_safetensors
from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import save_tiny_model
from tests.resharding.export_jobs import export_job

CASES = [
    ("qwen3", L(tp=2, pp=2)),  # GQA interleave, GLU per-rank layout, tied embeddings across stages
    ("qwen3", L(tp=2)),
    ("qwen3_moe", L(ep=2, pp=2)),  # shards across stages, then experts gathered over EP under their global ids
    ("qwen3_moe", L(tp=2, ep=2, sequence_parallel=True)),  # expert TP (ETP=TP) plus EP
    ("deepseek_v3", L(tp=2, pp=2, sequence_parallel=True)),  # MLA, dense-first layers, expert bias
    ("deepseek_v3", L(ep=4)),
    ("llama", L(pp=2, vpp=2)),  # interleaved stages: two model chunks per rank
    ("qwen3_moe", L(tp=2, ep=2, etp=1, sequence_parallel=True)),  # experts whole, dense layers over TP
]


def test_stream_is_bitwise_the_source_checkpoint_at_every_layout(tmp_path):
    for family in {family for family, _ in CASES}:
        save_tiny_model(family, str(tmp_path / family))
    reports = run_ranks(export_job, 4, CASES, str(tmp_path), timeout_s=600)
    for rank, report in enumerate(reports):
        for case, result in report.items():
            assert result["count"] > 0, case
            assert not result["missing"], f"rank {rank} {case}: missing {result['missing'][:5]}"
            assert not result["extra"], f"rank {rank} {case}: unexpected {result['extra'][:5]}"
            assert not result["mismatched"], f"rank {rank} {case}: differs {result['mismatched'][:5]}"
            # Shards, not whole tensors, cross between stages: each weight's once.
            assert result["broadcast_bytes"] == result["shard_bytes"], case
    # At TP 2 x PP 2 that is about half of what the stream yields (the replicated norms go whole); at EP 2 x PP 2 the
    # experts' half (the tiny model's dense weights, whole on every EP rank, are most of it). Whole tensors: 1.
    ratio = {case: reports[0][case]["broadcast_bytes"] / reports[0][case]["streamed_bytes"]
             for case in (f"qwen3/{L(tp=2, pp=2)}", f"qwen3_moe/{L(ep=2, pp=2)}")}
    assert 0.4 < ratio[f"qwen3/{L(tp=2, pp=2)}"] < 0.6 and ratio[f"qwen3_moe/{L(ep=2, pp=2)}"] < 0.9, ratio


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_an_exported_safetensors_file_has_the_mode_the_umask_gives_as_its_other_files(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        save_safetensors({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text("{}")
    finally:
        os.umask(previous)
    assert [stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("model.safetensors", "config.json")] == [
        mode, mode]
