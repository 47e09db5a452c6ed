"""Every family's weight sync, read by SGLang 0.5.23's own model class for it (tests/rollout/sglang_cpu/name_loading.py,
on CPU): the names and shapes the sync streams are the ones SGLang's `load_weights` maps onto its parameters, at TP 1
and 2. SGLang skips a name it has no parameter for without a word, so a wrong name would leave a parameter of the
rollout model unloaded: here every parameter must have been written, and each one SGLang takes as one HF tensor
must hold that tensor's slice."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import FAMILIES, save_tiny_model

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
TP_SIZES = (1, 2)


def stream_job(families: list[str], workdir: str) -> None:
    """Each family's tiny checkpoint converted at TP=1, and what the weight sync's exporter streams of it saved."""
    from safetensors.torch import save_file

    from rlmegatron.models.convert import import_hf
    from rlmegatron.resharding.export import export_hf_weights
    from rlmegatron.runtime import ParallelLayout

    for family in families:
        _, weight_map, chunks = import_hf(os.path.join(workdir, family), ParallelLayout())
        save_file({name: tensor.contiguous() for name, tensor in export_hf_weights(chunks, weight_map)},
                  os.path.join(workdir, f"{family}.safetensors"))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sglang_names")
    for family in FAMILIES:
        save_tiny_model(family, str(workdir / family))
    run_ranks(stream_job, 1, list(FAMILIES), str(workdir))
    job = {"models": {f: {"model": str(workdir / f), "tensors": str(workdir / f"{f}.safetensors")} for f in FAMILIES},
           "tp": TP_SIZES}
    answer = subprocess.run([sys.executable, str(HERE / "sglang_cpu" / "name_loading.py"), json.dumps(job)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "sglang_cpu"),
                                                                              str(REPO_ROOT)])})
    assert answer.returncode == 0, answer.stderr[-3000:]
    return json.loads(answer.stdout.splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_loads_every_parameter_from_the_synced_names(loaded, family):
    assert "error" not in loaded[family], loaded[family]
    for rank, report in loaded[family].items():
        assert report["parameters"] > 0
        assert report["unfilled"] == [], (family, rank)
        assert report["differ"] == [], (family, rank)
