"""A vision-language actor: Megatron-Core's GPTModel with its family's image encoder on the first pipeline stage,
whose merged patch embeddings replace the image placeholder tokens of the decoder input.

Megatron-Bridge and verl keep the tower beside the language model in the same way: the language model is
parallel as any GPTModel is (TP, PP, CP, DP); the tower, small beside it (Qwen2.5-VL-7B: 0.67B of 8.3B), runs
whole on every rank of the first stage. It is transformers' own module, so its output is transformers' to the
bit; every TP rank computes the same embeddings from the same weights and gets the same gradient back (the first
layer's column-parallel linears all-reduce their input gradient), so a trained tower stays identical across TP.
A frozen tower (models.vision.freeze_vision_tower, `actor.vision.freeze`) runs without autograd.

DeepStack (Qwen3-VL): the tower also returns one feature per image token for each of the first decoder layers,
added to the image tokens' hidden states after that layer (transformers' Qwen3VLTextModel). Here a forward hook on
each such layer adds them; the features exist only where the tower runs, so those layers must be on the first
pipeline stage (and its first virtual stage) too: the model refuses another split, and the spec checks say so first.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel

from rlmegatron.models.mrope import interleaved_mrope_axes


class VisionLanguageModel(GPTModel):
    """GPTModel whose forward also takes the micro-batch's images: `pixel_values` (the processor's flattened
    patches, every image of the micro-batch in row order), `image_grid_thw` [images, 3] and optionally
    `prompt_mask` [batch, seq], the positions whose placeholder tokens are images (default: all; a response's
    placeholder token, sampled by the policy, is text). Position ids are [3, batch, seq] M-RoPE positions
    (models.mrope)."""

    def __init__(self, *args, vision_tower: Callable[[], torch.nn.Module], image_token_id: int,
                 deepstack_layers: int = 0, mrope_interleaved: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_token_id = image_token_id
        if self.config.sequence_parallel:
            # The image rows are replaced in the full sequence; with sequence parallelism each rank holds a slice.
            raise ValueError("a vision-language model runs without sequence_parallel (its dense language model "
                             "needs none at TP>1)")
        if mrope_interleaved:
            self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(self.rotary_pos_emb)
        self.vision = vision_tower() if self.pre_process else None
        # (image placeholder mask [batch, seq], DeepStack features per layer) while a forward with images runs.
        self._deepstack: Optional[tuple[torch.Tensor, List[torch.Tensor]]] = None
        if self.pre_process and deepstack_layers:
            held = [layer.layer_number - 1 for layer in self.decoder.layers]
            if held[:deepstack_layers] != list(range(deepstack_layers)):
                raise ValueError(
                    f"DeepStack adds image features after decoder layers 0..{deepstack_layers - 1}, which must be on "
                    f"the first pipeline stage with the vision tower, but that stage holds {len(held)}; set "
                    f"megatron.extra.num_layers_in_first_pipeline_stage >= {deepstack_layers} or lower the "
                    "(virtual) pipeline size")
            if self.config.recompute_granularity == "full":
                # The hooks read the features of the forward that runs; a full recompute reruns the layers in the
                # backward, when they are gone, and would differ from the forward it stands for.
                raise ValueError("DeepStack's features are added by hooks a full activation recompute would rerun "
                                 "without them; use recompute_granularity selective or none")
            for index in range(deepstack_layers):
                self.decoder.layers[index].register_forward_hook(self._deepstack_hook(index))

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *args,
                pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                prompt_mask: Optional[torch.Tensor] = None, **kwargs):
        if not (self.pre_process and decoder_input is None and pixel_values is not None):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)
        decoder_input, placeholders, deepstack = self.embed_with_images(input_ids, pixel_values, image_grid_thw,
                                                                        prompt_mask)
        self._deepstack = (placeholders, deepstack) if deepstack else None
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)
        finally:
            self._deepstack = None

    def image_embeddings(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
                         ) -> tuple[torch.Tensor, List[torch.Tensor]]:
        """[image tokens, hidden] of every image, in order, and the DeepStack features of the same tokens per
        decoder layer they are added after ([] for a tower without DeepStack)."""
        trained = any(p.requires_grad for p in self.vision.parameters())
        with torch.set_grad_enabled(trained and torch.is_grad_enabled()):
            dtype = next(self.vision.parameters()).dtype
            output = self.vision(pixel_values.to(dtype), grid_thw=image_grid_thw)
            return output.pooler_output, list(getattr(output, "deepstack_features", None) or [])

    def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                          prompt_mask: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
        """The decoder input [seq, batch, hidden]: token embeddings, the image placeholders' (within `prompt_mask`)
        replaced by the images' embeddings in batch-major order (the order the prompts hold their images in); those
        placeholders [batch, seq] and the images' DeepStack features."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        images, deepstack = self.image_embeddings(pixel_values, image_grid_thw)
        placeholders = input_ids == self.image_token_id
        if prompt_mask is not None:
            placeholders = placeholders & prompt_mask.to(placeholders.device)
        if int(placeholders.sum()) != images.shape[0]:
            raise ValueError(f"the micro-batch has {int(placeholders.sum())} image placeholder tokens but its "
                             f"images make {images.shape[0]} embeddings")
        by_row = embeddings.transpose(0, 1).masked_scatter(placeholders[..., None], images.to(embeddings.dtype))
        return by_row.transpose(0, 1).contiguous(), placeholders, deepstack

    def _deepstack_hook(self, index: int):
        """A forward hook for decoder layer `index`: its output hidden states [seq, batch, hidden] with the image
        tokens' DeepStack features of that layer added (out of place, so autograd sees the sum)."""

        def add_features(module, args, output):
            if self._deepstack is None:
                return None
            hidden, context = output
            placeholders, features = self._deepstack
            by_row = hidden.transpose(0, 1)
            summed = by_row[placeholders] + features[index].to(hidden.dtype)
            return by_row.index_put((placeholders,), summed).transpose(0, 1).contiguous(), context

        return add_features


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Qwen3-VL's M-RoPE: each rotary frequency takes its position from time, height or width by
    models.mrope.interleaved_mrope_axes (t h w t h w ...), where Megatron-Core's MultimodalRotaryEmbedding gives
    each axis a contiguous section. Made from the model's own embedding, keeping its frequencies."""

    def __init__(self, contiguous: MultimodalRotaryEmbedding):
        torch.nn.Module.__init__(self)
        self.inv_freq, self.cp_group = contiguous.inv_freq, contiguous.cp_group
        self.rotary_interleaved = contiguous.rotary_interleaved
        self.seq_len_interpolation_factor = contiguous.seq_len_interpolation_factor
        if self.rotary_interleaved or self.seq_len_interpolation_factor is not None:
            raise ValueError("interleaved M-RoPE is built for Qwen3-VL's plain rotary embedding: no "
                             "rotary_interleaved, no seq_len_interpolation_factor")

    def forward(self, position_ids: torch.Tensor, mrope_section: List[int], cp_group=None) -> torch.Tensor:
        """[seq, batch, 1, head dim] rotary angles of `position_ids` [3, batch, seq] (a vision-language model runs
        at CP=1: config.checks)."""
        freqs = position_ids.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq  # [3, b, s, dim/2]
        axes = interleaved_mrope_axes(mrope_section, freqs.shape[-1]).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]
        return torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()


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
