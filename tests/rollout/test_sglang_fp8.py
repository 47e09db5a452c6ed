"""FP8 rollout's weight sync read by SGLang 0.5.23's own block-FP8 loading (tests/rollout/sglang_cpu/fp8_loading.py,
on CPU): its Fp8Config from the quantization_config the servers are launched with, its fused QKV and gate/up linears
and row-parallel ones at TP 1 and 2, Qwen3's load_weights mapping `weight_scale_inv` onto them. SGLang then holds
exactly the values the local engine samples with: every scale block lands on its rows and columns."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmegatron.models.families import architecture_of
from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
# Each projection whole 128-row blocks per rank at TP 2 (q 2 blocks, k and v 1, gate and up 2), a partial last block
# of columns (320 = 2.5 blocks) and of o_proj's and down_proj's rows.
LAYER = dict(hidden=320, heads=8, kv_heads=4, head_dim=64, intermediate=512)
TP_SIZES = (1, 2)
# The quickstart's Qwen3: 64 rows of q_proj, which SGLang refuses in 128-row blocks.
REFUSED = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)


def _weights() -> dict[str, torch.Tensor]:
    """Layer 0's projections, bf16 as the actor holds them, under their HF names."""
    h, heads, kv, d, i = (LAYER[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate"))
    shapes = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
              "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
              "mlp.down_proj": (h, i)}
    generator = torch.Generator().manual_seed(0)
    return {f"model.layers.0.{name}.weight": (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """(what FP8 rollout's sync streams, dequantised as the local engine holds it; SGLang's dequantisation of what its
    linears hold per TP rank; the error SGLang raised for the refused sizes)."""
    workdir = tmp_path_factory.mktemp("sglang_fp8")
    synced = dict(FP8_ROLLOUT.quantised_stream(_weights().items()))  # the sync's quantisation of the stream
    save_file(synced, str(workdir / "synced.safetensors"))
    job = {"tensors": str(workdir / "synced.safetensors"), "quantization_config": FP8_ROLLOUT.config,
           "layer": LAYER, "tp": TP_SIZES, "out": str(workdir / "held.safetensors"), "refused_layer": REFUSED}
    answer = subprocess.run([sys.executable, str(HERE / "sglang_cpu" / "fp8_loading.py"), json.dumps(job)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "sglang_cpu"),
                                                                              str(REPO_ROOT)])})
    assert answer.returncode == 0, answer.stderr[-3000:]
    engine = {name.removesuffix(".weight"): FP8_ROLLOUT.dequantise(synced[name], synced[name + "_scale_inv"])
              for name in synced if name.endswith(".weight")}
    return engine, load_file(str(workdir / "held.safetensors")), json.loads(answer.stdout.splitlines()[-1])


@pytest.mark.parametrize("tp", TP_SIZES)
def test_sglangs_fp8_linears_hold_the_synced_weights_as_the_local_engine_does(sglang, tp):
    engine, held, _ = sglang
    layer = "model.layers.0"

    def rows(name, rank):  # a column-parallel projection's rows on TP rank `rank`
        return engine[f"{layer}.{name}"].chunk(tp, dim=0)[rank]

    for rank in range(tp):
        expected = {
            "self_attn.qkv_proj": torch.cat([rows(f"self_attn.{p}_proj", rank) for p in "qkv"]),
            "mlp.gate_up_proj": torch.cat([rows("mlp.gate_proj", rank), rows("mlp.up_proj", rank)]),
            "self_attn.o_proj": engine[f"{layer}.self_attn.o_proj"].chunk(tp, dim=1)[rank],
            "mlp.down_proj": engine[f"{layer}.mlp.down_proj"].chunk(tp, dim=1)[rank]}
        for linear, values in expected.items():
            got = held[f"tp{tp}.rank{rank}.{layer}.{linear}"]
            assert got.shape == values.shape and torch.equal(got, values), (linear, rank)
    # Not vacuous: the values are the FP8 ones, off the bf16 weights by the quantisation.
    gap = (engine[f"{layer}.mlp.up_proj"] - _weights()[f"{layer}.mlp.up_proj.weight"].float()).abs().max()
    assert 0 < gap < 0.1 * engine[f"{layer}.mlp.up_proj"].abs().max()


def test_sglang_refuses_the_sizes_the_spec_check_refuses(sglang):
    """The quickstart's sizes: SGLang raises while building the linear, on the 64 rows the check names."""
    from rlmegatron.config.checks import _sglang_fp8_unfit

    _, _, answer = sglang
    assert answer["refused"] == ("Weight output_partition_size = 64 is not divisible by weight quantization "
                                 "block_n = 128.")
    arch = architecture_of(json.loads((REPO_ROOT / "configs/quickstart/model/config.json").read_text()))
    assert [line.split(" would have ")[:2] for line in _sglang_fp8_unfit(arch, 1, 1)][0] == [
        "q_proj", "64 rows per rollout TP rank (64 in all), not whole 128-row FP8 scale blocks, and SGLang stacks it "
        "with the projections fused with it"]
