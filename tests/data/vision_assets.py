"""A vision-language model directory small enough to make in a test: the char tokenizer with Qwen2.5-VL's vision
tokens, a bare chat template, Qwen2-VL's image processor at 4-pixel patches, and solid-colour PNG images."""
from __future__ import annotations

import io
from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
COLOURS = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (30, 40, 220), "y": (230, 220, 40)}


def make_vl_model_dir(directory: Path):
    """The tokenizer and image processor of a tiny Qwen2.5-VL in `directory`; returns the tokenizer."""
    from rlmegatron.data import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(directory))
    save_image_processor(directory)
    return tokenizer


def save_image_processor(directory) -> None:
    """Qwen2-VL's image processor at 4-pixel patches (tests/models/tiny_vl's tower): an 8x8-pixel image is 2x2
    patches, one merged token."""
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 64, "longest_edge": 64 * 64}).save_pretrained(str(directory))


def png(colour: str, size: tuple[int, int] = (8, 8)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()
