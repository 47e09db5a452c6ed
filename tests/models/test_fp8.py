"""Block-wise FP8 checkpoints (DeepSeek-V3's and Qwen3-FP8's format): read as exactly their dequantised values at
TP=2, EP=2 and PP=2, and written back by `mcore-to-hf --fp8` byte for byte from a bf16 Megatron checkpoint, a
trained block with a fresh scale."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from rlmegatron.models.fp8 import BlockFP8
from rlmegatron.runtime import ParallelLayout
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.conversion_jobs import fp8_job
from tests.models.fp8_checkpoints import BLOCK, dequantise_block_wise, quantise_block_wise, save_fp8_model

# A dense model split by TP (with a projection left unquantised), an MoE model's experts split by EP, and
# DeepSeek-V3 (MLA, shared experts, an MTP layer) over two pipeline stages.
# DeepSeek-V3.2 at TP=2: its sparse-attention indexer's wq_b and wk are FP8 as released, its weights_proj bf16.
CASES = {"qwen3": ParallelLayout(tp=2), "qwen3_moe": ParallelLayout(ep=2), "deepseek_v3": ParallelLayout(pp=2),
         "deepseek_v32": ParallelLayout(tp=2, sequence_parallel=True)}
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
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight", True), ("model.layers.0.block_sparse_moe.gate.weight", False),
    ("model.layers.0.self_attn.indexer.wq_b.weight", True), ("model.layers.0.self_attn.indexer.wk.weight", True),
    ("model.layers.0.self_attn.indexer.weights_proj.weight", False),
    ("model.layers.0.self_attn.indexer.k_norm.weight", False)])
def test_which_tensors_the_format_quantises(key, quantised):
    fp8 = BlockFP8(BLOCK, modules_to_not_convert=("model.layers.1.self_attn.o_proj", "lm_head"))
    assert fp8.quantises(key) == quantised


def test_mcore_to_hf_writes_fp8_only_with_the_flag_in_the_sources_format_else_deepseeks(tmp_path):
    from rlmegatron.entry.convert_command import build_parser, export_format
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


def test_converting_fp8_weights_to_fp16_notes_the_range_it_loses(tmp_path, capsys):
    """bf16 and fp32 hold every FP8 value times its scale (the round trips below), fp16 not the smallest: said
    once, before the ranks, for fp16 only."""
    from rlmegatron.entry.convert_command import _layout, build_parser, preflight

    fp8_dir, _ = save_fp8_model("llama", str(tmp_path / "llama"))
    capsys.readouterr()  # what saving the model printed

    def notes(*flags):
        args = build_parser().parse_args(["hf-to-mcore", "--hf-path", fp8_dir, "--out", str(tmp_path / "o"), *flags])
        preflight(args, _layout(args))
        return capsys.readouterr().err.splitlines()

    assert notes("--dtype", "fp32") == notes() == []
    (note,) = notes("--dtype", "fp16")
    assert note.startswith("rlm convert hf-to-mcore: the FP8 weights are dequantised and rounded to fp16, whose "
                           "range loses magnitudes below 6e-8")
    # What the note says, in numbers: small weights (scales near 1e-9) lose FP8 values in fp16, none in bf16.
    quantised, scale = quantise_block_wise(torch.randn(80, 96, generator=torch.Generator().manual_seed(1)) * 4e-7)
    fp8 = BlockFP8(BLOCK)
    for dtype, lost in ((torch.float16, True), (torch.bfloat16, False)):
        again, _ = fp8.quantise(fp8.dequantise(quantised, scale).to(dtype), scale)
        assert (not torch.equal(again.view(torch.uint8), quantised.view(torch.uint8))) == lost, dtype


def _bf16_weight(seed: int, shape=(200, 300)):
    """(bf16 weight, its FP8 values, scales) of an FP8 weight whose quantiser rounded the scales up to 1e-3 above
    largest / 448, so that no fresh scale is an original one."""
    generator = torch.Generator().manual_seed(seed)
    quantised, scale = quantise_block_wise(torch.randn(shape, generator=generator))
    scale *= 1 + torch.rand(scale.shape, generator=generator) * 1e-3
    return dequantise_block_wise(quantised, scale).to(torch.bfloat16), quantised, scale


def test_a_bf16_copy_gives_back_the_fp8_bytes_with_the_original_scales_and_only_with_them():
    weight, quantised, scale = _bf16_weight(0)
    fp8 = BlockFP8(BLOCK)
    again, again_scale = fp8.quantise(weight, scale)
    assert torch.equal(again.view(torch.uint8), quantised.view(torch.uint8)) and torch.equal(again_scale, scale)
    # Without them the FP8 values come back too (a scale 0.3 % off moves none of them), but every scale is a fresh
    # one, up to 1e-3 and a bf16 rounding off.
    fresh, fresh_scale = fp8.quantise(weight)
    assert torch.equal(fresh.view(torch.uint8), quantised.view(torch.uint8))
    assert (fresh_scale != scale).all() and torch.allclose(fresh_scale, scale, rtol=1e-3 + 2**-8)


def test_a_trained_block_gets_a_fresh_scale_and_the_untrained_keep_their_bytes():
    """A block counts as trained as soon as one weight moved by one bf16 step: its original scale no longer gives
    back what is held, so it gets the scale of its own largest magnitude."""
    weight, quantised, scale = _bf16_weight(1)
    trained = weight.clone()
    row, col = 1 * BLOCK[0] + 3, 2 * BLOCK[1] + 5  # in block (1, 2): the next bf16 value up
    trained[row, col] = torch.nextafter(weight[row, col], torch.tensor(math.inf, dtype=torch.bfloat16))
    trained[4, 7] = weight[:BLOCK[0], :BLOCK[1]].abs().max() * 3  # in block (0, 0): a new largest magnitude
    fp8 = BlockFP8(BLOCK)
    again, again_scale = fp8.quantise(trained, scale)
    fresh = {(1, 2), (0, 0)}
    for i, j in itertools.product(*map(range, scale.shape)):
        window = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
        if (i, j) in fresh:
            assert again_scale[i, j] == trained[window].float().abs().max() / 448.0 != scale[i, j], (i, j)
        else:
            assert again_scale[i, j] == scale[i, j], (i, j)
            assert torch.equal(again[window].view(torch.uint8), quantised[window].view(torch.uint8)), (i, j)
    assert again_scale[0, 0] > 2.9 * scale[0, 0] and not again.float().isnan().any()  # 448 at most, no overflow


def test_rlm_convert_round_trips_an_fp8_checkpoint_byte_for_byte_at_tp2_pp2_through_bf16(tmp_path):
    """`rlm convert hf-to-mcore` (bf16, the default) then `mcore-to-hf --fp8`, both at TP=2 x PP=2, of DeepSeek-V3
    (MLA, MoE, shared experts, an MTP layer): every tensor's bytes, FP8 values and scales, as they were."""
    from rlmegatron.entry.convert_command import main
    from rlmegatron.models.convert import SCALES_FILE, ConvertMeta
    from tests.models.conversion_jobs import _read_safetensors

    fp8_dir, _ = save_fp8_model("deepseek_v3", str(tmp_path / "model"))
    mcore, again = str(tmp_path / "mcore"), str(tmp_path / "again")
    layout = ["--tp", "2", "--pp", "2", "--device", "cpu"]
    assert main(["hf-to-mcore", "--hf-path", fp8_dir, "--out", mcore, *layout]) == 0
    assert ConvertMeta.load(mcore).dtype == "bf16" and (tmp_path / "mcore" / SCALES_FILE).is_file()
    assert main(["mcore-to-hf", "--mcore-path", mcore, "--out", again, "--fp8", *layout]) == 0
    original, written = _read_safetensors(fp8_dir), _read_safetensors(again)
    assert sorted(written) == sorted(original)
    assert sum(t.dtype == torch.float8_e4m3fn for t in original.values()) >= 20
    assert [key for key in original if original[key].dtype != written[key].dtype
            or not torch.equal(original[key].view(torch.uint8), written[key].view(torch.uint8))] == []
