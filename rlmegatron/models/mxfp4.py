"""MXFP4 experts, the format gpt-oss is released in: what config.json's `quantization_config` must say for them to be
read, their exact dequantisation one expert at a time, and the quantisation that writes them back
(`rlm convert mcore-to-hf --mxfp4`).

The format (the OCP Microscaling format's MXFP4, laid out as OpenAI ships gpt-oss, transformers reads it and SGLang
loads it): a stacked expert weight `<…>.experts.gate_up_proj` [E, in, out] is stored as two uint8 tensors in Megatron's
orientation, out before in: `gate_up_proj_blocks` [E, out, in / 32, 16], each byte two FP4 (E2M1) codes, the low
nibble first, and `gate_up_proj_scales` [E, out, in / 32], one power of two per group of 32 consecutive inputs, its
exponent biased by 127 (E8M0). A value is the code's FP4 value times its group's scale. Only the experts' weights are
quantised (gate_up_proj and down_proj); their biases, attention, router, embeddings and head stay bf16. transformers
quantises the experts of GptOssMLP alone, so the format is read only for the families whose checkpoints stack their
experts that way (Family.stacked_experts_only: gpt-oss); models.fp8 refuses it, in one line, for any other.

Every MXFP4 value is exact in bf16 (2 significant bits, and float32's exponent range, which the scales stay in:
anything past it is refused), so a bf16 Megatron checkpoint holds the experts exactly. A value alone does not
determine its group's scale, though: a group whose codes are all even (no ±0.5 or ±1.5) is reproduced by twice its
scale too, and an all-zero group by any scale. So `hf-to-mcore` keeps the source's scales beside the Megatron
checkpoint (convert.MXFP4_SCALES_FILE, 1/64 of the bf16 experts' size), and `quantise` gives each group back its
original scale wherever that still reproduces the values held: an untrained model comes back byte for byte.
What cannot come back byte for byte: a group that training moved off its scale's grid gets a fresh scale and its
values are rounded to FP4 (any quantisation loses them); and without the kept scales (a Megatron checkpoint not
converted from this MXFP4 one) the values of an untrained model come back exactly, but the groups whose scale they
leave open get the smallest that holds them, which may not be the scale the release's quantiser chose.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch

from rlmegatron.models.families import FAMILIES, family_for
from rlmegatron.models.fp8 import UnsupportedQuantization

QUANT_METHOD = "mxfp4"
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
GROUP = 32  # values that share a scale
SCALE_BIAS = 127
# The stacked expert weights transformers stores in MXFP4 (GptOssExperts'); their biases are not quantised.
EXPERT_WEIGHTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
# gpt-oss's as OpenAI releases it: what `mcore-to-hf --mxfp4` writes when the model did not come from MXFP4 weights.
DEFAULT_CONFIG = {"quant_method": QUANT_METHOD, "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
# E2M1: codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign (code 8 is -0).
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = torch.tensor(_MAGNITUDES + tuple(-m for m in _MAGNITUDES))
# Between consecutive magnitudes, where rounding to the nearest moves up a code (inf after the last, so that every
# code indexes one).
_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(_MAGNITUDES, _MAGNITUDES[1:])] + [float("inf")])
# float32 2^(byte - 127) for every scale byte, exact (2^-127 is subnormal, 2^128, past the range, inf: the format's
# NaN scale 255 makes its group's values non-finite, which reading refuses).
_POWERS = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - SCALE_BIAS).float()


def _values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of FP4 codes [..., groups, 32] with their groups' scales [..., groups]."""
    return FP4_VALUES[codes.long()] * _POWERS[scales.long()][..., None]


def _codes(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 FP4 codes [..., groups, 32] of float32 `values` at their groups' `scales`: each magnitude rounded to the
    nearest FP4 value (6 at most), a value halfway between two to the even code (the one whose mantissa bit is 0),
    as the MX format recommends; the sign kept, a zero's too."""
    magnitude = values.abs() / _POWERS[scales.long()][..., None]  # a power of two: exact
    code = torch.bucketize(magnitude, _MIDPOINTS[:-1])
    code += ((code % 2 == 1) & (magnitude == _MIDPOINTS[code])).to(code.dtype)
    return (code.clamp(max=7) | torch.signbit(values).long() << 3).to(torch.uint8)


def mxfp4_families() -> str:
    """The display names of the families whose experts the format holds."""
    return ", ".join(f.display_name for f in FAMILIES.values() if f.stacked_experts_only)


@dataclass(frozen=True)
class MXFP4:
    """One checkpoint's MXFP4 format."""

    modules_to_not_convert: tuple[str, ...] = ()
    config: dict = field(default_factory=dict, compare=False)  # config.json's quantization_config, written back

    @classmethod
    def from_hf_config(cls, hf: dict) -> Optional["MXFP4"]:
        """The format config.json `hf` declares: None when it declares none or another, or MXFP4 for a family whose
        experts transformers does not quantise (models.fp8 reads those or refuses them by name)."""
        config = hf.get("quantization_config")
        if not isinstance(config, dict) or config.get("quant_method") != QUANT_METHOD:
            return None
        if not family_for(hf.get("model_type")).stacked_experts_only:
            return None
        skipped = config.get("modules_to_not_convert") or ()
        if not (isinstance(skipped, (list, tuple)) and all(isinstance(m, str) for m in skipped)):
            raise UnsupportedQuantization(f"quantization_config: modules_to_not_convert={skipped!r} is not a list "
                                          "of module names")
        return cls(tuple(skipped), dict(config))

    # ---- which tensors ------------------------------------------------------------------------------------------
    def quantises(self, key: str) -> bool:
        """Whether the format stores HF tensor `key` in MXFP4 (the export quantises exactly these): a stacked expert
        weight whose experts module modules_to_not_convert does not name, as transformers matches it (a pattern
        matches from the start up to a module boundary, as a regular expression, or as a suffix)."""
        if not EXPERT_WEIGHTS.search(key):
            return False
        module = key.rpartition(".")[0]
        return not any(re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(pattern)
                       for pattern in self.modules_to_not_convert)

    @staticmethod
    def weight_shape(blocks_shape: Iterable[int]) -> tuple[int, ...]:
        """The [E, in, out] shape of the weight whose blocks have `blocks_shape` [E, out, in / 32, 16]."""
        *lead, rows, groups, _ = blocks_shape
        return (*lead, groups * GROUP, rows)

    # ---- reading -----------------------------------------------------------------------------------------------
    @staticmethod
    def dequantise(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """float32 [..., out, in] values of blocks [..., out, in / 32, 16] and their scales [..., out, in / 32]:
        each FP4 value times its group's power of two, a product float32 holds exactly while it is in range."""
        codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # low nibble first
        return _values(codes, scales).flatten(-2)

    # ---- writing -----------------------------------------------------------------------------------------------
    @staticmethod
    def quantise(weight: torch.Tensor, original: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks [out, in / 32, 16], scales [out, in / 32]) of one expert's [out, in] weight, held in its dtype
        (`in` a multiple of 32: export_format checks the model).

        `original`: the scales the weight was imported with (kept by hf-to-mcore). A group keeps its original scale
        whenever quantising it with that scale gives back exactly the values held: the group was not trained, and
        its codes come back too (one scale maps distinct codes to distinct values, the sign of zero included). Every
        other group, trained or without an original scale, gets the smallest scale that holds its largest magnitude
        within 6 (so nothing saturates), each value rounded to the nearest FP4 value, ties to the even code as the
        MX format recommends. That scale reproduces every group that is MXFP4 at any scale, so an untrained model
        comes back value for value without the original scales too, though not byte for byte where its quantiser
        chose a larger scale (all-zero groups, groups whose codes are all even). An all-zero group without an
        original scale gets the smallest, 2^-127."""
        held = weight.unflatten(1, (weight.shape[1] // GROUP, GROUP))
        values = held.float().contiguous()  # an expert's [in, out] slab transposed: bucketize wants it contiguous
        mantissa, exponent = torch.frexp(values.abs().amax(dim=2))  # largest = m 2^e, m in [0.5, 1)
        # The smallest k with largest <= 6 * 2^k: e - 3 while m <= 0.75, else e - 2.
        scales = (exponent - 3 + (mantissa > 0.75).int() + SCALE_BIAS).clamp(0, 2 * SCALE_BIAS)
        scales = torch.where(mantissa > 0, scales, 0).to(torch.uint8)
        codes = _codes(values, scales)
        if original is not None and original.shape == scales.shape:
            kept = _codes(values, original)
            exact = (_values(kept, original).to(weight.dtype) == held).all(dim=2)
            scales = torch.where(exact, original, scales)
            codes = torch.where(exact[..., None], kept, codes)
        return codes[..., 0::2] | codes[..., 1::2] << 4, scales

    def quantised_stream(self, stream: Iterable[tuple[str, torch.Tensor]], others: Optional[torch.dtype] = None,
                         original_scales: Optional[Callable[[str], Optional[torch.Tensor]]] = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors in this format: each stacked expert weight [E, in, out] the format quantises as its
        blocks then its scales (an expert at a time), the others as they come, or cast to `others`.
        `original_scales(key)`: the scales `key` was imported with, or None (see `quantise`)."""
        for key, value in stream:
            if not self.quantises(key):
                yield key, value if others is None else value.to(others)
                continue
            original = original_scales(key) if original_scales else None
            if original is not None and original.shape[0] != value.shape[0]:
                original = None
            pairs = [self.quantise(expert.transpose(0, 1), None if original is None else original[e])
                     for e, expert in enumerate(value)]
            yield key + BLOCKS_SUFFIX, torch.stack([blocks for blocks, _ in pairs])
            yield key + SCALES_SUFFIX, torch.stack([scales for _, scales in pairs])
