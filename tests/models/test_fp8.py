"""Block-wise FP8 checkpoints (DeepSeek-V3's and Qwen3-FP8's format): read as exactly their dequantised values at
TP=2, EP=2 and PP=2, and written back by `mcore-to-hf --fp8` byte for byte."""
from __future__ import annotations

import json

import pytest
import torch

from rlmegatron.models.fp8 import BlockFP8
from rlmegatron.runtime import ParallelLayout
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.conversion_jobs import fp8_job
from tests.models.fp8_checkpoints import BLOCK, dequantise_block_wise, quantise_block_wise, save_fp8_model

# A dense model split by TP (with a projection left unquantised), an MoE model's experts split by EP, and
# DeepSeek-V3 (MLA, shared experts, an MTP layer) over two pipeline stages.
CASES = {"qwen3": ParallelLayout(tp=2), "qwen3_moe": ParallelLayout(ep=2), "deepseek_v3": ParallelLayout(pp=2)}
NOT_CONVERTED = {"qwen3": ("model.layers.1.self_attn.o_proj",)}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fp8")
    for name in CASES:
        save_fp8_model(name, str(workdir / name), NOT_CONVERTED.get(name, ()))
    return run_ranks(fp8_job, 2, CASES, str(workdir), timeout_s=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", CASES)
def test_fp8_checkpoint_reads_as_its_dequantised_values_and_writes_back_bitwise(reports, name):
    for report in reports:
        assert report[name]["weights"] > 0 and report[name]["differ"] == [], report[name]
    written = reports[0][name]
    assert written["key_mismatch"] == [] and written["not_bitwise"] == [], written
    original, again = written["quantization_config"]
    assert again == original


def test_a_window_dequantises_to_the_same_values_as_the_whole_weight():
    quantised, scale = quantise_block_wise(torch.randn(100, 130, generator=torch.Generator().manual_seed(0)))
    fp8 = BlockFP8(BLOCK)
    whole = dequantise_block_wise(quantised, scale)
    assert torch.equal(fp8.dequantise(quantised, scale), whole)
    for start, size in (((33, 50), (44, 70)), ((40, 0), (60, 48)), ((5, 10), (95, 120)), ((99, 129), (1, 1))):
        window = tuple(slice(s, s + n) for s, n in zip(start, size))
        assert torch.equal(fp8.dequantise(quantised[window], scale[fp8.scale_window(start, size)], start),
                           whole[window])


def test_quantising_dequantised_weights_gives_back_their_bytes_whatever_the_scales_rounding():
    """Scales a quantiser rounded otherwise than largest / 448 in float32 (here up to 1e-5 above it): that alone
    recovers about 7 % of them an ulp off, the neighbour that reproduces the block none."""
    generator = torch.Generator().manual_seed(0)
    fp8 = BlockFP8(BLOCK)
    quantised, scale = quantise_block_wise(torch.randn(400, 480, generator=generator))
    scale *= 1 + torch.rand(scale.shape, generator=generator) * 1e-5
    weight = dequantise_block_wise(quantised, scale)
    plain = (weight.view(10, 40, 10, 48).abs().amax(dim=(1, 3)) / 448.0)
    assert (plain != scale).any()  # the case the neighbours are there for
    again, again_scale = fp8.quantise(weight)
    assert torch.equal(again.view(torch.uint8), quantised.view(torch.uint8)) and torch.equal(again_scale, scale)


def test_power_of_two_scales_survive_bf16():
    """ue8m0 scales (DeepSeek-V3.1): fp8 x 2^k is exact in bf16, so a bf16 Megatron checkpoint round-trips too."""
    fp8 = BlockFP8.from_hf_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                                           "scale_fmt": "ue8m0"}})
    quantised, scale = fp8.quantise(torch.randn(100, 130, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    again, again_scale = fp8.quantise(fp8.dequantise(quantised, scale).to(torch.bfloat16))
    assert torch.equal(again.view(torch.uint8), quantised.view(torch.uint8)) and torch.equal(again_scale, scale)


@pytest.mark.parametrize("key, quantised", [
    ("model.layers.0.self_attn.q_proj.weight", True), ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", True),
    ("model.layers.2.mlp.experts.3.down_proj.weight", True), ("model.layers.2.mlp.shared_experts.up_proj.weight", True),
    ("model.layers.1.self_attn.o_proj.weight", False),  # listed in modules_to_not_convert
    ("model.layers.2.mlp.gate.weight", False), ("model.layers.4.eh_proj.weight", False),
    ("model.layers.0.self_attn.q_a_layernorm.weight", False), ("model.embed_tokens.weight", False),
    ("lm_head.weight", False), ("model.layers.2.mlp.shared_expert_gate.weight", False),
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight", True), ("model.layers.0.block_sparse_moe.gate.weight", False)])
def test_which_tensors_the_format_quantises(key, quantised):
    fp8 = BlockFP8(BLOCK, modules_to_not_convert=("model.layers.1.self_attn.o_proj", "lm_head"))
    assert fp8.quantises(key) == quantised


def test_mcore_to_hf_writes_fp8_only_with_the_flag_in_the_sources_format_else_deepseeks(tmp_path):
    from rlmegatron.convert_cli import build_parser, export_format
    from rlmegatron.models.convert import ConvertMeta
    from rlmegatron.models.fp8 import DEFAULT_CONFIG

    assert build_parser().parse_args(["mcore-to-hf", "--mcore-path", "m", "--out", "o", "--fp8"]).fp8
    source = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head"]}
    hf = {"model_type": "qwen3", "quantization_config": {"quant_method": "mxfp4"}}  # as --hf-config may hold it
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    for quantization, written in ((source, source), (None, DEFAULT_CONFIG)):
        ConvertMeta({"model_type": "qwen3"}, 256, "fp32", False, 0, quantization).save(tmp_path)
        config, fp8 = export_format(str(tmp_path), None, fp8=True)
        assert config == {"model_type": "qwen3"} and fp8.config == written
        assert export_format(str(tmp_path), None, fp8=False) == ({"model_type": "qwen3"}, None)
    # Unquantised weights are written with --hf-config's config less its quantization_config.
    assert export_format(str(tmp_path), str(tmp_path / "hf"), fp8=False) == ({"model_type": "qwen3"}, None)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_the_hf_logits_verify_compares_with_are_those_of_the_dequantised_weights(tmp_path, name):
    """`rlm convert verify` of an FP8 checkpoint: transformers' model with the dequantised weights (a tied head, and
    DeepSeek's MTP layers, which transformers does not build, included), not transformers' CPU dequantisation, which
    misreads partial edge blocks."""
    from rlmegatron.models.convert import hf_logits, verify_tokens

    fp8_dir, reference_dir = save_fp8_model(name, str(tmp_path), NOT_CONVERTED.get(name, ()))
    tokens = verify_tokens(200)
    assert torch.equal(hf_logits(fp8_dir, tokens), hf_logits(reference_dir, tokens))


def test_converting_fp8_weights_to_bf16_says_that_fp32_keeps_them_exactly(tmp_path, capsys):
    """The FP8 values survive a bf16 Megatron checkpoint, their scales do not quite: said once, before the ranks."""
    from rlmegatron.convert_cli import _layout, build_parser, preflight

    fp8_dir, _ = save_fp8_model("llama", str(tmp_path / "llama"))
    capsys.readouterr()  # what saving the model printed

    def notes(*flags):
        args = build_parser().parse_args(["hf-to-mcore", "--hf-path", fp8_dir, "--out", str(tmp_path / "o"), *flags])
        preflight(args, _layout(args))
        return capsys.readouterr().err.splitlines()

    assert notes("--dtype", "fp32") == []
    (note,) = notes()
    assert note.startswith("rlm convert hf-to-mcore: the FP8 weights are dequantised and rounded to bf16; "
                           "--dtype fp32 holds them exactly")
    # What the note says, in numbers: a bf16 copy gives back every FP8 byte, and scales a rounding off.
    quantised, scale = quantise_block_wise(torch.randn(200, 300, generator=torch.Generator().manual_seed(0)))
    again, again_scale = BlockFP8(BLOCK).quantise(dequantise_block_wise(quantised, scale).to(torch.bfloat16))
    assert torch.equal(again.view(torch.uint8), quantised.view(torch.uint8))
    assert not torch.equal(again_scale, scale) and torch.allclose(again_scale, scale, rtol=2**-8)
