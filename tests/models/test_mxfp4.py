"""gpt-oss's MXFP4 experts: read as exactly their dequantised values (transformers' dequantisation agrees) at TP=1 and
TP=2 x EP=2, each rank dequantising only its experts' slabs; written back by `mcore-to-hf --mxfp4` byte for byte
from a bf16 Megatron checkpoint, with the source's scales where no value determines them; a bad MXFP4 checkpoint,
or MXFP4 on another family, refused in one line."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmegatron.models.convert import ConversionError, HFCheckpoint
from rlmegatron.models.fp8 import UnsupportedQuantization
from rlmegatron.models.mxfp4 import MXFP4
from rlmegatron.models.weight_map import Source
from rlmegatron.runtime import ParallelLayout
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.mxfp4_checkpoints import (
    PLANTED,
    QUANTIZATION,
    dequantise_mx,
    mxfp4_read_job,
    quantise_mx,
    save_mxfp4_model,
)

# gpt-oss's biased experts run at expert-TP 1 (conversion_jobs.layouts_for).
LAYOUTS = [ParallelLayout(), ParallelLayout(tp=2, ep=2, etp=1, sequence_parallel=True)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(MXFP4 checkpoint, its reference) of the tiny gpt-oss, for the unit tests (each e2e test saves its own, so
    that this fixture leaves them out of the quick loop: conftest)."""
    return save_mxfp4_model(str(tmp_path_factory.mktemp("mxfp4")))


def _stacked(directory: str) -> dict[str, torch.Tensor]:
    return load_file(f"{directory}/model.safetensors")


@pytest.mark.timeout(300)
def test_every_megatron_weight_read_from_mxfp4_equals_the_one_read_from_its_dequantised_reference(tmp_path):
    save_mxfp4_model(str(tmp_path))
    reports = run_ranks(mxfp4_read_job, 2, LAYOUTS, str(tmp_path), timeout_s=240)
    for rank, report in enumerate(reports):
        tp1, tp2_ep2 = (report[str(layout)] for layout in LAYOUTS)
        assert tp1["differ"] == tp2_ep2["differ"] == [], report
        # 2 layers x 4 experts x fc1/fc2 at TP=1; this rank's 2 experts at EP=2.
        assert (tp1["expert_weights"], tp2_ep2["expert_weights"]) == (16, 8), report
        # Only expert slabs are dequantised, never a whole stacked tensor, and at EP=2 only this rank's experts.
        assert tp1["slabs"] == [0, 1, 2, 3] and tp2_ep2["slabs"] == [2 * rank, 2 * rank + 1], report


def test_transformers_dequantises_the_experts_to_the_values_we_read(model):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    mxfp4_dir, reference_dir = model
    tensors, reference = _stacked(mxfp4_dir), _stacked(reference_dir)
    checkpoint = HFCheckpoint(mxfp4_dir)
    assert len(checkpoint.mxfp4_keys) == 4 and set(checkpoint.key_files) == set(reference)
    for key, (blocks, scales) in checkpoint.mxfp4_keys.items():
        theirs = convert_moe_packed_tensors(tensors[blocks], tensors[scales], dtype=torch.float32)
        assert torch.equal(checkpoint.read(Source(key)), theirs) and torch.equal(theirs, reference[key]), key
        assert checkpoint.shape(Source(key)) == tuple(theirs.shape)
        for expert in range(theirs.shape[0]):
            assert torch.equal(checkpoint.read(Source(key, expert)), theirs[expert])
            down = Source(key, expert, transposed=True)  # a rank's half of the Megatron weight [out, in]
            assert torch.equal(checkpoint.read(down, 0, 1, 2), theirs[expert].T.chunk(2)[1])
    # Signed zeros come through as such.
    planted = checkpoint.read(Source(PLANTED[0], PLANTED[1]))
    assert torch.signbit(planted[:8, 2]).all() and (planted[:8, 2] == 0).all()


def test_the_hf_logits_verify_compares_with_are_those_of_the_dequantised_weights(model):
    from rlmegatron.models.convert import hf_logits, verify_tokens

    mxfp4_dir, reference_dir = model
    tokens = verify_tokens(200)
    assert torch.equal(hf_logits(mxfp4_dir, tokens), hf_logits(reference_dir, tokens))


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, bf16 [E, in, out] weight) of random weights quantised by the OCP MX rule, with groups that
    only their scale determines (mxfp4_checkpoints.PLANTED)."""
    from tests.models.mxfp4_checkpoints import _plant

    blocks, scales = quantise_mx(torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(seed)))
    _plant(blocks, scales)
    return blocks, scales, dequantise_mx(blocks, scales).to(torch.bfloat16)


def _requantised(weight: torch.Tensor, original=None) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [MXFP4.quantise(expert.T, None if original is None else original[e]) for e, expert in enumerate(weight)]
    return torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])


def test_a_bf16_copy_gives_back_the_mxfp4_bytes_with_the_original_scales_and_its_values_without_them():
    blocks, scales, weight = _weights(0)
    again_blocks, again_scales = _requantised(weight, scales)
    assert torch.equal(again_blocks, blocks) and torch.equal(again_scales, scales)
    # Without them every group comes back as the same values, and as the same bytes wherever its values determine
    # its scale: all but the planted all-zero and all-even groups, whose scale the fresh rule halves.
    fresh_blocks, fresh_scales = _requantised(weight)
    assert torch.equal(dequantise_mx(fresh_blocks, fresh_scales).to(torch.bfloat16), weight)
    differ = (fresh_scales != scales).nonzero().tolist()
    assert differ == [[PLANTED[1], 0, 0], [PLANTED[1], 1, 0]], differ
    assert fresh_scales[PLANTED[1], 0, 0] == 0 and fresh_scales[PLANTED[1], 1, 0] == scales[PLANTED[1], 1, 0] - 1


def test_a_trained_group_gets_a_fresh_scale_rounded_to_nearest_even_and_the_untrained_keep_their_bytes():
    blocks, scales, weight = _weights(1)
    trained = weight.clone()
    # Expert 0, output 5, group 1 (inputs 32-63): one value nudged by a bf16 step, one a new largest magnitude.
    trained[0, 40, 5] = torch.nextafter(weight[0, 40, 5], torch.tensor(float("inf"), dtype=torch.bfloat16))
    largest = weight[0, 32:64, 5].abs().max()
    trained[0, 33, 5] = largest * 5
    # Expert 2, output 7, group 0: values halfway between FP4 values at their fresh scale 2^0 (largest 6).
    trained[2, :32, 7] = 0
    trained[2, :6, 7] = torch.tensor([6.0, 0.25, 0.75, 2.5, -3.5, 5.0])
    again_blocks, again_scales = _requantised(trained, scales)
    values = dequantise_mx(again_blocks, again_scales)
    assert torch.equal(values[2, :6, 7], torch.tensor([6.0, 0.0, 1.0, 2.0, -4.0, 4.0]))  # ties to even codes
    assert again_scales[2, 7, 0] == 127
    # The nudged group: the smallest power of two that holds 5 x largest within 6, every value within half a step.
    group = trained[0, 32:64, 5].float()
    step = 2.0 ** (int(again_scales[0, 5, 1]) - 127)
    assert 6 * step / 2 < group.abs().max() <= 6 * step
    assert ((values[0, 32:64, 5] - group).abs() <= step).all()
    fresh = {(0, 5, 1), (2, 7, 0)}
    for index in (scales != again_scales).nonzero().tolist():
        assert tuple(index) in fresh, index
    kept = torch.ones_like(scales, dtype=torch.bool)
    for index in fresh:
        kept[index] = False
    assert torch.equal(again_blocks[kept], blocks[kept])


def test_only_the_stacked_expert_weights_are_mxfp4_unless_modules_to_not_convert_names_them():
    mxfp4 = MXFP4.from_hf_config({"model_type": "gpt_oss", "quantization_config": {
        **QUANTIZATION, "modules_to_not_convert": [*QUANTIZATION["modules_to_not_convert"], "model.layers.1.mlp"]}})
    assert mxfp4.quantises("model.layers.0.mlp.experts.gate_up_proj")
    assert mxfp4.quantises("model.layers.11.mlp.experts.down_proj")
    for key in ("model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.router.weight",
                "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.down_proj", "lm_head.weight"):
        assert not mxfp4.quantises(key), key


def _broken(model, tmp_path, change) -> str:
    """A copy of the MXFP4 checkpoint whose tensors and config.json `change(tensors, config)` altered in place."""
    directory = tmp_path / "broken"
    shutil.copytree(model[0], directory)
    tensors, config = _stacked(str(directory)), json.loads((directory / "config.json").read_text())
    change(tensors, config)
    save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


KEY = "model.layers.1.mlp.experts.down_proj"


@pytest.mark.parametrize("change, error, message", [
    (lambda t, c: t.pop(KEY + "_scales"), ConversionError,
     f"MXFP4 weight {KEY}_blocks has no scales: {KEY}_scales is missing"),
    (lambda t, c: t.pop(KEY + "_blocks"), ConversionError, f"{KEY}_scales scales {KEY}_blocks, which the checkpoint"),
    (lambda t, c: t.update({KEY + "_scales": t[KEY + "_scales"][:, :32]}), ConversionError,
     f"{KEY}_blocks U8 [4, 64, 1, 16] with {KEY}_scales U8 [4, 32, 1] is not MXFP4 as gpt-oss ships it"),
    (lambda t, c: t.update({KEY + "_blocks": t[KEY + "_blocks"][..., :8]}), ConversionError,
     f"{KEY}_blocks U8 [4, 64, 1, 8] with {KEY}_scales U8 [4, 64, 1] is not MXFP4"),
    (lambda t, c: t.update({"model.layers.0.self_attn.q_proj.weight_blocks": t[KEY + "_blocks"].clone(),
                            "model.layers.0.self_attn.q_proj.weight_scales": t[KEY + "_scales"].clone()}),
     ConversionError,
     "model.layers.0.self_attn.q_proj.weight_blocks is MXFP4, which is read for the stacked expert weights"),
    (lambda t, c: c.pop("quantization_config"), ConversionError,
     "is MXFP4 blocks (uint8) but config.json declares no quantization_config mxfp4"),
    (lambda t, c: c.update(model_type="qwen3_moe"), UnsupportedQuantization,
     "config.json: quantization_config: MXFP4 (quant_method mxfp4) weights are not supported: only block-wise FP8 "
     "(quant_method fp8 with weight_block_size, as DeepSeek-V3 and Qwen3-FP8 ship) is read, and gpt-oss's MXFP4 "
     "experts"),
], ids=["no scales", "no blocks", "scales' shape", "blocks' shape", "not experts", "undeclared", "other family"])
def test_a_bad_mxfp4_checkpoint_is_refused_in_one_line_naming_the_tensor(model, tmp_path, change, error, message):
    with pytest.raises(error) as refused:
        HFCheckpoint(_broken(model, tmp_path, change))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_nan_scale_is_refused_when_its_expert_is_read(model, tmp_path):
    checkpoint = HFCheckpoint(_broken(model, tmp_path, lambda t, c: t[KEY + "_scales"][2, 5].fill_(255)))
    checkpoint.read(Source(KEY, 1, transposed=True))
    with pytest.raises(ConversionError, match=f"{KEY}_scales: the scales of expert 2 of {KEY} put values past"):
        checkpoint.read(Source(KEY, 2, transposed=True))


def test_rlm_convert_refuses_a_bad_mxfp4_checkpoint_and_mxfp4_for_another_family_before_any_rank(model, tmp_path,
                                                                                                 capsys):
    from rlmegatron.entry.convert_command import export_format, main
    from rlmegatron.models.convert import ConvertMeta

    broken = _broken(model, tmp_path, lambda t, c: t.pop(KEY + "_scales"))
    assert main(["hf-to-mcore", "--hf-path", broken, "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rlm convert hf-to-mcore: ") and f"{KEY}_scales is missing" in line
    (tmp_path / "qwen3").mkdir()
    ConvertMeta({"model_type": "qwen3_moe"}, 256, "bf16", False).save(tmp_path / "qwen3")
    with pytest.raises(UnsupportedQuantization, match="MXFP4 is written for the experts of gpt-oss only, and this "
                                                      "is a 'qwen3_moe' model"):
        export_format(str(tmp_path / "qwen3"), None, fp8=False, mxfp4=True)


def test_mcore_to_hf_mxfp4_writes_the_sources_quantization_config_else_gpt_oss_s(tmp_path):
    from rlmegatron.entry.convert_command import build_parser, export_format
    from rlmegatron.models.convert import ConvertMeta
    from rlmegatron.models.mxfp4 import DEFAULT_CONFIG

    with pytest.raises(SystemExit):  # one format at a time
        build_parser().parse_args(["mcore-to-hf", "--mcore-path", "m", "--out", "o", "--fp8", "--mxfp4"])
    hf = {"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 200, "intermediate_size": 32, "num_local_experts": 4,
          "num_experts_per_tok": 2}
    source = {**QUANTIZATION, "modules_to_not_convert": ["lm_head"]}
    for quantization, written in ((source, source), (None, DEFAULT_CONFIG)):
        ConvertMeta(hf, 256, "bf16", True, 0, quantization).save(tmp_path)
        config, mxfp4 = export_format(str(tmp_path), None, fp8=False, mxfp4=True)
        assert config == hf and mxfp4.config == written
    ConvertMeta({**hf, "intermediate_size": 48}, 256, "bf16", True, 0, source).save(tmp_path)
    with pytest.raises(UnsupportedQuantization, match="whole groups of 32, and this model's intermediate_size 48"):
        export_format(str(tmp_path), None, fp8=False, mxfp4=True)


@pytest.mark.timeout(400)
def test_rlm_convert_round_trips_an_mxfp4_checkpoint_byte_for_byte_at_tp2_ep2_through_bf16(tmp_path):
    """`rlm convert hf-to-mcore` (bf16, the default) then `mcore-to-hf --mxfp4`, both at TP=2 x EP=2: every tensor's
    bytes (blocks, scales, the bf16 rest) and config.json's quantization_config as they were."""
    from rlmegatron.entry.convert_command import main
    from rlmegatron.models.convert import MXFP4_SCALES_FILE, ConvertMeta

    mxfp4_dir, _ = save_mxfp4_model(str(tmp_path / "model"))
    mcore, again = str(tmp_path / "mcore"), str(tmp_path / "again")
    layout = ["--tp", "2", "--ep", "2", "--etp", "1", "--device", "cpu"]
    assert main(["hf-to-mcore", "--hf-path", mxfp4_dir, "--out", mcore, *layout]) == 0
    assert ConvertMeta.load(mcore).dtype == "bf16" and (tmp_path / "mcore" / MXFP4_SCALES_FILE).is_file()
    assert main(["mcore-to-hf", "--mcore-path", mcore, "--out", again, "--mxfp4", *layout]) == 0
    original = _stacked(mxfp4_dir)
    written = {}
    for file in json.loads((tmp_path / "again" / "model.safetensors.index.json").read_text())["weight_map"].values():
        written.update(load_file(f"{again}/{file}"))
    assert sorted(written) == sorted(original)
    assert sum(t.dtype == torch.uint8 for t in original.values()) == 8
    assert [key for key in original if original[key].dtype != written[key].dtype
            or not torch.equal(original[key].view(torch.uint8), written[key].view(torch.uint8))] == []
    configs = [json.loads(open(f"{d}/config.json").read()) for d in (mxfp4_dir, again)]
    assert configs[1]["quantization_config"] == configs[0]["quantization_config"] == QUANTIZATION
