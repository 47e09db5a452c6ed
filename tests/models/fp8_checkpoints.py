"""Tiny block-wise FP8 checkpoints, quantised here independently of rlmegatron.models.fp8, and their dequantised
reference: what a converter must read the FP8 checkpoint as."""
from __future__ import annotations

import json
import math
import os
import re

import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny_hf import save_tiny_model

# Rows x columns of a scale's block: the tiny models' 64-, 96- and 32-wide weights end in partial blocks both ways,
# and a TP=2 half of 64 rows or columns starts inside a block.
BLOCK = (40, 48)
# The projections DeepSeek-V3 and Qwen3-FP8 ship as FP8, by their names.
# As the releases quantise: DeepSeek-V3.2's indexer's query and key projections too, not its per-head weights.
_PROJECTIONS = re.compile(r"\.(q|k|v|o|gate|up|down|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?\.weight$"
                          r"|\.indexer\.(wq_b|wk)\.weight$")


def quantise_block_wise(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block), each block's largest magnitude at 448, as DeepSeek's
    and SGLang's quantisers do."""
    rows = math.ceil(weight.shape[0] / block[0])
    cols = math.ceil(weight.shape[1] / block[1])
    scale = torch.empty(rows, cols)
    quantised = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            window = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale[i, j] = weight[window].abs().max() / 448.0
            quantised[window] = (weight[window] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantised, scale


def dequantise_block_wise(quantised: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return quantised.float() * expanded[: quantised.shape[0], : quantised.shape[1]]


def save_fp8_model(name: str, directory: str, not_converted: tuple[str, ...] = ()) -> tuple[str, str]:
    """(FP8 checkpoint, its fp32 reference) of tiny_hf's `name`, in `directory`: the projections quantised block-wise
    except the modules `not_converted` (listed as modules_to_not_convert), every other tensor bf16; the reference
    holds the same values dequantised, as a plain checkpoint."""
    source = save_tiny_model(name, os.path.join(directory, "source"))
    fp8_dir, reference_dir = os.path.join(directory, "fp8"), os.path.join(directory, "reference")
    fp8, reference = {}, {}
    for key, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if _PROJECTIONS.search(key) and key.removesuffix(".weight") not in not_converted:
            fp8[key], fp8[key + "_scale_inv"] = quantise_block_wise(tensor)
            reference[key] = dequantise_block_wise(fp8[key], fp8[key + "_scale_inv"])
        else:
            fp8[key] = tensor.to(torch.bfloat16)
            reference[key] = fp8[key].float()
    config = json.loads(open(os.path.join(source, "config.json")).read())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(BLOCK), "modules_to_not_convert": list(not_converted)}
    for out, tensors, extra in ((fp8_dir, fp8, {"quantization_config": quantization}), (reference_dir, reference, {})):
        os.makedirs(out)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as file:
            json.dump({**config, **extra}, file, indent=1)
    return fp8_dir, reference_dir
