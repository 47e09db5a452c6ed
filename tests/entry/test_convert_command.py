"""`rlm convert`'s choices before and after its ranks run: the dtype a conversion writes by default, and what a verify
that misses its bound says; and every family through the commands at TP=2 and back. The ranks' own work, at every
layout: tests/models/test_conversion.py."""
import json
import os

import pytest

from rlmegatron.entry import convert_command
from rlmegatron.models.convert import ConvertMeta
from rlmegatron.models.families import FAMILIES


@pytest.fixture
def ranks(monkeypatch):
    """run_ranks, recorded and answered with `ranks.results`; the checks before it pass."""
    import rlmegatron.transport.local_ranks as local_ranks

    class Ranks:
        calls, results = [], [None]

    def run_ranks(fn, nproc, direction, args, **kwargs):
        Ranks.calls.append(args)
        return Ranks.results

    monkeypatch.setattr(local_ranks, "run_ranks", run_ranks)
    monkeypatch.setattr(convert_command, "preflight", lambda args, layout: None)
    return Ranks


def hf_dir(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("config, written", [
    ({"dtype": "float32"}, "fp32"),  # transformers 5
    ({"torch_dtype": "float16"}, "fp16"),  # before it
    ({"dtype": "float32", "quantization_config": {"quant_method": "fp8"}}, "bf16"),  # block-FP8 weights
    ({}, "bf16"),
])
def test_hf_to_mcore_writes_the_models_own_dtype_unless_told(tmp_path, ranks, config, written):
    out = ["--out", str(tmp_path / "out"), "--device", "cpu"]
    assert convert_command.main(["hf-to-mcore", "--hf-path", hf_dir(tmp_path / "hf", **config), *out]) == 0
    assert convert_command.main(["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), *out, "--dtype", "bf16"]) == 0
    assert [call["dtype"] for call in ranks.calls] == [written, "bf16"]


def test_a_verify_missed_by_rounding_says_so(tmp_path, ranks, capsys):
    mcore = tmp_path / "mcore"
    mcore.mkdir()
    ConvertMeta(hf_config={}, padded_vocab_size=128, dtype="bf16", stacked_experts=False).save(mcore)
    ranks.results = [{"max_abs_diff": 2.287e-3, "cosine": 0.99999475}]
    args = ["verify", "--hf-path", hf_dir(tmp_path / "hf", dtype="float32"), "--mcore-path", str(mcore)]
    assert convert_command.main([*args, "--device", "cpu"]) == convert_command.EXIT_BEYOND_TOLERANCE
    out, err = capsys.readouterr()
    assert out == "logits max_abs_diff=2.287e-03 cosine=0.99999475 (tolerance 0.001)\n"
    assert err == ("rlm convert verify: the Megatron checkpoint holds bf16 weights and the model is fp32: the "
                   "rounding alone moves the logits; convert with hf-to-mcore --dtype fp32 to compare like with like, "
                   "or allow for it with --tolerance\n")


def _safetensors(directory) -> dict:
    from safetensors.torch import load_file

    return {k: v for name in sorted(os.listdir(directory)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, name)).items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_converts_through_the_commands_at_tp2_and_back_bitwise(tmp_path, family):
    """`rlm convert hf-to-mcore` then `mcore-to-hf` as commands (their flags, preflight, ranks) for every family at
    TP=2, with EP=2 for one with experts (expert TP 1: gpt-oss's biased experts need it): the checkpoint comes back
    with the same tensors, bitwise. Sequence parallelism only where Megatron needs it: a vision-language model
    refuses it, and `--tp 2` must still convert one."""
    import torch

    from rlmegatron.models.families import read_architecture
    from tests.models.tiny_hf import save_tiny_model
    from tests.models.tiny_vl import VL_FAMILIES, save_tiny_vl

    hf, mcore, back = (str(tmp_path / name) for name in ("hf", "mcore", "back"))
    save_tiny_vl(hf, model_type=family) if family in VL_FAMILIES else save_tiny_model(family, hf)
    layout = ["--tp", "2"] + (["--ep", "2", "--etp", "1"] if read_architecture(hf).is_moe else [])
    assert convert_command.main(["hf-to-mcore", "--hf-path", hf, "--out", mcore, *layout, "--device", "cpu"]) == 0
    assert convert_command.main(["mcore-to-hf", "--mcore-path", mcore, "--out", back, *layout, "--device", "cpu"]) == 0
    original, again = _safetensors(hf), _safetensors(back)
    assert original.keys() == again.keys()
    assert [k for k in original if not torch.equal(original[k], again[k])] == []
