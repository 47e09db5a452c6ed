"""Bad converter inputs fail early with errors that say what is wrong: non-HF dirs, missing shards, stray keys,
and `rlm convert` says each in one line, exit 2, before any rank starts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmegatron.models.convert import ConversionError, HFCheckpoint
from rlmegatron.models.hf_config import UnsupportedModelError, model_facts, read_hf_config, transformer_config
from rlmegatron.models.weight_map import WeightMap, WeightMapError
from rlmegatron.runtime import ParallelLayout
from tests.models.fp8_checkpoints import save_fp8_model
from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS, save_tiny_model


def _qwen2_facts():
    return model_facts({"model_type": "qwen2", **COMMON, **FAMILY_CONFIGS["qwen2"]}, tp=1)


def test_a_directory_without_config_json_is_not_a_hf_model(tmp_path):
    with pytest.raises(UnsupportedModelError, match="config.json"):
        HFCheckpoint(tmp_path)


def test_a_shard_named_by_the_index_but_absent_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **COMMON}))
    save_file({"model.norm.weight": torch.ones(64)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(tmp_path)


def test_hf_keys_no_rule_maps_are_listed():
    weight_map = WeightMap(_qwen2_facts())
    keys = weight_map.hf_keys() | {"model.layers.0.mlp.mystery.weight"}
    with pytest.raises(WeightMapError, match="mystery"):
        weight_map.check_hf_keys(keys)


def test_hf_keys_the_map_needs_but_lacks_are_listed():
    weight_map = WeightMap(_qwen2_facts())
    with pytest.raises(WeightMapError, match="model.norm.weight"):
        weight_map.check_hf_keys(weight_map.hf_keys() - {"model.norm.weight"})


def test_multi_token_prediction_layers_the_config_does_not_declare_are_refused_by_name():
    weight_map = WeightMap(_qwen2_facts())
    with pytest.raises(WeightMapError, match="multi-token-prediction"):
        weight_map.check_hf_keys(weight_map.hf_keys() | {f"model.layers.{weight_map.facts.num_layers}.eh_proj.weight"})


def test_an_mtp_copy_of_the_embedding_that_differs_from_it_is_refused_by_name():
    weight_map = WeightMap(model_facts({"model_type": "deepseek_v3", **COMMON, **FAMILY_CONFIGS["deepseek_v3"]}, tp=1))
    rule = weight_map.rule("embedding.word_embeddings.weight")
    embedding = torch.randn(200, 64)
    weight_map.check_copies(rule, embedding, lambda key: embedding.clone())
    with pytest.raises(WeightMapError, match=r"model\.layers\.4\.embed_tokens\.weight differs"):
        weight_map.check_copies(rule, embedding, lambda key: embedding + 1)


def test_full_tensor_map_round_trips_qkv_and_glu():
    weight_map = WeightMap(_qwen2_facts())
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    hf = {f"model.layers.0.self_attn.{n}_proj.weight": t for n, t in zip("qkv", (q, k, v))}
    fused = weight_map.hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", hf)
    # Group 0 first: its 2 query heads (32 rows), then its key head, then its value head.
    assert torch.equal(fused[:32], q[:32]) and torch.equal(fused[32:48], k[:16]) and torch.equal(fused[48:64], v[:16])
    assert all(torch.equal(hf[key], t) for key, t in
               weight_map.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", fused).items())


# ---- `rlm convert`: every bad input is one line naming its culprit, exit 2, no traceback, before any rank ----------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny checkpoints the cases break: a dense Llama, a DeepSeek-V3 (4 experts) with and without its MTP tensors,
    and a converter checkpoint's metadata (all that is read of one before the ranks start)."""
    from rlmegatron.models.convert import ConvertMeta

    root = tmp_path_factory.mktemp("bad_inputs")
    for name in ("llama", "deepseek_v3", "deepseek_v3_no_mtp"):
        save_tiny_model(name, str(root / name))
    shutil.copytree(save_fp8_model("llama", str(root / "llama_fp8_parts"))[0], root / "llama_fp8")
    (root / "mcore").mkdir()
    ConvertMeta(read_hf_config(root / "llama"), 256, "fp32", False, 0).save(root / "mcore")
    return root


def _to_mcore(hf, out, *flags):
    return ["hf-to-mcore", "--hf-path", str(hf), "--out", str(out), *flags]


def _to_hf(mcore, out, *flags):
    return ["mcore-to-hf", "--mcore-path", str(mcore), "--out", str(out), *flags]


def _broken(models, tmp_path, config=None, drop_tensor=None, shard=None, source="llama", replace=None):
    """A copy of the Llama (or `source`) with config.json fields replaced, a tensor dropped or replaced (`replace`:
    {key: tensor}), or its shard's bytes -> shard(bytes)."""
    target = tmp_path / "broken"
    shutil.copytree(models / source, target)
    if config is not None:
        (target / "config.json").write_text(json.dumps({**read_hf_config(target), **config}))
    if drop_tensor is not None or replace is not None:
        tensors = load_file(target / "model.safetensors")
        tensors = {k: v for k, v in tensors.items() if k != drop_tensor} | (replace or {})
        save_file(tensors, target / "model.safetensors")
    if shard is not None:
        (target / "model.safetensors").write_bytes(shard((target / "model.safetensors").read_bytes()))
    return target


def _index_naming_a_lost_shard(models, tmp_path):
    target = _broken(models, tmp_path)
    kept = "model-00001-of-00002.safetensors"
    (target / "model.safetensors").rename(target / kept)
    keys = dict.fromkeys(load_file(target / kept), kept)
    index = {"weight_map": {**keys, "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def _with_file(directory, name, text):
    (directory / name).write_text(text)
    return directory


def _run_checkpoint(t, base=None, random_init=False, meta=True, manifest=True, padded_vocab=256):
    """A step_N directory as a run saves one, its actor's state a stand-in (the checks before the ranks read none);
    `meta`: a LoRA run's, adapting `base`."""
    from pathlib import Path

    from rlmegatron.checkpoint.integrity import write_manifest
    from rlmegatron.rank.checkpoint_state import AdapterMeta
    from rlmegatron.models.lora import LoRASettings

    step = Path(t, "step_2")
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "common.pt").write_bytes(b"x")
    if meta:
        AdapterMeta(LoRASettings(rank=4, alpha=8.0), str(base), "fp32", random_init, padded_vocab).save(step / "actor")
    if manifest:
        write_manifest(step, 2)
    return step


def _lora(checkpoint, t, *flags):
    return ["lora-to-hf", "--checkpoint", str(checkpoint), *(flags or ("--merged-out", str(t / "o")))]


def _quantised(method: str, **fields) -> dict:
    return {"quantization_config": {"quant_method": method, **fields}}


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
NOT_READ = "weights are not supported: only block-wise FP8 (quant_method fp8 with weight_block_size"
LLAMA3_ROPE_WITHOUT_LOW = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}
# id -> (argv from (models dir m, test's tmp dir t), what the one line must say; {m} and {t} are those dirs)
CONVERT_CASES = {
    "hf-path-missing": (lambda m, t: _to_mcore(t / "nope", t / "o"), "--hf-path={t}/nope: no such directory"),
    "hf-path-without-config": (lambda m, t: _to_mcore(t, t / "o"),
                               "{t} is not a Hugging Face model directory: no config.json in it"),
    "config-not-json": (lambda m, t: _to_mcore(_with_file(t, "config.json", "{"), t / "o"),
                        "{t}/config.json: not a JSON config"),
    "no-safetensors": (lambda m, t: _to_mcore(_with_file(t, "config.json", (m / "llama/config.json").read_text()),
                                              t / "o"),
                       "{t} has no model.safetensors or model.safetensors.index.json"),
    "unsupported-model-type": (lambda m, t: _to_mcore(_broken(m, t, config={"model_type": "gpt2"}), t / "o"),
                               "{t}/broken/config.json: model_type 'gpt2' is not supported"),
    "unsupported-activation": (lambda m, t: _to_mcore(_broken(m, t, config={"hidden_act": "gelu"}), t / "o"),
                               "{t}/broken/config.json: hidden_act='gelu' unsupported"),
    "llama3-rope-lacks-a-field": (
        lambda m, t: _to_mcore(_broken(m, t, config={"rope_parameters": LLAMA3_ROPE_WITHOUT_LOW}), t / "o"),
        "{t}/broken/config.json: rope_scaling (rope_type llama3) lacks low_freq_factor"),
    "truncated-shard": (lambda m, t: _to_mcore(_broken(m, t, shard=lambda b: b[: len(b) // 2]), t / "o"),
                        "{t}/broken/model.safetensors: truncated or corrupt safetensors file"),
    "corrupt-shard": (lambda m, t: _to_mcore(_broken(m, t, shard=lambda b: b"\x10" + b[1:]), t / "o"),
                      "{t}/broken/model.safetensors: truncated or corrupt safetensors file"),
    "index-names-a-lost-shard": (lambda m, t: _to_mcore(_index_naming_a_lost_shard(m, t), t / "o"),
                                 "missing safetensors shards named by its index: ['model-00002-of-00002.safetensors']"),
    "quantised-mxfp4": (lambda m, t: _to_mcore(_broken(m, t, config=_quantised("mxfp4")), t / "o"),
                        "{t}/broken/config.json: quantization_config: MXFP4 (quant_method mxfp4) " + NOT_READ),
    "quantised-nvfp4": (lambda m, t: _to_mcore(_broken(m, t, config=_quantised("modelopt", quant_algo="NVFP4")),
                                               t / "o"),
                        "{t}/broken/config.json: quantization_config: NVFP4 (quant_method modelopt) " + NOT_READ),
    "quantised-per-channel-fp8": (lambda m, t: _to_mcore(_broken(m, t, config=_quantised("fbgemm_fp8")), t / "o"),
                                  "quantization_config: per-channel FP8 (quant_method fbgemm_fp8) " + NOT_READ),
    "quantised-per-tensor-fp8": (lambda m, t: _to_mcore(_broken(m, t, config=_quantised("fp8")), t / "o"),
                                 "{t}/broken/config.json: quantization_config: per-tensor FP8 scales (quant_method fp8 "
                                 "without weight_block_size) are not supported"),
    "fp8-scale-missing": (lambda m, t: _to_mcore(_broken(m, t, source="llama_fp8", drop_tensor=Q_PROJ + "_scale_inv"),
                                                 t / "o"),
                          f"{{t}}/broken: FP8 weight {Q_PROJ} has no scale: {Q_PROJ}_scale_inv is missing"),
    "fp8-scale-per-channel": (
        lambda m, t: _to_mcore(_broken(m, t, source="llama_fp8", replace={Q_PROJ + "_scale_inv": torch.ones(64, 1)}),
                               t / "o"),
        f"{{t}}/broken: {Q_PROJ}_scale_inv has shape [64, 1], not the [2, 2] blocks of [40, 48] that {Q_PROJ} "
        "[64, 64] has: per-tensor or per-channel FP8 scales are not supported"),
    "fp8-without-quantization-config": (
        lambda m, t: _to_mcore(_broken(m, t, source="llama_fp8", config={"quantization_config": None}), t / "o"),
        "is float8_e4m3fn but config.json declares no quantization_config"),
    "tensor-missing": (lambda m, t: _to_mcore(_broken(m, t, drop_tensor="model.norm.weight"), t / "o"),
                       "{t}/broken: 1 HF tensors the llama map needs are absent: ['model.norm.weight']"),
    "out-not-empty": (lambda m, t: _to_mcore(m / "llama", m / "deepseek_v3"),
                      "--out={m}/deepseek_v3: exists and is not empty"),
    "out-is-a-file": (lambda m, t: _to_mcore(m / "llama", _with_file(t, "f", "x") / "f"),
                      "--out={t}/f: exists and is not empty"),
    "tp-vs-heads": (lambda m, t: _to_mcore(m / "llama", t / "o", "--tp", "3"),
                    "--tp=3: does not divide the model's 4 attention heads; use 1, 2 or 4"),
    "pp-vs-layers": (lambda m, t: _to_mcore(m / "llama", t / "o", "--pp", "3"),
                     "--pp=3: does not divide the model's 4 layers; use 1, 2 or 4"),
    "vpp-vs-stage-layers": (lambda m, t: _to_mcore(m / "llama", t / "o", "--pp", "2", "--vpp", "3"),
                            "--vpp=3: does not divide the layers of each pipeline stage (2); use 1 or 2"),
    "vpp-without-pp": (lambda m, t: _to_mcore(m / "llama", t / "o", "--vpp", "2"), "--vpp=2: needs --pp > 1"),
    "ep-on-dense": (lambda m, t: _to_mcore(m / "llama", t / "o", "--ep", "2"), "--ep=2: the model is dense"),
    "ep-vs-experts": (lambda m, t: _to_mcore(m / "deepseek_v3", t / "o", "--ep", "3"),
                      "--ep=3: does not divide the 4 experts; use 1, 2 or 4"),
    "etp-vs-expert-size": (lambda m, t: _to_mcore(m / "deepseek_v3", t / "o", "--etp", "3"),
                           "--etp=3: does not divide the experts' hidden size 32"),
    "nproc-vs-layout": (lambda m, t: _to_mcore(m / "llama", t / "o", "--tp", "2", "--nproc", "3"),
                        "--nproc=3: Megatron needs a multiple of TP×PP and of ETP×EP×PP; use 2"),
    "mcore-path-missing": (lambda m, t: _to_hf(t / "nope", t / "o"), "--mcore-path={t}/nope: no such directory"),
    "mcore-path-not-converted": (lambda m, t: _to_hf(m / "llama", t / "o"),
                                 "{m}/llama is not a checkpoint written by `rlm convert` (no rlm_convert.json)"),
    "mcore-tp-vs-heads": (lambda m, t: _to_hf(m / "mcore", t / "o", "--tp", "3"),
                          "--tp=3: does not divide the model's 4 attention heads"),
    "hf-config-missing": (lambda m, t: _to_hf(m / "mcore", t / "o", "--hf-config", str(t / "nope")),
                          "--hf-config={t}/nope: no such directory"),
    "fp8-export-in-an-unsupported-format": (
        lambda m, t: _to_hf(m / "mcore", t / "o", "--fp8", "--hf-config", str(_broken(m, t, config=_quantised("mxfp4")))),
        "--fp8: quantization_config: MXFP4 (quant_method mxfp4) " + NOT_READ),
    "lora-checkpoint-missing": (lambda m, t: _lora(t / "nope", t), "--checkpoint={t}/nope: no such directory"),
    "lora-nothing-to-write": (lambda m, t: _lora(_run_checkpoint(t, m / "llama"), t, "--tp", "1"),
                              "nothing to write: name --adapter-out (a PEFT adapter), --merged-out"),
    "lora-same-outs": (lambda m, t: _lora(_run_checkpoint(t, m / "llama"), t, "--adapter-out", str(t / "o"),
                                          "--merged-out", str(t / "o")),
                       "--adapter-out and --merged-out are both {t}/o: name two directories"),
    "lora-checkpoint-incomplete": (lambda m, t: _lora(_run_checkpoint(t, m / "llama", manifest=False), t),
                                   "--checkpoint={t}/step_2: not a complete checkpoint (no "),
    "lora-names-the-checkpoints-not-a-step": (
        lambda m, t: _lora(_run_checkpoint(t / "run" / "checkpoints", m / "llama").parent, t),
        "--checkpoint={t}/run/checkpoints: holds a run's checkpoints, not one; name a step, e.g. the newest "
        "complete one, {t}/run/checkpoints/step_2"),
    "lora-checkpoint-of-a-full-run": (lambda m, t: _lora(_run_checkpoint(t, meta=False), t),
                                      "--checkpoint={t}/step_2: not a LoRA checkpoint (no actor/lora.json)"),
    "lora-random-base": (lambda m, t: _lora(_run_checkpoint(t, m / "llama", random_init=True), t),
                         "--checkpoint={t}/step_2: the run started from random base weights (model.random_init)"),
    "lora-base-gone": (lambda m, t: _lora(_run_checkpoint(t, t / "gone"), t),
                       "{t}/step_2/actor/lora.json: base_model {t}/gone: no such directory"),
    "lora-out-not-empty": (lambda m, t: _lora(_run_checkpoint(t, m / "llama"), t, "--merged-out", str(m / "llama")),
                           "--merged-out={m}/llama: exists and is not empty"),
    "lora-peft-of-moe": (lambda m, t: _lora(_run_checkpoint(t, m / "deepseek_v3"), t, "--adapter-out", str(t / "o")),
                         "--adapter-out={t}/o: PEFT adapters are written for dense models"),
    "lora-tp-vs-padded-vocab": (lambda m, t: _lora(_run_checkpoint(t, m / "llama", padded_vocab=130), t,
                                                   "--merged-out", str(t / "o"), "--tp", "4"),
                                "--tp=4: does not divide the run's padded vocabulary (130 rows)"),
    "lora-tp-vs-heads": (lambda m, t: _lora(_run_checkpoint(t, m / "llama"), t, "--merged-out", str(t / "o"),
                                            "--tp", "3"),
                         "--tp=3: does not divide the model's 4 attention heads"),
    "verify-hf-path-missing": (lambda m, t: ["verify", "--hf-path", str(t / "nope"), "--mcore-path", str(m / "mcore")],
                               "--hf-path={t}/nope: no such directory"),
}


@pytest.mark.parametrize("argv, culprit", CONVERT_CASES.values(), ids=CONVERT_CASES.keys())
def test_convert_refuses_a_bad_input_in_one_line_before_any_rank(models, tmp_path, capsys, argv, culprit):
    from rlmegatron.entry.convert_command import main

    assert main(argv(models, tmp_path)) == 2
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlm convert "), lines
    assert culprit.format(m=models, t=tmp_path) in lines[0]
    assert "Traceback" not in out.err


def test_rlm_convert_says_one_line_and_rlm_debug_adds_the_traceback(models, tmp_path):
    command = [sys.executable, "-m", "rlmegatron", "convert", *_to_mcore(models / "llama", tmp_path / "o", "--tp", "3")]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.splitlines() == [
        "rlm convert hf-to-mcore: --tp=3: does not divide the model's 4 attention heads; use 1, 2 or 4"], plain.stderr
    assert not (tmp_path / "o").exists()
    debug = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "RLM_DEBUG": "1"})
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "ConversionError" in debug.stderr


def test_a_deepseek_v3_without_mtp_tensors_converts_without_mtp_said_once(models, tmp_path, capsys):
    from rlmegatron.entry.convert_command import _layout, build_parser, preflight

    def checked(name):
        args = build_parser().parse_args(_to_mcore(models / name, tmp_path / name))
        preflight(args, _layout(args))
        return capsys.readouterr().err.splitlines()

    assert checked("deepseek_v3") == []
    assert checked("deepseek_v3_no_mtp") == [
        "rlm convert hf-to-mcore: config.json declares num_nextn_predict_layers=1 but the checkpoint holds no "
        "multi-token-prediction tensors (model.layers.4.*), as transformers saves DeepSeek-V3: MTP is off"]
    facts = HFCheckpoint(models / "deepseek_v3_no_mtp").facts(tp=1)
    assert facts.num_mtp_layers == 0 and transformer_config(facts, ParallelLayout()).mtp_num_layers is None
    assert HFCheckpoint(models / "deepseek_v3").facts(tp=1).num_mtp_layers == 1
