"""Multimodal rotary positions (M-RoPE) of Qwen2.5-VL's and Qwen3-VL's decoder input: a (temporal, height, width)
position per token, the same three for text, a grid for each image's merged patches; and which of the three each
rotary frequency takes in Qwen3-VL's interleaved layout.

Pure tensor code, computed wherever token ids meet image grids (the actor's batches, the local engine's prompts)
and checked against transformers' get_rope_index in tests/models/test_qwen2_5_vl.py.
"""
from __future__ import annotations

from typing import Optional

import torch


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], image_token_id: int,
                       spatial_merge_size: int, attention_mask: Optional[torch.Tensor] = None,
                       prompt_columns: Optional[int] = None) -> torch.Tensor:
    """[3, batch, seq] positions of `input_ids` [batch, seq], whose image placeholder runs take the grids of
    `image_grid_thw` [images, 3] (in patches) in order, row by row. Text continues one past the largest position so
    far; an image's tokens are its merged grid offset by where it starts, and the text after it continues from the
    start plus the grid's larger side. Padding (attention_mask 0) gets position 0 and is skipped.

    `prompt_columns`: only the first columns hold prompts (RolloutBatch's layout: the responses after them). A policy
    can sample the image placeholder token itself (a random one does, one token in the vocabulary's size); in a
    response it is text, as the engine that sampled it embedded it, never an image."""
    batch, seq = input_ids.shape
    positions = torch.zeros(3, batch, seq, dtype=torch.long, device=input_ids.device)
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    for row in range(batch):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(seq, dtype=torch.bool)
        placeholder = input_ids[row] == image_token_id
        if prompt_columns is not None:
            placeholder[prompt_columns:] = False
        tokens = placeholder[keep].tolist()
        pieces, start, i = [], 0, 0
        while i < len(tokens):
            if not tokens[i]:
                j = i
                while j < len(tokens) and not tokens[j]:
                    j += 1
                pieces.append(torch.arange(start, start + j - i).expand(3, -1))
                start, i = start + j - i, j
                continue
            try:
                t, h, w = next(grids)
            except StopIteration:
                raise ValueError(f"row {row} has more image placeholder runs than image_grid_thw has images") from None
            h, w = h // spatial_merge_size, w // spatial_merge_size
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            pieces.append(grid.reshape(3, -1) + start)
            start, i = start + max(h, w), i + t * h * w
        if pieces:
            positions[:, row, keep.to(positions.device)] = torch.cat(pieces, dim=1).to(positions.device)
    return positions


def interleaved_mrope_axes(mrope_section, frequencies: int) -> torch.Tensor:
    """[frequencies] axis (0 time, 1 height, 2 width) of each rotary frequency in Qwen3-VL's interleaved M-RoPE
    (transformers' Qwen3VLTextRotaryEmbedding): frequency j is height's when j % 3 == 1 and j < 3 * section[1],
    width's when j % 3 == 2 and j < 3 * section[2], else time's."""
    axes = torch.zeros(frequencies, dtype=torch.long)
    for axis in (1, 2):
        axes[axis:3 * mrope_section[axis]:3] = axis
    return axes
