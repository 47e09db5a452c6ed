"""Rank-side bodies of the conversion tests: every family through every layout in one process group."""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from rlmegatron.runtime import ParallelLayout as L
from tests.models.tiny_hf import MOE_FAMILIES, VARIANTS, family_of

# Every family at every layout the converter promises (TP/PP, and EP for MoE). TP=PP=1 is not among them as a
# conversion of its own: every layout's checkpoint is reloaded at TP=PP=EP=1 (reload_job), where its logits are
# checked against transformers and its export bitwise, and TP=1 slicing is PP=2's (and EP=2's) per stage.
LAYOUTS = (L(tp=2), L(pp=2), L(tp=2, pp=2))
MOE_LAYOUTS = (L(ep=2),)
# Layouts whose code path does not depend on the family run on one family each: the interleaved pipeline (--vpp,
# a layer per virtual stage), experts over fewer TP ranks than the dense layers (--etp), and EP behind an uneven
# PP (--first-stage-layers 1, as the DeepSeek-V3 recipe splits), where DeepSeek's MTP layer sits on the last
# stage, after 3 decoder layers, with its experts spread.
EXTRA_LAYOUTS = {"llama": (L(pp=2, vpp=2),), "qwen3_moe": (L(tp=2, ep=2, etp=1),),
                 "deepseek_v3": (L(pp=2, ep=2, first_stage_layers=1),)}
# A variant's difference does not depend on the layout, so each runs at one: rope scaling on the rotary embedding
# of both pipeline stages and both TP ranks; DeepSeek without MTP where its MTP layer would sit, with experts spread.
VARIANT_LAYOUTS = {"llama3.2_rope": L(tp=2, pp=2), "llama_custom_rope": L(tp=2, pp=2),
                   "deepseek_v3_no_mtp": L(pp=2, ep=2)}
assert VARIANT_LAYOUTS.keys() == VARIANTS.keys()
BIASED_EXPERTS = ("gpt_oss",)
COMBINED_TP_PP = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")


def layouts_for(name: str) -> list[L]:
    """The layouts a family, or a variant (tiny_hf.VARIANTS), is converted at."""
    moe = family_of(name) in MOE_FAMILIES
    if name in VARIANTS:
        chosen = (VARIANT_LAYOUTS[name],)
    else:
        # TP=2 x PP=2 together is a path of the converter's, the same for every family: the families added since it
        # was (issue 44's) run TP=2, PP=2 and EP=2 on their own.
        base = LAYOUTS if name in COMBINED_TP_PP else tuple(layout for layout in LAYOUTS
                                                             if layout.tp == 1 or layout.pp == 1)
        chosen = base + (MOE_LAYOUTS if moe else ()) + EXTRA_LAYOUTS.get(name, ())
    # MoE with TP>1 runs with sequence parallelism, as Megatron requires; gpt-oss's biased experts with expert TP 1.
    layouts = [dataclasses.replace(layout, sequence_parallel=moe and layout.tp > 1) for layout in chosen]
    return [dataclasses.replace(layout, etp=1) if name in BIASED_EXPERTS and layout.tp > 1 else layout
            for layout in layouts]


def _read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def _max_diff(reference: torch.Tensor, logits):
    return None if logits is None else float((reference - logits).abs().max())


def _differences(original: dict[str, torch.Tensor], exported_dir: str) -> dict[str, list[str]]:
    exported = _read_safetensors(exported_dir)
    return {"key_mismatch": sorted(set(original) ^ set(exported)),
            "not_bitwise": sorted(k for k in original.keys() & exported.keys() if not torch.equal(original[k], exported[k]))}


def hf_mtp_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint's first MTP layer as DeepSeek-V3 defines it (GLM-4.5's is the same), which
    transformers does not build: at position i, the main model's final hidden state and the embedding of token i+1
    predict token i+2."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask

    layers = AutoConfig.from_pretrained(hf_dir).num_hidden_layers
    # One decoder layer more, so transformers loads the MTP layer's transformer block (layer `layers`) too.
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, num_hidden_layers=layers + 1)
    config = model.config
    config.num_hidden_layers = layers  # the main forward stops before the MTP layer
    prefix = f"model.layers.{layers}."
    mtp = {k.removeprefix(prefix): v for k, v in _read_safetensors(hf_dir).items() if k.startswith(prefix)}

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        module = type(model.model.norm)(config.hidden_size, config.rms_norm_eps)  # the family's RMSNorm
        module.weight.data = mtp[f"{name}.weight"]
        return module(x)

    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state
        embedded = model.model.embed_tokens(tokens.roll(-1, dims=1))
        x = torch.cat([norm("enorm", embedded), norm("hnorm", hidden)], dim=-1) @ mtp["eh_proj.weight"].T
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        x = model.model.layers[layers](x, attention_mask=mask, position_ids=positions,
                                       position_embeddings=model.model.rotary_emb(x, positions))
        return model.lm_head(norm("shared_head.norm", x))


def megatron_mtp_logits(model, facts, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the first MTP layer of an unsharded Megatron model (TP=PP=1), through Megatron's own MTP forward."""
    captured = {}
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output))
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None, labels=tokens)  # labels: MTP runs
        hook.remove()
        # The block returns the main hidden states and each MTP layer's, after its final norm, along the sequence.
        logits, _ = model.output_layer(captured["hidden"][tokens.shape[1]:])
    return logits.transpose(0, 1)[..., : facts.vocab_size]


def convert_job(families: list[str], workdir: str) -> dict:
    """Per family and layout, on every rank of the layout: HF -> Megatron, the sharded model's logits (on the last
    stage's ranks, else None), its dist_checkpointing save and its HF export straight from the shards. Everything
    that is not sharded is checked once, in reload_job."""
    from rlmegatron.models.carried import carried_tensors, save_carried
    from rlmegatron.models.convert import import_hf, megatron_logits, save_mcore, verify_tokens
    from rlmegatron.resharding import export_hf

    report = {}
    for family in families:
        hf_dir = os.path.join(workdir, family, "hf")
        for layout in layouts_for(family):
            facts, weight_map, chunks = import_hf(hf_dir, layout)
            report[f"{family}/{layout}"] = {"logits": megatron_logits(chunks, facts, verify_tokens(facts.vocab_size)),
                                            "mtp_layers": facts.num_mtp_layers}
            out = os.path.join(workdir, family, str(layout))
            save_mcore(chunks, weight_map, out, "fp32")
            # What `rlm convert` keeps of the tensors the family carries as they are (models.carried).
            carried = carried_tensors(hf_dir, facts.family) if torch.distributed.get_rank() == 0 else {}
            if carried:
                save_carried(hf_dir, out, facts.family)
            export_hf(chunks, weight_map, os.path.join(workdir, family, f"{layout}-hf"), facts.hf, carried=carried)
    return report


def reload_job(families: list[str], workdir: str) -> dict:
    """On one rank, after convert_job: per family, transformers' logits (the reference); per layout, the export
    against the original tensors and through from_pretrained, and the checkpoint reloaded at TP=PP=EP=1 (a layout
    other than the one it was saved at): its logits (its MTP layer's too) and its export. One rank, because four
    ranks at TP=PP=EP=1 would each load and check the same whole model."""
    from rlmegatron.models.carried import carried_tensors
    from rlmegatron.models.convert import hf_logits, load_mcore, megatron_logits, verify_tokens
    from rlmegatron.resharding import export_hf

    report = {}
    for family in families:
        hf_dir = os.path.join(workdir, family, "hf")
        original = _read_safetensors(hf_dir)
        reference = mtp_reference = None
        for layout in layouts_for(family):
            out = os.path.join(workdir, family, f"{layout}-hf")
            facts, weight_map, chunks = load_mcore(os.path.join(workdir, family, str(layout)), L())
            tokens = verify_tokens(facts.vocab_size)
            reference = hf_logits(hf_dir, tokens) if reference is None else reference
            entry = {"reference": reference, "exported": _differences(original, out),
                     "from_pretrained_logits_vs_hf": float((hf_logits(out, tokens) - reference).abs().max()),
                     "reloaded_tp1_logits_vs_hf": _max_diff(reference, megatron_logits(chunks, facts, tokens))}
            if facts.num_mtp_layers:
                # The last position's next token is past the end: Megatron and the reference pad it differently.
                mtp_reference = hf_mtp_logits(hf_dir, tokens) if mtp_reference is None else mtp_reference
                entry["reloaded_tp1_mtp_logits_vs_hf"] = _max_diff(
                    mtp_reference[:, :-1], megatron_mtp_logits(chunks[0], facts, tokens)[:, :-1])
            reloaded_out = os.path.join(workdir, family, f"{layout}-reloaded-hf")
            export_hf(chunks, weight_map, reloaded_out, facts.hf,
                      carried=carried_tensors(os.path.join(workdir, family, str(layout)), facts.family))
            entry["reloaded_exported"] = _differences(original, reloaded_out)
            report[f"{family}/{layout}"] = entry
    return report


def fp8_job(cases: dict[str, L], workdir: str) -> dict:
    """Per case (a save_fp8_model directory under `workdir`, and a layout): the Megatron weights read from the FP8
    checkpoint that differ from those read from its dequantised reference; then `rlm convert hf-to-mcore` (at its
    default, bf16) and `mcore-to-hf --fp8` at that layout, and the HF tensors whose bytes differ from the FP8
    checkpoint's."""
    from rlmegatron.entry.convert_command import hf_to_mcore, mcore_to_hf
    from rlmegatron.models.convert import import_hf

    report = {}
    for name, layout in cases.items():
        fp8_dir, reference_dir = (os.path.join(workdir, name, kind) for kind in ("fp8", "reference"))
        _, _, chunks = import_hf(fp8_dir, layout)
        _, _, reference = import_hf(reference_dir, layout)
        read = [dict(chunk.named_parameters()) for chunk in chunks]
        expected = [dict(chunk.named_parameters()) for chunk in reference]
        entry = {"differ": sorted(n for got, want in zip(read, expected) for n in want if not torch.equal(got[n], want[n])),
                 "weights": sum(len(want) for want in expected)}
        mcore_dir, out = os.path.join(workdir, name, "mcore"), os.path.join(workdir, name, "fp8-again")
        hf_to_mcore(fp8_dir, mcore_dir, layout, "bf16")
        mcore_to_hf(mcore_dir, out, None, layout, fp8=True)
        if torch.distributed.get_rank() == 0:
            original, again = _read_safetensors(fp8_dir), _read_safetensors(out)
            entry["key_mismatch"] = sorted(set(original) ^ set(again))
            entry["not_bitwise"] = sorted(k for k in original.keys() & again.keys() if original[k].dtype != again[k].dtype
                                          or not torch.equal(original[k].view(torch.uint8), again[k].view(torch.uint8)))
            configs = [json.loads(open(os.path.join(d, "config.json")).read()) for d in (fp8_dir, out)]
            entry["quantization_config"] = [c["quantization_config"] for c in configs]
        report[name] = entry
    return report
