"""Rank-side bodies of the conversion tests: every family through every layout in one process group."""
from __future__ import annotations

import os

import torch

from rlmegatron.runtime import ParallelLayout
from tests.models.tiny_hf import MOE_FAMILIES

# (TP, PP, EP); MoE with TP>1 runs with sequence parallelism, as Megatron requires.
LAYOUTS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1))
MOE_LAYOUTS = LAYOUTS + ((1, 1, 2),)
# Each layout costs ~12 s on 2 cores (4 ranks, dist_checkpointing save + load), so by default every
# family runs its most-sharded layouts and one family of each kind runs all of them;
# RLM_FULL_CONVERT_MATRIX=1 runs every layout of every family.
DEFAULT_LAYOUTS = {
    "qwen3": LAYOUTS, "llama": ((2, 2, 1),), "qwen2": ((2, 2, 1),),
    "qwen3_moe": MOE_LAYOUTS, "qwen2_moe": ((2, 2, 1), (1, 1, 2)), "mixtral": ((1, 1, 2),),
    "deepseek_v3": ((2, 2, 1), (1, 1, 2)),
}


def layouts_for(family: str) -> list[ParallelLayout]:
    moe = family in MOE_FAMILIES
    if os.environ.get("RLM_FULL_CONVERT_MATRIX") == "1":
        chosen = MOE_LAYOUTS if moe else LAYOUTS
    else:
        chosen = DEFAULT_LAYOUTS[family]
    return [ParallelLayout(tp=tp, pp=pp, ep=ep, sequence_parallel=moe and tp > 1) for tp, pp, ep in chosen]


def _read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def _max_diff(reference: torch.Tensor, logits):
    return None if logits is None else float((reference - logits).abs().max())


def round_trip_job(families: list[str], workdir: str) -> dict:
    """Per family and layout: HF->Megatron logits vs HF, Megatron->HF bitwise, and the checkpoint reloaded
    at TP=PP=EP=1 (a different layout) giving the same logits. Every rank returns its view."""
    from rlmegatron.models.convert import export_hf, hf_logits, import_hf, load_mcore, megatron_logits, save_mcore, verify_tokens

    report = {}
    for family in families:
        hf_dir = os.path.join(workdir, family, "hf")
        original = _read_safetensors(hf_dir)
        reference = None
        for layout in layouts_for(family):
            label = f"{family}/{layout}"
            facts, weight_map, chunks = import_hf(hf_dir, layout)
            tokens = verify_tokens(facts.vocab_size)
            reference = hf_logits(hf_dir, tokens) if reference is None else reference
            entry = {"logits_vs_hf": _max_diff(reference, megatron_logits(chunks, facts, tokens))}
            mcore_dir = os.path.join(workdir, family, str(layout))
            save_mcore(chunks, weight_map, mcore_dir, "fp32")
            out = os.path.join(workdir, family, f"{layout}-hf")
            export_hf(chunks, weight_map, out, facts.hf)  # straight from the sharded layout
            if torch.distributed.get_rank() == 0:
                exported = _read_safetensors(out)
                entry["key_mismatch"] = sorted(set(original) ^ set(exported))
                entry["not_bitwise"] = sorted(k for k in original.keys() & exported.keys()
                                              if not torch.equal(original[k], exported[k]))
                entry["from_pretrained_logits_vs_hf"] = float((hf_logits(out, tokens) - reference).abs().max())
            facts, weight_map, chunks = load_mcore(mcore_dir, ParallelLayout())
            entry["reloaded_tp1_logits_vs_hf"] = _max_diff(reference, megatron_logits(chunks, facts, tokens))
            report[label] = entry
    return report
