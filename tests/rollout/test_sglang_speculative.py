"""rollout.speculative with SGLang engines: the launch's flags as SGLang 0.5.23's own ServerArgs resolves them (MTP
drafting: NEXTN, the checkpoint's MTP layer as the draft, k chained drafts of one candidate each), and the draft
model SGLang builds from those arguments (its *NextN class) loading every parameter of its MTP layer from the names
the weight sync streams (tests/rollout/sglang_cpu/name_loading.py, as test_sglang_names.py checks the target)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import save_tiny_model
from tests.rollout.test_sglang_names import stream_job

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
MTP_FAMILIES = ("deepseek_v3", "glm4_moe")
DRAFTS = 3


def launch_argv(model_dir: str) -> list[str]:
    """The SGLang server's command line (without interpreter and module) for a CPU server of `model_dir` with
    MTP speculative decoding of DRAFTS tokens, as the job's launch builds it."""
    from rlmegatron.config.spec import RolloutConfig
    from rlmegatron.driver.role_settings import server_spec
    from rlmegatron.rollout.sglang.server import server_command

    rollout = RolloutConfig(speculative={"method": "mtp", "num_draft_tokens": DRAFTS},
                            sglang={"enable_memory_saver": False})
    return server_command(server_spec(rollout, model_dir, port=30000, device="cpu"))[3:]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sglang_speculative")
    for family in MTP_FAMILIES:
        save_tiny_model(family, str(workdir / family))
    return workdir


def test_mtp_speculative_rollout_launches_sglang_drafting_k_tokens_with_the_checkpoints_mtp_layer(models):
    from rlmegatron.config.spec import RolloutConfig
    from rlmegatron.driver.role_settings import server_spec
    from rlmegatron.rollout.sglang.server import server_command
    from tests.helpers.sglang_args import resolved_by_sglang

    model_dir = str(models / "deepseek_v3")
    names = ["speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
             "speculative_num_draft_tokens", "speculative_draft_model_path"]
    resolved, stderr = resolved_by_sglang(launch_argv(model_dir), names)
    # NEXTN is SGLang's alias of EAGLE with the target checkpoint itself as the draft model (its MTP layer).
    assert resolved == {"speculative_algorithm": "EAGLE", "speculative_num_steps": DRAFTS,
                        "speculative_eagle_topk": 1, "speculative_num_draft_tokens": DRAFTS + 1,
                        "speculative_draft_model_path": model_dir}
    assert "is adjusted" not in stderr  # SGLang kept the launch's draft-token count: k + 1 at top-k 1
    plain = server_command(server_spec(RolloutConfig(), model_dir, port=30000))
    assert not [flag for flag in plain if flag.startswith("--speculative")]


def test_sglangs_draft_model_loads_its_mtp_layer_from_the_synced_names(models):
    run_ranks(stream_job, 1, list(MTP_FAMILIES), str(models))
    job = {"models": {family: {"model": str(models / family), "tensors": str(models / f"{family}.safetensors"),
                               "args": launch_argv(str(models / family)), "draft": True}
                      for family in MTP_FAMILIES},
           "tp": [1, 2]}
    answer = subprocess.run([sys.executable, str(HERE / "sglang_cpu" / "name_loading.py"), json.dumps(job)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "sglang_cpu"),
                                                                              str(REPO_ROOT)])})
    assert answer.returncode == 0, answer.stderr[-3000:]
    loaded = json.loads(answer.stdout.splitlines()[-1])
    for family in MTP_FAMILIES:
        assert "error" not in loaded[family], loaded[family]
        for rank, report in loaded[family].items():
            # enorm, hnorm, eh_proj, shared_head.norm and the MTP layer's attention and (MoE) MLP
            assert report["parameters"] >= 15, (family, rank)
            assert report["unfilled"] == [] and report["differ"] == [], (family, rank, report)
