"""HF <-> Megatron conversion of every family at TP/PP/EP layouts on 4 CPU ranks: logits and bitwise round trips."""
from __future__ import annotations

import pytest

from rlmegatron.runtime import ParallelLayout

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.conversion_jobs import _max_diff, convert_job, layouts_for, reload_job
from tests.models.tiny_hf import FAMILIES, VARIANTS, save_tiny_model, saved_mtp_layers

LOGIT_TOLERANCE = 1e-4
MATRIX_TIMEOUT_S = 600  # a bound on a hang for the whole matrix (every family/layout pair), not a speed test
CHECKPOINTS = FAMILIES + tuple(VARIANTS)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every rank's report of the conversions (convert_job), and the one rank's of the checks after them."""
    workdir = str(tmp_path_factory.mktemp("convert"))
    for name in CHECKPOINTS:
        save_tiny_model(name, f"{workdir}/{name}/hf")
    # One process group for every conversion: each forked rank builds Megatron's state once.
    converted = run_ranks(convert_job, 4, list(CHECKPOINTS), workdir, timeout_s=MATRIX_TIMEOUT_S)
    return converted, run_ranks(reload_job, 1, list(CHECKPOINTS), workdir, timeout_s=MATRIX_TIMEOUT_S)[0]


# The fixture runs inside the first test, so that test carries the matrix's time limit too.
@pytest.mark.timeout(2 * MATRIX_TIMEOUT_S + 60)
@pytest.mark.parametrize("family", CHECKPOINTS)
def test_every_layout_matches_hf_and_round_trips_bitwise(reports, family):
    converted, checked = reports
    for layout in layouts_for(family):
        label = f"{family}/{layout}"
        entries, entry = [report[label] for report in converted], checked[label]
        # The sharded model's logits on each of its last stage's ranks (TP-gathered there).
        logit_diffs = [_max_diff(entry["reference"], e["logits"]) for e in entries if e["logits"] is not None]
        assert len(logit_diffs) == 4 // layout.pp and max(logit_diffs) < LOGIT_TOLERANCE, (label, logit_diffs)
        # A DeepSeek-V3 saved by transformers has no MTP tensors: converted without MTP layers, not refused.
        assert {e["mtp_layers"] for e in entries} == {saved_mtp_layers(family)}, label
        assert entry["reloaded_tp1_logits_vs_hf"] < LOGIT_TOLERANCE, label
        # An MTP layer (DeepSeek's, GLM's), which transformers ignores, against DeepSeek-V3's definition of it.
        assert ("reloaded_tp1_mtp_logits_vs_hf" in entry) == bool(saved_mtp_layers(family)), label
        if "reloaded_tp1_mtp_logits_vs_hf" in entry:
            assert entry["reloaded_tp1_mtp_logits_vs_hf"] < LOGIT_TOLERANCE, label
        # Exported from the sharded layout, and from the checkpoint reloaded at TP=PP=EP=1; DeepSeek's MTP
        # layers included, with their copies of the embedding and head.
        for export in ("exported", "reloaded_exported"):
            assert entry[export] == {"key_mismatch": [], "not_bitwise": []}, (label, export, entry[export])
        # The exported directory loads with transformers' from_pretrained and gives the original logits.
        assert entry["from_pretrained_logits_vs_hf"] < LOGIT_TOLERANCE, label


def test_cli_vpp_etp_and_uneven_pipeline_flags_reach_the_layout_and_the_rank_count():
    from rlmegatron.entry.convert_command import _layout, build_parser, default_nproc

    args = build_parser().parse_args(["hf-to-mcore", "--hf-path", "hf", "--out", "mcore", "--tp", "2", "--pp", "2",
                                      "--vpp", "2", "--ep", "2", "--etp", "1"])
    layout = _layout(args)
    # Sequence parallelism is the model's to ask for (experts at TP > 1); "hf" holds no model with experts.
    assert layout == ParallelLayout(tp=2, pp=2, vpp=2, ep=2, etp=1, sequence_parallel=False)
    assert default_nproc(layout) == 4  # TP2 dense and EP2 x ETP1 experts share each stage's 2 ranks
    assert default_nproc(ParallelLayout(ep=2, etp=2)) == 4 and default_nproc(ParallelLayout(tp=2, ep=2)) == 4
    uneven = build_parser().parse_args(["mcore-to-hf", "--mcore-path", "mcore", "--out", "hf", "--pp", "4",
                                        "--first-stage-layers", "1", "--last-stage-layers", "2"])
    assert _layout(uneven) == ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=2)
