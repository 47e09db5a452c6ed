"""Images of a vision-language dataset's rows: verl's multimodal format (an `images` column of bytes, paths, or
{"bytes", "path"} records as HF datasets stores an Image feature, and `<image>` in the prompt where each goes),
read through the model's image processor into the prompt's tokens.

Each `<image>` becomes the family's vision placeholder (Qwen2.5-VL: <|vision_start|><|image_pad|><|vision_end|>),
the chat template renders the prompt, and each image's pad token is repeated once per merged patch of its grid, as
transformers' Qwen2.5-VL processor expands it; the image bytes and grids ride with the Sample to the engines and
the actor. A bad image is one line naming the row and the fix (rlmegatron.errors.UserError: exit 2).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlmegatron.errors import UserError

IMAGE_MARK = "<image>"  # verl's placeholder in the prompt text
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen2.5-VL's chat template's, per image
IMAGE_PAD = "<|image_pad|>"


class ImageError(UserError, ValueError):
    """A row's image cannot be used: missing, undecodable, too large, or not matched by an <image> mark."""


@dataclass(frozen=True)
class PromptImages:
    """A row's images as the engines and the actor take them: the encoded bytes (as read) and each image's
    (t, h, w) patch grid, which fixes how many placeholder tokens it has in the prompt."""

    data: tuple[bytes, ...]
    grids: tuple[tuple[int, int, int], ...]
    placeholder_id: int = -1
    """The image pad token, repeated once per merged patch of each image in the prompt's ids."""

    def collapsed(self, prompt_ids: Sequence[int]) -> list[int]:
        """`prompt_ids` with each image's run of placeholders as one: what SGLang takes with `image_data` (its
        processor expands each to the image's grid itself). Two images' runs never touch (vision_end, vision_start
        lie between them)."""
        return [token for i, token in enumerate(prompt_ids)
                if token != self.placeholder_id or i == 0 or prompt_ids[i - 1] != self.placeholder_id]


def read_image_bytes(entry: Any, base_dir: Path, location: str, number: int) -> bytes:
    """The encoded bytes of one `images` entry: bytes, a path (relative ones from the data file's directory), or
    a {"bytes", "path"} record."""
    if isinstance(entry, dict):
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, (bytes, bytearray)):
        return bytes(entry)
    if isinstance(entry, str) and entry:
        path = Path(entry) if Path(entry).is_absolute() else base_dir / entry
        try:
            return path.read_bytes()
        except OSError as err:
            raise ImageError(f"{location}: image {number} ({path}) cannot be read ({err.strerror}); fix the path "
                             "(a relative one is read from the data file's directory) or drop the row") from None
    raise ImageError(f"{location}: image {number} is {type(entry).__name__}, not bytes, a path or a "
                     "{bytes, path} record; write each image as one of those")


def decode_image(data: bytes, location: str, number: int, max_pixels: int):
    """The RGB PIL image of `data`; ImageError when it is not an image or has more than `max_pixels` pixels
    (checked from the header, before the pixels are decoded)."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"{location}: image {number} is {width}x{height} = {width * height} pixels, over "
                             f"data.max_image_pixels={max_pixels}; downscale it or raise data.max_image_pixels")
        return image.convert("RGB")
    except ImageError:
        raise
    except Exception as err:  # PIL raises what the codec raises: UnidentifiedImageError, OSError, SyntaxError, ...
        raise ImageError(f"{location}: image {number} cannot be decoded ({type(err).__name__}: "
                         f"{' '.join(str(err).split())}); replace it with a PNG or JPEG, or drop the row") from None


def pixel_values(image_processor, images: PromptImages, max_pixels: int):
    """(pixel_values, image_grid_thw) of `images` through `image_processor`: what the actor's batches and the local
    engine's prompts feed the vision tower."""
    decoded = [decode_image(d, "prompt", i, max_pixels) for i, d in enumerate(images.data)]
    out = image_processor(images=decoded, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"].long()


class ImagePrompts:
    """Puts a row's images into its prompt: the marks become the vision placeholder, the images' grids come from
    the model's image processor (preprocessor_config.json beside config.json)."""

    def __init__(self, processor_path: str, tokenizer: Any, image_key: str, max_pixels: int) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(processor_path)
        self.merge = self.image_processor.merge_size
        self.pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.image_key, self.max_pixels = image_key, max_pixels

    def mark_images(self, prompt, row: dict[str, Any], location: str):
        """(prompt with the marks replaced, number of images); ImageError when marks and images disagree."""
        images = row.get(self.image_key) or []
        texts = [m["content"] for m in prompt] if isinstance(prompt, list) else [prompt]
        marks = sum(str(text).count(IMAGE_MARK) for text in texts)
        if marks != len(images):
            raise ImageError(f"{location}: the prompt has {marks} {IMAGE_MARK} marks but '{self.image_key}' holds "
                             f"{len(images)} images; put one {IMAGE_MARK} where each image goes")
        if isinstance(prompt, list):
            return [{**m, "content": str(m["content"]).replace(IMAGE_MARK, VISION_PLACEHOLDER)} for m in prompt], marks
        return prompt.replace(IMAGE_MARK, VISION_PLACEHOLDER), marks

    def read(self, row: dict[str, Any], base_dir: Path, location: str) -> PromptImages:
        data = [read_image_bytes(entry, base_dir, location, i) for i, entry in enumerate(row.get(self.image_key) or [])]
        images = [decode_image(d, location, i, self.max_pixels) for i, d in enumerate(data)]
        grids = self.grids(images) if images else []
        return PromptImages(tuple(data), tuple(grids), self.pad_id)

    def grids(self, images: Sequence) -> list[tuple[int, int, int]]:
        out = self.image_processor(images=list(images), return_tensors="pt")
        return [tuple(int(x) for x in grid) for grid in out["image_grid_thw"]]

    def pixel_values(self, images: PromptImages):
        """(pixel_values, image_grid_thw) tensors of a prompt's images, as the vision tower takes them."""
        return pixel_values(self.image_processor, images, self.max_pixels)

    def expand(self, prompt_ids: list[int], images: PromptImages, location: str) -> list[int]:
        """`prompt_ids` with each image's single pad token repeated once per merged patch of its grid."""
        pads = [i for i, token in enumerate(prompt_ids) if token == self.pad_id]
        if len(pads) != len(images.grids):
            raise ImageError(f"{location}: the templated prompt holds {len(pads)} {IMAGE_PAD} tokens for "
                             f"{len(images.grids)} images; the chat template or the prompt drops an image placeholder")
        out, start = [], 0
        for position, (t, h, w) in zip(pads, images.grids):
            out += prompt_ids[start:position] + [self.pad_id] * (t * h * w // self.merge ** 2)
            start = position + 1
        return out + prompt_ids[start:]
