"""The draft model of MTP speculative decoding in the local engine: a checkpoint's first multi-token-prediction layer
(DeepSeek-V3's, GLM-4.5's), which transformers neither builds nor loads, computed as Megatron-Core trains it."""
from __future__ import annotations

import torch
from torch import nn


class MTPDraft(nn.Module):
    """The first MTP layer of `model` (a transformers DeepSeek-V3 or GLM-4.5 causal LM), named as the checkpoint and the
    weight sync name it: `model.layers.{num_hidden_layers}.` + enorm, hnorm, eh_proj, shared_head.norm and the
    decoder layer's own tensors. Its embedding and output head are the main model's, as in Megatron-Core, which
    trains MTP with the main embedding and output layer (the checkpoint's copies of them are loaded into those).

    One step, Megatron-Core's MultiTokenPredictionLayer: at position i, from the main model's final-normed hidden state
    h_i (or the previous draft step's output) and the embedding of token i+1,
    out_i = shared_head.norm(layer(eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]))) at position i's rotary angle;
    out_i feeds the next step and its logits (the main head) draft token i+2. The layer attends over its own KV cache.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        decoder = model.get_decoder()
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.prefix = f"model.layers.{layers}."
        norm = type(decoder.norm)
        self.enorm = norm(hidden, eps=config.rms_norm_eps)
        self.hnorm = norm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # The MTP layer is the decoder layer after the last (MoE where the family's layer of that index is); it attends
        # over a KV cache of its own, as cache layer 0.
        self.layer = type(decoder.layers[-1])(config, layer_idx=layers)
        self.layer.self_attn.layer_idx = 0
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(hidden, eps=config.rms_norm_eps)
        self.config = config
        # Not submodules: the main model's own, which its weights and the sync already hold.
        self._main = (decoder.embed_tokens, decoder.rotary_emb, model.get_output_embeddings())
        dtype, device = decoder.embed_tokens.weight.dtype, decoder.embed_tokens.weight.device
        self.to(dtype=dtype, device=device)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF checkpoint name -> tensor (sharing storage), the copies of the embedding and head included."""
        embed, _, head = self._main
        named = {self.prefix + name.removeprefix("layer."): tensor for name, tensor in self.state_dict().items()}
        named[self.prefix + "embed_tokens.weight"] = embed.weight
        named[self.prefix + "shared_head.head.weight"] = head.weight
        return named

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, m, H], logits [B, m, V]) for `m` new positions: `hidden` [B, m, H], `next_tokens` [B, m] (token i+1
        of each position i), `position_ids` [B, m]; `attention_mask` [B, cached + m] (0: a position no one attends
        to); `cache` the layer's DynamicCache, extended by the m positions."""
        from transformers.masking_utils import create_causal_mask

        embed, rotary, head = self._main
        x = self.eh_proj(torch.cat([self.enorm(embed(next_tokens)), self.hnorm(hidden)], dim=-1))
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        x = self.layer(x, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                       position_embeddings=rotary(x, position_ids))
        out = self.shared_head.norm(x)
        return out, head(out)
