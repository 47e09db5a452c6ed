"""A vision-language model directory small enough to make in a test: the char tokenizer with Qwen2.5-VL's vision
tokens, a bare chat template, Qwen2-VL's image processor at 4-pixel patches, and solid-colour PNG images."""
from __future__ import annotations

import io
from pathlib import Path

COLOURS = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (30, 40, 220), "y": (230, 220, 40)}


def make_vl_model_dir(directory: Path):
    """The tokenizer and image processor of a tiny Qwen2.5-VL in `directory`; returns the tokenizer."""
    from rlmegatron.data.tokenizer import save_tiny_vision_processor

    return save_tiny_vision_processor(directory)


def save_image_processor(directory) -> None:
    """Qwen2-VL's image processor at 4-pixel patches (tests/models/tiny_vl's tower), with the tokenizer."""
    make_vl_model_dir(directory)


def png(colour: str, size: tuple[int, int] = (8, 8)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()
