"""A vision-language actor: Megatron-Core's GPTModel with its family's image encoder on the first pipeline stage,
whose merged patch embeddings replace the image placeholder tokens of the decoder input.

Megatron-Bridge and verl keep the tower beside the language model in the same way: the language model is
parallel as any GPTModel is (TP, PP, CP, DP); the tower, small beside it (Qwen2.5-VL-7B: 0.67B of 8.3B), runs
whole on every rank of the first stage. It is transformers' own module, so its output is transformers' to the
bit; every TP rank computes the same embeddings from the same weights and gets the same gradient back (the first
layer's column-parallel linears all-reduce their input gradient), so a trained tower stays identical across TP.
A frozen tower (models.vision.freeze_vision_tower, `actor.vision.freeze`) runs without autograd.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.models.gpt import GPTModel


class VisionLanguageModel(GPTModel):
    """GPTModel whose forward also takes the micro-batch's images: `pixel_values` (the processor's flattened
    patches, every image of the micro-batch in row order), `image_grid_thw` [images, 3] and optionally
    `prompt_mask` [batch, seq], the positions whose placeholder tokens are images (default: all; a response's
    placeholder token, sampled by the policy, is text). Position ids are [3, batch, seq] M-RoPE positions
    (models.mrope)."""

    def __init__(self, *args, vision_tower: Callable[[], torch.nn.Module], image_token_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_token_id = image_token_id
        if self.config.sequence_parallel:
            # The image rows are replaced in the full sequence; with sequence parallelism each rank holds a slice.
            raise ValueError("a vision-language model runs without sequence_parallel (its dense language model "
                             "needs none at TP>1)")
        self.vision = vision_tower() if self.pre_process else None

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *args,
                pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                prompt_mask: Optional[torch.Tensor] = None, **kwargs):
        if self.pre_process and decoder_input is None and pixel_values is not None:
            decoder_input = self.embed_with_images(input_ids, pixel_values, image_grid_thw, prompt_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)

    def image_embeddings(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """[image tokens, hidden] of every image, in order."""
        trained = any(p.requires_grad for p in self.vision.parameters())
        with torch.set_grad_enabled(trained and torch.is_grad_enabled()):
            dtype = next(self.vision.parameters()).dtype
            return self.vision(pixel_values.to(dtype), grid_thw=image_grid_thw).pooler_output

    def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                          prompt_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder input [seq, batch, hidden]: token embeddings, the image placeholders' (within `prompt_mask`)
        replaced by the images' embeddings in batch-major order (the order the prompts hold their images in)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        images = self.image_embeddings(pixel_values, image_grid_thw)
        placeholders = input_ids == self.image_token_id
        if prompt_mask is not None:
            placeholders = placeholders & prompt_mask.to(placeholders.device)
        if int(placeholders.sum()) != images.shape[0]:
            raise ValueError(f"the micro-batch has {int(placeholders.sum())} image placeholder tokens but its "
                             f"images make {images.shape[0]} embeddings")
        by_row = embeddings.transpose(0, 1).masked_scatter(placeholders[..., None], images.to(embeddings.dtype))
        return by_row.transpose(0, 1).contiguous()


def freeze_vision_tower(chunks, freeze: bool) -> int:
    """Freeze (or unfreeze) the image encoder of every chunk that holds one; the number of tower weights it set."""
    count = 0
    for chunk in chunks:
        model = chunk
        while hasattr(model, "module"):
            model = model.module
        if getattr(model, "vision", None) is not None:
            for param in model.vision.parameters():
                param.requires_grad_(not freeze)
                count += 1
    return count
