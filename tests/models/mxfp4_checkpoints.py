"""A tiny gpt-oss checkpoint with MXFP4 experts, as OpenAI ships gpt-oss, quantised here independently of
rlmegatron.models.mxfp4, its dequantised reference (what a converter must read the MXFP4 checkpoint as), and the rank
job that reads both."""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny_hf import save_tiny_model

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
QUANTIZATION = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
EXPERTS = ("gate_up_proj", "down_proj")
# Expert 1 of layer 0's gate_up_proj holds groups whose scale no value determines: an all-zero group with the scale
# 2^-27 (output 0), a group whose magnitudes are 1, 2 and 3 (output 1: twice the scale holds them too), and -0 codes
# (output 2).
PLANTED = ("model.layers.0.mlp.experts.gate_up_proj", 1)


def quantise_mx(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, out, in / 32, 16], scales [E, out, in / 32]) of a stacked [E, in, out] weight by the OCP MX
    rule: a group's scale is 2^(floor(log2 largest) - 2), each value the nearest FP4 value (6 at most)."""
    groups = weight.transpose(1, 2).float().unflatten(2, (-1, 32))
    exponent = torch.floor(torch.log2(groups.abs().amax(dim=3))) - 2
    codes = (groups[..., None] / torch.exp2(exponent)[..., None, None] - FP4).abs().argmin(dim=-1).to(torch.uint8)
    return codes[..., 0::2] | codes[..., 1::2] << 4, (exponent + 127).to(torch.uint8)


def dequantise_mx(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The stacked [E, in, out] weight of MXFP4 blocks and scales, in float32, one element at a time."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2).long()
    powers = torch.tensor([math.ldexp(1.0, int(s) - 127) for s in scales.flatten()]).view(scales.shape)
    return (FP4[codes] * powers[..., None]).flatten(-2).transpose(1, 2).contiguous()


def _plant(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    generator = torch.Generator().manual_seed(0)
    _, expert = PLANTED
    blocks[expert, 0, 0], scales[expert, 0, 0] = 0, 100
    even = torch.tensor([0, 2, 4, 5, 10, 12, 13], dtype=torch.uint8)  # 0, ±1, ±2, ±3
    codes = even[torch.randint(len(even), (32,), generator=generator)]
    codes[0] = 5  # 3: the largest
    blocks[expert, 1, 0] = codes[0::2] | codes[1::2] << 4
    blocks[expert, 2, 0, :4] = 0x88  # -0, -0: the group's first 8 values
    blocks[expert, 2, 0, 4] = 0x87  # 6 then -0: the group's largest stays where the MX rule put it


def save_mxfp4_model(directory: str) -> tuple[str, str]:
    """(MXFP4 checkpoint, its fp32 reference) of tiny_hf's gpt_oss in `directory`: the experts' weights as uint8
    blocks and scales (the PLANTED groups among them), every other tensor bf16, config.json with gpt-oss's
    quantization_config; the reference holds the same values dequantised, as a plain checkpoint."""
    source = save_tiny_model("gpt_oss", os.path.join(directory, "source"))
    mxfp4_dir, reference_dir = os.path.join(directory, "mxfp4"), os.path.join(directory, "reference")
    mxfp4, reference = {}, {}
    for key, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if key.endswith(EXPERTS):
            blocks, scales = quantise_mx(tensor)
            if key == PLANTED[0]:
                _plant(blocks, scales)
            mxfp4[key + "_blocks"], mxfp4[key + "_scales"] = blocks, scales
            reference[key] = dequantise_mx(blocks, scales)
        else:
            mxfp4[key] = tensor.to(torch.bfloat16)
            reference[key] = mxfp4[key].float()
    config = json.loads(open(os.path.join(source, "config.json")).read())
    for out, tensors, extra in ((mxfp4_dir, mxfp4, {"quantization_config": QUANTIZATION}),
                                (reference_dir, reference, {})):
        os.makedirs(out)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as file:
            json.dump({**config, **extra}, file, indent=1)
    return mxfp4_dir, reference_dir


def mxfp4_read_job(layouts: list, workdir: str) -> dict:
    """Per layout: the Megatron weights read from the MXFP4 checkpoint in `workdir` that differ from those read
    from its reference, and which experts' MXFP4 slabs this rank dequantised (None: a whole stacked tensor)."""
    from rlmegatron.models.convert import HFCheckpoint, import_hf

    dequantise = HFCheckpoint._dequantised_mxfp4
    slabs = set()

    def recorded(self, key, lead):
        slabs.add(lead[0] if lead else None)
        return dequantise(self, key, lead)

    HFCheckpoint._dequantised_mxfp4 = recorded
    report = {}
    for layout in layouts:
        slabs.clear()
        _, _, chunks = import_hf(os.path.join(workdir, "mxfp4"), layout)
        _, _, reference = import_hf(os.path.join(workdir, "reference"), layout)
        read = [dict(chunk.named_parameters()) for chunk in chunks]
        expected = [dict(chunk.named_parameters()) for chunk in reference]
        report[str(layout)] = {
            "differ": sorted(n for got, want in zip(read, expected) for n in want if not torch.equal(got[n], want[n])),
            "expert_weights": sum(".experts." in n and n.endswith("weight") for want in expected for n in want),
            "slabs": sorted(slabs, key=str)}
    return report
