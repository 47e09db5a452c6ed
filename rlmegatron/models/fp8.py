"""Block-wise FP8 HF checkpoints, the format DeepSeek-V3 and Qwen3's FP8 releases ship: what config.json's
`quantization_config` must say for them to be read, exact dequantisation of a window of a quantised weight, and the
block-wise quantisation that writes the format back (`rlm convert mcore-to-hf --fp8`) and that FP8 rollout's weight
sync streams (rollout.quantization fp8).

In that format each quantised weight is float8_e4m3fn, beside it a float32 `<name>_scale_inv` with one scale per
`weight_block_size` block (edge blocks may be partial); the weight's value is fp8 × its block's scale. Embeddings,
norms, routers, the output head, MTP layers' eh_proj and whatever `modules_to_not_convert` names stay unquantised.
gpt-oss's MXFP4 experts are read by models.mxfp4. Any other quantisation (per-tensor or per-channel FP8 scales, MXFP4
on another family, NVFP4, ...) is refused by name before a rank starts (UnsupportedQuantization), since reading its
tensors as if they were plain weights would load garbage.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch

from rlmegatron.models.families import UnsupportedModelError

SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
FP8_HEADER_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# The HF weights that transformers' and SGLang's FP8 loaders quantise: the linear projections of attention and MLPs,
# experts and shared experts included (Mixtral's experts are w1/w2/w3 under block_sparse_moe). The routers (gate),
# eh_proj and the rest are not projections under those modules. DeepSeek-V3.2's and GLM-5's sparse-attention indexer
# is the exception both ways: its query and key projections (wq_b, wk) are FP8 as released, and its per-head weights
# (weights_proj) bf16, as SGLang's indexer loads them (a quantised weights_proj has no place to go there).
_QUANTISED = re.compile(r"\.(self_attn|mlp|block_sparse_moe)\.(.+\.)?([a-z_]*proj[a-z_]*|w[123])\.weight$"
                        r"|\.self_attn\.indexer\.(wq_b|wk)\.weight$")
_KEPT_IN_BF16 = re.compile(r"\.self_attn\.indexer\.weights_proj\.weight$")
# DeepSeek-V3's quantization_config: FP8 rollout's format, and what `rlm convert mcore-to-hf --fp8` writes when the
# model did not come from an FP8 checkpoint.
DEFAULT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Formats other frameworks write that are not read here, named as users know them.
_KNOWN_FORMATS = {"mxfp4": "MXFP4", "fbgemm_fp8": "per-channel FP8", "gptq": "GPTQ", "awq": "AWQ"}
_REFUSAL_FIX = ("only block-wise FP8 (quant_method fp8 with weight_block_size, as DeepSeek-V3 and Qwen3-FP8 ship) "
                "is read, and gpt-oss's MXFP4 experts (models.mxfp4); dequantise the checkpoint to bf16 first")


class UnsupportedQuantization(UnsupportedModelError):
    """A quantised checkpoint whose format is not block-wise FP8."""


def _format_name(config: dict) -> str:
    """E.g. "MXFP4 (quant_method mxfp4)", "NVFP4 (quant_method modelopt)"."""
    method = config.get("quant_method")
    # ModelOpt names its format in quant_algo (NVFP4, FP8, ...), compressed-tensors in format.
    name = config.get("quant_algo") or config.get("format") or _KNOWN_FORMATS.get(method, method)
    return f"{name} (quant_method {method})"


@dataclass(frozen=True)
class BlockFP8:
    """One checkpoint's block-wise FP8 format."""

    block: tuple[int, int]  # rows, columns of a scale's block
    modules_to_not_convert: tuple[str, ...] = ()
    power_of_two_scales: bool = False  # scale_fmt ue8m0 (DeepSeek-V3.1): every scale is 2^k
    config: dict = field(default_factory=dict, compare=False)  # config.json's quantization_config, written back

    @classmethod
    def from_hf_config(cls, hf: dict) -> Optional["BlockFP8"]:
        """The format config.json `hf` declares: None when it declares no quantization; UnsupportedQuantization,
        naming the format, when it is not block-wise FP8 e4m3 with dynamic activation scales."""
        config = hf.get("quantization_config")
        if config is None:
            return None
        if not isinstance(config, dict):
            raise UnsupportedQuantization(f"quantization_config={config!r} is not an object")
        method = config.get("quant_method")
        if method != "fp8":
            raise UnsupportedQuantization(f"quantization_config: {_format_name(config)} weights are not supported: "
                                          f"{_REFUSAL_FIX}")
        block = config.get("weight_block_size")
        if block is None:
            raise UnsupportedQuantization("quantization_config: per-tensor FP8 scales (quant_method fp8 without "
                                          f"weight_block_size) are not supported: {_REFUSAL_FIX}")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise UnsupportedQuantization(f"quantization_config: weight_block_size={block!r} is not two positive "
                                          "integers [rows, columns]")
        refusals = {"fmt": ("e4m3", "FP8 values"), "activation_scheme": ("dynamic", "activation scales"),
                    "scale_fmt": ("ue8m0", "scales")}
        for key, (supported, what) in refusals.items():
            if config.get(key) not in (None, supported):
                raise UnsupportedQuantization(f"quantization_config: {what} {key}={config[key]!r} are not supported: "
                                              f"{_REFUSAL_FIX} ({key} {supported})")
        skipped = config.get("modules_to_not_convert") or ()
        if not (isinstance(skipped, (list, tuple)) and all(isinstance(m, str) for m in skipped)):
            raise UnsupportedQuantization(f"quantization_config: modules_to_not_convert={skipped!r} is not a list "
                                          "of module names")
        return cls((block[0], block[1]), tuple(skipped), config.get("scale_fmt") == "ue8m0", dict(config))

    # ---- which tensors ------------------------------------------------------------------------------------------
    def quantises(self, key: str) -> bool:
        """Whether the format stores HF tensor `key` quantised (export and sync quantise exactly these)."""
        if not _QUANTISED.search(key) or _KEPT_IN_BF16.search(key):
            return False
        module = key.removesuffix(".weight")
        # transformers' matching: a listed module, anything inside it, or a name it ends.
        return not any(module == m or module.startswith(m + ".") or module.endswith("." + m)
                       for m in self.modules_to_not_convert)

    def scale_shape(self, shape: Iterable[int]) -> tuple[int, ...]:
        """Shape of the scale of a weight of `shape` (leading dims, e.g. stacked experts, kept)."""
        *lead, rows, cols = shape
        return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def scale_window(self, start: tuple[int, int], shape: tuple[int, int]) -> tuple[slice, slice]:
        """The rows and columns of the scale that cover a [rows, cols] window of the weight at `start`."""
        return tuple(slice(s // b, math.ceil((s + n) / b)) for s, n, b in zip(start, shape, self.block))

    # ---- reading -----------------------------------------------------------------------------------------------
    def dequantise(self, values: torch.Tensor, scales: torch.Tensor, start: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """float32 values of the [rows, cols] window `values` of an FP8 weight, at `start` in it, given the window's
        scales (`scale_window`): each element times its block's scale, a float32 product as the format defines it.
        In place on the float32 copy, a partial column block at either end apart from the whole ones between: no
        scale map of the window's size, and no per-block strided pass (slow on CPU)."""
        rows, cols = self.block
        out = values.to(torch.float32)
        row_scales = scales.to(torch.float32).repeat_interleave(rows, dim=0)[start[0] % rows:][:out.shape[0]]
        width = out.shape[1]
        lead = min(-start[1] % cols, width)  # columns before the window's first block boundary
        whole = (width - lead) // cols
        if lead:
            out[:, :lead] *= row_scales[:, :1]
        block = 1 if lead else 0
        if whole:
            out[:, lead:lead + whole * cols].unflatten(1, (whole, cols)).mul_(row_scales[:, block:block + whole, None])
        if lead + whole * cols < width:
            out[:, lead + whole * cols:] *= row_scales[:, block + whole:block + whole + 1]
        return out

    # ---- writing -----------------------------------------------------------------------------------------------
    def quantise(self, tensor: torch.Tensor, original: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn weight, float32 scale_inv) of a 2-D weight held in `tensor`'s dtype.

        `original`: the scales the weight was imported with (an FP8 checkpoint's, kept by hf-to-mcore). A block
        keeps its original scale whenever quantising it with that scale and dequantising gives back exactly the
        values held (in their dtype): the block was not trained, and its FP8 values come back too, since in bf16 or
        fp32 distinct FP8 values times one scale stay distinct (4 significant bits against 8 or 24). Every other
        block gets a fresh scale that maps its largest magnitude to the format's largest value (448), a power of
        two at least that large for ue8m0 scales; of it and its two float32 neighbours the first that reproduces
        the block is taken (a quantiser that rounded largest / 448 otherwise leaves about 7 % of the scales an ulp
        off, and fp32 weights then still come back byte for byte without the original scales)."""
        rows, cols = tensor.shape
        grid = self.scale_shape(tensor.shape)
        padded = tensor.new_zeros(grid[0] * self.block[0], grid[1] * self.block[1], dtype=torch.float32)
        padded[:rows, :cols] = tensor
        blocks = padded.view(grid[0], self.block[0], grid[1], self.block[1])
        # What the weight holds: padding is zeros, which every scale reproduces.
        held = blocks.to(tensor.dtype)
        largest = blocks.abs().amax(dim=(1, 3))
        scale = largest / FP8_MAX
        if self.power_of_two_scales:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = torch.where(largest > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
        candidates = [scale]
        if not self.power_of_two_scales:
            candidates += [torch.nextafter(scale, torch.full_like(scale, math.inf)),
                           torch.nextafter(scale, torch.zeros_like(scale))]
        if original is not None and tuple(original.shape) == grid:
            candidates.insert(0, original.to(torch.float32))
        chosen = quantised = None
        settled = torch.zeros_like(largest, dtype=torch.bool)  # blocks a candidate reproduces
        for candidate in candidates:  # the first that reproduces its block wins
            q = (blocks / candidate[:, None, :, None]).to(FP8)
            again = (q.to(torch.float32) * candidate[:, None, :, None]).to(tensor.dtype)
            exact = (again == held).all(dim=3).all(dim=1)
            # The fresh scale also takes every block not reproduced so far: one that none reproduces keeps it,
            # never an original scale that failed (a trained block).
            take = ~settled if candidate is scale else exact & ~settled
            chosen = candidate if chosen is None else torch.where(take, candidate, chosen)
            quantised = q if quantised is None else torch.where(take[:, None, :, None], q, quantised)
            settled = settled | exact
        return quantised.view(padded.shape)[:rows, :cols].contiguous(), chosen

    def quantised_stream(self, stream: Iterable[tuple[str, torch.Tensor]], others: Optional[torch.dtype] = None,
                         original_scales: Optional[Callable[[str], Optional[torch.Tensor]]] = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors in this format: each tensor the format quantises as its FP8 weight then its scale, the
        others as they come, or cast to `others`. `original_scales(key)`: the scales `key` was imported with, or
        None (see `quantise`)."""
        for key, value in stream:
            if self.quantises(key):
                weight, scale = self.quantise(value, original_scales(key) if original_scales else None)
                yield key, weight
                yield key + SCALE_SUFFIX, scale
            else:
                yield key, value if others is None else value.to(others)


# The format of FP8 rollout (rollout.quantization fp8) and of an FP8 export of a model that was not FP8 before.
DEFAULT = BlockFP8.from_hf_config({"quantization_config": DEFAULT_CONFIG})
