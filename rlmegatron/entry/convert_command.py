"""Arguments, pre-launch checks, dispatch and rank bodies of
`rlm convert {hf-to-mcore,mcore-to-hf,lora-to-hf,verify}`, under torchrun or with --nproc.

torch, Megatron, pydantic and the modules that import them are imported inside the functions that need them: `rlm`
imports this module for every `rlm convert`, and parsing the arguments should not wait for them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from rlmegatron.checkpoint.integrity import manifest_problem
from rlmegatron.checkpoint.manager import CheckpointManager
from rlmegatron.entry.one_line_parser import OneLineParser
from rlmegatron.models.families import architecture_of

EXIT_OK, EXIT_FAILED, EXIT_BEYOND_TOLERANCE = 0, 2, 3
# The job spec's name of each parallel size, and the flag that sets it here.
FLAGS = {
    "tensor_model_parallel_size": "--tp",
    "pipeline_model_parallel_size": "--pp",
    "virtual_pipeline_model_parallel_size": "--vpp",
    "expert_model_parallel_size": "--ep",
    "expert_tensor_parallel_size": "--etp",
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rlm convert", description="Hugging Face <-> Megatron-Core checkpoints.")
    sub = parser.add_subparsers(dest="direction", required=True)

    def layout_args(p, with_ep=True):
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron layout (default 1)")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
        p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (default: none)")
        p.add_argument("--first-stage-layers", type=int, default=None,
                       help="decoder layers on the first pipeline stage when it differs from the rest")
        p.add_argument("--last-stage-layers", type=int, default=None,
                       help="decoder layers on the last pipeline stage when it differs from the rest")
        if with_ep:
            p.add_argument("--ep", type=int, default=1, help="expert-parallel size, MoE families (default 1)")
            p.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
        p.add_argument("--nproc", type=int, default=None,
                       help="ranks to spawn here (gloo on CPU, nccl on GPUs); default: torchrun's, else the "
                            "fewest that TPxPP and ETPxEPxPP both divide")
        p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")

    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron.core.dist_checkpointing")
    to_mcore.add_argument("--hf-path", required=True,
                          help="directory of an HF checkpoint: config.json and *.safetensors (a local path; no hub)")
    to_mcore.add_argument("--out", required=True, help="a new or empty directory for the Megatron checkpoint")
    to_mcore.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                          help="default: the dtype config.json declares (bf16 for a block-FP8 model, or none declared)")
    layout_args(to_mcore)
    to_hf = sub.add_parser("mcore-to-hf", help="dist_checkpointing written by hf-to-mcore -> HF safetensors")
    to_hf.add_argument("--mcore-path", required=True,
                       help="a directory hf-to-mcore wrote (its rlm_convert.json names the model)")
    to_hf.add_argument("--out", required=True, help="a new or empty directory for the HF safetensors")
    to_hf.add_argument("--hf-config", default=None, help="directory whose config.json/tokenizer files to ship")
    quantised = to_hf.add_mutually_exclusive_group()
    quantised.add_argument("--fp8", action="store_true",
                           help="write block-wise FP8 weights (float8_e4m3fn + weight_scale_inv per block), as "
                                "DeepSeek-V3 ships them: the quantization_config of --hf-config, else of the FP8 "
                                "checkpoint converted, else 128x128 blocks")
    quantised.add_argument("--mxfp4", action="store_true",
                           help="write gpt-oss's experts in MXFP4 (uint8 _blocks + _scales), as OpenAI ships them, "
                                "with the scales of the MXFP4 checkpoint converted wherever they still hold")
    layout_args(to_hf)  # each rank loads only its shard at this layout; the export stream gathers
    lora = sub.add_parser("lora-to-hf", help="a LoRA run's checkpoint -> a PEFT adapter and/or merged HF weights")
    lora.add_argument("--checkpoint", required=True, help="run_dir/checkpoints/step_N of a run with actor.lora")
    lora.add_argument("--adapter-out", default=None,
                      help="directory for the PEFT adapter (adapter_config.json + adapter_model.safetensors)")
    lora.add_argument("--merged-out", default=None, help="directory for HF safetensors with the adapters merged in")
    lora.add_argument("--tp", type=int, default=1, help="TP of the ranks that rebuild the model (any: it reshards)")
    lora.add_argument("--nproc", type=int, default=None, help="ranks to spawn here; default: --tp")
    lora.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    check = sub.add_parser("verify", help="max-abs and cosine logit diff, Megatron vs HF transformers")
    check.add_argument("--hf-path", required=True, help="directory of the HF checkpoint to compare against")
    check.add_argument("--mcore-path", required=True, help="directory of the Megatron checkpoint to check")
    check.add_argument("--tolerance", type=float, default=1e-3,
                       help="largest max-abs logit difference accepted (default 1e-3); beyond it, exit 3")
    layout_args(check)
    return parser


def _layout(args):
    from rlmegatron.runtime import ParallelLayout

    tp = getattr(args, "tp", 1)
    # Sequence parallelism only where Megatron needs it (MoE with TP>1); it changes no weight or logit, and a
    # vision-language model refuses it.
    return ParallelLayout(tp=tp, pp=getattr(args, "pp", 1), vpp=getattr(args, "vpp", None), ep=getattr(args, "ep", 1),
                          etp=getattr(args, "etp", None), sequence_parallel=tp > 1 and _has_experts(args),
                          first_stage_layers=getattr(args, "first_stage_layers", None),
                          last_stage_layers=getattr(args, "last_stage_layers", None))


def _has_experts(args) -> bool:
    """Whether the model the command converts has routed experts, read from its config.json as its family reads it
    (False where the input is missing or unreadable: preflight names that)."""
    from rlmegatron.models.convert import ConvertMeta
    from rlmegatron.rank.checkpoint_state import AdapterMeta

    try:
        if getattr(args, "hf_path", None):
            config = _config_json(args.hf_path)
        elif getattr(args, "mcore_path", None):
            config = ConvertMeta.load(args.mcore_path).hf_config
        else:  # lora-to-hf: the base model the run trained, named in the checkpoint's adapter metadata
            config = _config_json(AdapterMeta.load(os.path.join(args.checkpoint, "actor")).base_model)
        return architecture_of(config).is_moe
    except (ValueError, OSError, TypeError):
        return False


def default_nproc(layout) -> int:
    """The fewest ranks that hold the dense layers (TP x PP) and the experts (ETP x EP x PP) alike."""
    return layout.pp * math.lcm(layout.tp, (layout.etp or layout.tp) * layout.ep)


def _job(direction: str, args: dict):
    """What every rank runs; a module-level function so spawned ranks can import it."""
    ns = argparse.Namespace(**args)
    if direction == "hf-to-mcore":
        return hf_to_mcore(ns.hf_path, ns.out, _layout(ns), ns.dtype)
    if direction == "mcore-to-hf":
        return mcore_to_hf(ns.mcore_path, ns.out, ns.hf_config, _layout(ns), ns.fp8, ns.mxfp4)
    if direction == "lora-to-hf":
        return lora_to_hf(ns.checkpoint, ns.adapter_out, ns.merged_out, _layout(ns))
    return verify(ns.hf_path, ns.mcore_path, _layout(ns))


# ---- rank bodies -------------------------------------------------------------------------------------------------
def hf_to_mcore(hf_path: str, out: str, layout, dtype: str = "fp32") -> None:
    """Rank body of `rlm convert hf-to-mcore`."""
    import torch

    from rlmegatron.models.carried import save_carried
    from rlmegatron.models.convert import HFCheckpoint, import_hf, save_mcore, save_source_scales
    from rlmegatron.models.hf_config import read_hf_config

    _, weight_map, chunks = import_hf(hf_path, layout, dtype)
    save_mcore(chunks, weight_map, out, dtype, tokenizer_dir=hf_path,
               quantization_config=read_hf_config(hf_path).get("quantization_config"))
    if torch.distributed.get_rank() == 0:
        save_source_scales(HFCheckpoint(hf_path), out)
        save_carried(hf_path, out, weight_map.facts.family)
    torch.distributed.barrier()


def export_format(mcore_path: str, hf_config_dir: str | None, fp8: bool, mxfp4: bool = False):
    """(config.json, format of the weights or None) of `mcore-to-hf`: the config of --hf-config, else the converted
    model's, with the quantization_config of the weights written (none without --fp8 or --mxfp4: they are not
    quantised). --mxfp4 writes the MXFP4 quantization_config of --hf-config, else of the checkpoint converted, else
    gpt-oss's as released; UnsupportedQuantization for a model without gpt-oss's experts, or whose experts' inputs
    are not whole groups of 32."""
    from rlmegatron.models import mxfp4 as mx
    from rlmegatron.models.convert import ConvertMeta
    from rlmegatron.models.fp8 import DEFAULT_CONFIG, BlockFP8, UnsupportedQuantization
    from rlmegatron.models.hf_config import read_hf_config

    meta = ConvertMeta.load(mcore_path)
    config = read_hf_config(hf_config_dir) if hf_config_dir else meta.hf_config
    unquantised = {key: value for key, value in config.items() if key != "quantization_config"}
    if mxfp4:
        declared = [q for q in (config.get("quantization_config"), meta.quantization_config)
                    if isinstance(q, dict) and q.get("quant_method") == mx.QUANT_METHOD]
        quantisation = mx.MXFP4.from_hf_config({**unquantised, "quantization_config": (declared or [
            mx.DEFAULT_CONFIG])[0]})
        if quantisation is None:
            raise UnsupportedQuantization(f"MXFP4 is written for the experts of {mx.mxfp4_families()} only, and this "
                                          f"is a {unquantised.get('model_type')!r} model")
        arch = architecture_of(unquantised)
        inputs = {"hidden_size": arch.hidden_size, "intermediate_size": arch.moe_intermediate_size}
        uneven = [f"{name} {size}" for name, size in inputs.items() if size % mx.GROUP]
        if uneven:
            raise UnsupportedQuantization(f"MXFP4 stores experts whose inputs are whole groups of {mx.GROUP}, and "
                                          f"this model's {', '.join(uneven)} is not")
        return unquantised, quantisation
    quantization = config.get("quantization_config") or meta.quantization_config or DEFAULT_CONFIG
    return unquantised, BlockFP8.from_hf_config({"quantization_config": quantization}) if fp8 else None


def mcore_to_hf(mcore_path: str, out: str, hf_config_dir: str | None, layout, fp8: bool = False,
                mxfp4: bool = False) -> None:
    """Rank body of `rlm convert mcore-to-hf`: each rank loads its shard at `layout`; the stream gathers."""
    from rlmegatron.models.convert import load_mcore, source_scales

    _, weight_map, chunks = load_mcore(mcore_path, layout)
    config, quantization = export_format(mcore_path, hf_config_dir, fp8, mxfp4)
    original = source_scales(mcore_path, quantization) if quantization is not None else None
    _write_hf(chunks, weight_map, out, config, hf_config_dir or mcore_path, quantization, original, mcore_path)


def lora_to_hf(checkpoint: str, adapter_out: str | None, merged_out: str | None, layout) -> None:
    """Rank body of `rlm convert lora-to-hf`: the base model from its HF checkpoint, the adapters from the training
    checkpoint (resharded to `layout`), then the same exporter the weight push uses: the PEFT adapter SGLang loads,
    and the merged weights the engines get."""
    from rlmegatron.rank.checkpoint_state import AdapterMeta, load_model_weights
    from rlmegatron.models.convert import HFCheckpoint, build_chunks, load_hf_weights
    from rlmegatron.models.hf_config import model_facts
    from rlmegatron.models.lora import add_adapters
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.resharding import HFWeightExporter, export_peft_adapter
    from rlmegatron.runtime import init_model_parallel

    actor = os.path.join(checkpoint, "actor")
    meta = AdapterMeta.load(actor)
    base = HFCheckpoint(meta.base_model)
    facts = model_facts(base.config, layout.tp, padded_vocab=meta.padded_vocab_size, keys=base.key_files)
    weight_map = WeightMap(facts, stacked_experts=base.stacked_experts)
    init_model_parallel(layout)
    # The adapters' initial values do not matter: the checkpoint's replace them.
    chunks = [add_adapters(chunk, meta.lora, seed=0) for chunk in build_chunks(facts, layout, meta.dtype)]
    load_hf_weights(chunks, weight_map, base)
    base.close()
    load_model_weights(chunks, actor)
    if adapter_out:
        export_peft_adapter(HFWeightExporter(chunks, weight_map), adapter_out, meta.lora, meta.base_model)
    if merged_out:
        _write_hf(chunks, weight_map, merged_out, facts.hf, meta.base_model, carried_from=meta.base_model)


def _write_hf(chunks, weight_map, out: str, config: dict, tokenizer_dir: str, quantisation=None, original_scales=None,
              carried_from: str | None = None) -> None:
    """The chunks as an HF checkpoint (in the format `quantisation`, block-wise FP8 or MXFP4, reusing
    `original_scales` where they still hold) with `tokenizer_dir`'s tokenizer files and the tensors the family
    carries from `carried_from` (the checkpoint the model was converted from); collective, rank 0 writes."""
    import torch

    from rlmegatron.models.carried import carried_tensors
    from rlmegatron.models.convert import copy_tokenizer
    from rlmegatron.resharding import export_hf

    carried = carried_tensors(carried_from, weight_map.facts.family) \
        if carried_from and torch.distributed.get_rank() == 0 else {}
    export_hf(chunks, weight_map, out, config, quantisation=quantisation, original_scales=original_scales,
              carried=carried)
    if torch.distributed.get_rank() == 0:
        copy_tokenizer(tokenizer_dir, out)
    torch.distributed.barrier()


def verify(hf_path: str, mcore_path: str, layout) -> dict[str, float] | None:
    """Rank body of `rlm convert verify`: Megatron vs HF logit diff, on last-stage TP rank 0; else None."""
    from megatron.core import parallel_state as ps

    from rlmegatron.models.convert import compare_logits, hf_logits, load_mcore, megatron_logits, verify_tokens

    facts, _, chunks = load_mcore(mcore_path, layout, dtype="fp32")
    tokens = verify_tokens(facts.vocab_size, batch=max(2, layout.pp))  # a micro-batch per sequence, >= PP
    logits = megatron_logits(chunks, facts, tokens)
    if logits is None or ps.get_tensor_model_parallel_rank() != 0:
        return None
    return compare_logits(hf_logits(hf_path, tokens), logits)


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_BITS = {"fp32": 32, "bf16": 16, "fp16": 16}


def default_dtype(hf_path: str) -> str:
    """hf-to-mcore's --dtype when none is given: the model's own, as config.json declares it, so that a verify after
    it compares like with like (an fp32 model cast to bf16 misses its bound by the rounding); bf16 where it declares
    none, and for block-FP8 weights, whose dequantised values fit bf16's range (fp32's), as DeepSeek-V3 ships them."""
    config = _config_json(hf_path)
    if "quantization_config" in config:
        return "bf16"
    return _declared_dtype(config) or "bf16"


def _config_json(hf_path: str) -> dict:
    try:
        config = json.loads(Path(hf_path, "config.json").read_text())
    except (OSError, ValueError):  # preflight names what is wrong with it
        return {}
    return config if isinstance(config, dict) else {}


def _declared_dtype(config: dict) -> str | None:
    """The weights' dtype config.json declares (transformers 5's `dtype`, before it `torch_dtype`), as --dtype
    names it."""
    return _DTYPES.get(config.get("dtype") or config.get("torch_dtype"))


def _existing_dir(flag: str, path: str) -> Path:
    from rlmegatron.models.convert import ConversionError

    if not Path(path).is_dir():
        raise ConversionError(f"{flag}={path}: no such directory")
    return Path(path)


def _layout_problems(hf: dict, source: Path, layout, world: int | None) -> list[str]:
    """The job spec's checks of a layout against the model (rlmegatron.config.checks), worded with this CLI's flags."""
    from rlmegatron.config.checks import check_layout_fits_model, check_layout_options
    from rlmegatron.config.spec import MegatronConfig

    arch = architecture_of(hf, source)
    megatron = MegatronConfig(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp, sequence_parallel=layout.sequence_parallel)
    # Without --nproc the converter spawns as many ranks as the layout needs: no world size narrows the choices.
    world = world or math.lcm(arch.num_attention_heads, arch.num_hidden_layers, arch.num_experts or 1,
                              arch.moe_intermediate_size or 1)
    cluster = SimpleNamespace(placement=SimpleNamespace(trainer_world_size=world))
    problems = check_layout_options("", megatron) + check_layout_fits_model("", megatron, arch, cluster)
    lines = []
    for problem in problems:
        name = problem.field.rsplit(".", 1)[-1]
        line = f"{FLAGS.get(name, name)}={problem.value}: {problem.reason}"
        for field, flag in FLAGS.items():
            line = line.replace(field, flag)
        lines.append(line)
    return lines


def _world(args) -> int | None:
    """The ranks the conversion runs on, when known before it starts: --nproc, else torchrun's."""
    return args.nproc or (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)


def _nproc_problems(args, layout) -> list[str]:
    world = _world(args)
    if world and world % default_nproc(layout):
        return [f"--nproc={world}: Megatron needs a multiple of TP×PP and of ETP×EP×PP; "
                f"use {default_nproc(layout)} or a multiple of it"]
    return []


def _check_fresh_out(flag: str, path: str) -> None:
    from rlmegatron.models.convert import ConversionError

    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{flag}={out}: exists and is not empty; a conversion never overwrites a "
                              "checkpoint: name a new directory, or remove this one")


def _preflight_lora(args, layout) -> None:
    """`lora-to-hf`'s checks: a complete checkpoint of a LoRA run whose base model is on disk, fresh outputs."""
    from rlmegatron.rank.checkpoint_state import ADAPTER_META, AdapterMeta
    from rlmegatron.models.convert import ConversionError, HFCheckpoint

    checkpoint = _existing_dir("--checkpoint", args.checkpoint)
    if not (args.adapter_out or args.merged_out):
        raise ConversionError("nothing to write: name --adapter-out (a PEFT adapter), --merged-out (HF weights with "
                              "the adapters merged) or both")
    if args.adapter_out and args.merged_out and Path(args.adapter_out).resolve() == Path(args.merged_out).resolve():
        raise ConversionError(f"--adapter-out and --merged-out are both {args.merged_out}: name two directories")
    problem = manifest_problem(checkpoint)
    if problem:
        # A run_dir or its checkpoints/ named instead of one of its steps: name the newest complete one.
        newest = CheckpointManager(checkpoint.parent if checkpoint.name == "checkpoints" else checkpoint).latest()
        if newest is not None:
            raise ConversionError(f"--checkpoint={checkpoint}: holds a run's checkpoints, not one; name a step, "
                                  f"e.g. the newest complete one, {newest}")
        raise ConversionError(f"--checkpoint={checkpoint}: not a complete checkpoint ({problem}); name a step_N "
                              "directory under trainer.run_dir/checkpoints")
    meta_file = checkpoint / "actor" / ADAPTER_META
    if not meta_file.is_file():
        raise ConversionError(f"--checkpoint={checkpoint}: not a LoRA checkpoint (no actor/{ADAPTER_META}): only a "
                              "run with actor.lora.rank > 0 saves adapters; a full run's policy is its hf_policy "
                              "export")
    try:
        meta = AdapterMeta.load(meta_file.parent)
    except (ValueError, TypeError, KeyError) as err:
        raise ConversionError(f"{meta_file}: unreadable ({type(err).__name__}: {err})") from err
    if meta.random_init:
        raise ConversionError(f"--checkpoint={checkpoint}: the run started from random base weights "
                              "(model.random_init), which no file holds: there is no base model to apply the "
                              "adapters to")
    if not Path(meta.base_model).is_dir():
        raise ConversionError(f"{meta_file}: base_model {meta.base_model}: no such directory; the adapters need "
                              "the HF model the run trained them on")
    base = HFCheckpoint(meta.base_model)
    for flag, out in (("--adapter-out", args.adapter_out), ("--merged-out", args.merged_out)):
        if out:
            _check_fresh_out(flag, out)
    hf = base.facts(1).hf
    if args.adapter_out and architecture_of(hf, base.path / "config.json").is_moe:
        raise ConversionError(f"--adapter-out={args.adapter_out}: PEFT adapters are written for dense models, and "
                              f"{meta.base_model} has experts; use --merged-out")
    problems = _layout_problems(hf, base.path / "config.json", layout, _world(args)) + _nproc_problems(args, layout)
    if not problems and meta.padded_vocab_size % layout.tp:  # TP's own rules first, as for the other directions
        problems.append(f"--tp={layout.tp}: does not divide the run's padded vocabulary ({meta.padded_vocab_size} "
                        "rows); use a TP size that does")
    if problems:
        raise ConversionError("\n".join(problems))


def preflight(args, layout) -> None:
    """Everything checkable before a rank starts, checked once here: the inputs exist and parse, the output
    overwrites nothing, the model is supported and the layout divides it. Raises ValueError, one line per problem."""
    from rlmegatron.models.convert import META_FILE, ConversionError, ConvertMeta, HFCheckpoint
    from rlmegatron.models.hf_config import UnsupportedModelError, model_facts, read_hf_config, transformer_config
    from rlmegatron.models.weight_map import WeightMap, WeightMapError

    if args.direction == "lora-to-hf":
        return _preflight_lora(args, layout)
    if args.direction in ("hf-to-mcore", "verify"):
        checkpoint = HFCheckpoint(_existing_dir("--hf-path", args.hf_path))
    if args.direction in ("mcore-to-hf", "verify"):
        meta = ConvertMeta.load(_existing_dir("--mcore-path", args.mcore_path))
    if getattr(args, "hf_config", None):
        read_hf_config(_existing_dir("--hf-config", args.hf_config))
    for flag in ("fp8", "mxfp4"):
        if getattr(args, flag, False):
            try:
                export_format(args.mcore_path, args.hf_config, fp8=flag == "fp8", mxfp4=flag == "mxfp4")
            except UnsupportedModelError as err:
                raise UnsupportedModelError(f"--{flag}: {err}") from None
    if args.direction != "verify":
        _check_fresh_out("--out", args.out)
    if args.direction == "hf-to-mcore":
        source = checkpoint.path / "config.json"
    else:
        source = Path(args.mcore_path, META_FILE)

    def facts_at(tp: int):
        try:
            if args.direction == "hf-to-mcore":
                return checkpoint.facts(tp)
            return model_facts(meta.hf_config, tp, padded_vocab=meta.padded_vocab_size, mtp_layers=meta.num_mtp_layers)
        except UnsupportedModelError as err:
            raise UnsupportedModelError(f"{source}: {err}") from err

    # Whether the model is supported at all comes first; then TP's rules (heads, experts), before the padded
    # vocabulary a converted checkpoint fixes is checked at that TP.
    hf = facts_at(1).hf
    problems = _layout_problems(hf, source, layout, _world(args)) + _nproc_problems(args, layout)
    if problems:
        raise ConversionError("\n".join(problems))
    facts = facts_at(layout.tp)
    try:
        transformer_config(facts, layout)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{source}: {err}") from err
    except ValueError as err:  # Megatron-Core's own checks of the model at this layout
        raise UnsupportedModelError(f"{source}: Megatron-Core refuses this model at {layout}: {err}") from err
    if args.direction == "hf-to-mcore":
        try:
            WeightMap(facts, stacked_experts=checkpoint.stacked_experts).check_hf_keys(set(checkpoint.key_files))
        except WeightMapError as err:
            raise WeightMapError(f"{checkpoint.path}: {err}") from err
    notes = [facts.mtp_off_note]
    if args.direction == "hf-to-mcore" and args.dtype == "fp16":
        # bf16 has fp32's exponent range, so FP8 or FP4 values times a scale never leave it; fp16's is far narrower.
        for quantised, what, flag in ((checkpoint.fp8, "FP8 weights", "--fp8"),
                                      (checkpoint.mxfp4, "MXFP4 experts", "--mxfp4")):
            if quantised is not None:
                notes.append(f"the {what} are dequantised and rounded to fp16, whose range loses magnitudes below "
                             f"6e-8 and above 65504; --dtype bf16 or fp32 holds every one, so that mcore-to-hf {flag} "
                             "gives back the checkpoint's bytes")
    if os.environ.get("RANK", "0") == "0":
        for note in filter(None, notes):
            print(f"rlm convert {args.direction}: {note}", file=sys.stderr, flush=True)


def _refuse(direction: str, err: BaseException) -> int:
    """A user's mistake: one line per problem, exit 2; RLM_DEBUG=1 adds the traceback. Under torchrun rank 0 says it."""
    if os.environ.get("RANK", "0") == "0":
        if os.environ.get("RLM_DEBUG") == "1":
            traceback.print_exception(err)
        for line in str(err).splitlines():
            print(f"rlm convert {direction}: {line}", file=sys.stderr)
    return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from rlmegatron.runtime.notices import quiet_library_notices

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.direction == "hf-to-mcore" and args.dtype is None:
        args.dtype = default_dtype(args.hf_path)
    # Before Megatron-Core is imported: preflight builds its TransformerConfig here, as the ranks (which quiet their
    # own) do; its notices are no more the user's here than in `rlm train`.
    quiet_library_notices(device)
    from rlmegatron.models.convert import ConversionError, UnsupportedModelError
    from rlmegatron.models.weight_map import WeightMapError
    from rlmegatron.runtime import destroy_distributed, init_distributed
    from rlmegatron.transport.local_ranks import RankFailure, run_ranks

    layout = _layout(args)
    try:
        preflight(args, layout)
    except (ConversionError, UnsupportedModelError, WeightMapError) as err:
        return _refuse(args.direction, err)
    try:
        if "RANK" in os.environ and args.nproc is None:  # under torchrun
            init_distributed(device)
            results = [_job(args.direction, vars(args))]
            destroy_distributed()
        else:
            nproc = args.nproc or default_nproc(layout)
            results = run_ranks(_job, nproc, args.direction, vars(args), device=device, timeout_s=24 * 3600)
    except (RankFailure, ValueError) as err:
        print(f"rlm convert {args.direction}: {err}", file=sys.stderr)
        return EXIT_FAILED
    if args.direction == "verify":
        diffs = [r for r in results if r]
        if not diffs:
            return EXIT_OK  # a non-reporting torchrun rank
        worst = max(diffs, key=lambda d: d["max_abs_diff"])
        print(f"logits max_abs_diff={worst['max_abs_diff']:.3e} cosine={worst['cosine']:.8f} (tolerance {args.tolerance:g})")
        if worst["max_abs_diff"] <= args.tolerance:
            return EXIT_OK
        from rlmegatron.models.convert import ConvertMeta

        held, declared = ConvertMeta.load(args.mcore_path).dtype, _declared_dtype(_config_json(args.hf_path))
        if declared is not None and _BITS[held] < _BITS[declared]:
            print(f"rlm convert verify: the Megatron checkpoint holds {held} weights and the model is {declared}: "
                  f"the rounding alone moves the logits; convert with hf-to-mcore --dtype {declared} to compare like "
                  "with like, or allow for it with --tolerance", file=sys.stderr)
        return EXIT_BEYOND_TOLERANCE
    written = [getattr(args, name, None) for name in ("out", "adapter_out", "merged_out")]
    print(f"rlm convert {args.direction}: wrote {' and '.join(path for path in written if path)}")
    return EXIT_OK
