"""The GPTModel of checkpoints with multi-token-prediction layers: logits come from the main head, and the MTP layers
run only where a forward asks for their logits (`predicting_ahead`), as the actor's update does to train them."""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group


class GPTModelWithMTP(GPTModel):
    """GPTModel with MTP layers, closing two gaps of Megatron-Core 0.16's MTP support.

    Forward without labels returns the main head's logits, as HF transformers' does: Megatron runs
    MTP layers only to add their loss to the main one, and reads the labels to do so even when none
    are given. The MTP weights stay in the model for checkpoints and weight sync. Inside `predicting_ahead` the forward
    also runs Megatron's MTP block and leaves each MTP layer's logits in the list it yields: the RL loss, not
    Megatron's pretraining loss, decides what they are trained towards.
    """

    # The list a forward inside predicting_ahead fills with each MTP layer's logits; None: the MTP layers do not run.
    ahead_logits: Optional[list] = None
    # Whether the MTP layers take the main model's hidden states, embeddings and head detached (detach_mtp_inputs).
    mtp_inputs_detached: bool = False

    def _postprocess(self, *, hidden_states, labels=None, mtp_in_postprocess=None, **kwargs):
        if labels is not None:
            return super()._postprocess(hidden_states=hidden_states, labels=labels,
                                        mtp_in_postprocess=mtp_in_postprocess, **kwargs)
        if mtp_in_postprocess and self.ahead_logits is not None:
            self._run_mtp_layers(hidden_states, kwargs)
        config = self.config
        # Only this module's view loses its MTP layers: the MTP block and the decoder keep the shared config.
        self.config = copy.copy(config)
        self.config.mtp_num_layers = None
        try:
            return super()._postprocess(hidden_states=hidden_states, labels=None, mtp_in_postprocess=False, **kwargs)
        finally:
            self.config = config

    def _run_mtp_layers(self, hidden_states: torch.Tensor, kwargs: dict) -> None:
        """Megatron's MTP block over the main model's hidden states; each MTP layer's logits [b, s, V/TP] go into
        `ahead_logits`. With `mtp_inputs_detached` no gradient of theirs reaches the main model: the hidden states,
        the next tokens' embeddings and the output head's weight reach them detached."""
        detached = self.mtp_inputs_detached
        embedding = self.embedding
        if detached:
            def embedding(input_ids, position_ids):  # what an MTP layer calls for the next tokens' embeddings
                return self.embedding(input_ids=input_ids, position_ids=position_ids).detach()

        stacked = self.mtp(
            input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"],
            hidden_states=hidden_states.detach() if detached else hidden_states,
            attention_mask=kwargs["attention_mask"], inference_params=kwargs.get("inference_params"),
            rotary_pos_emb=kwargs["rotary_pos_emb"], rotary_pos_cos=kwargs["rotary_pos_cos"],
            rotary_pos_sin=kwargs["rotary_pos_sin"], packed_seq_params=kwargs.get("packed_seq_params"),
            sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=embedding,
            **(kwargs.get("extra_block_kwargs") or {}),
        )
        # The block returns its input hidden states followed by each MTP layer's, along the sequence.
        layers = torch.chunk(stacked, 1 + self.config.mtp_num_layers, dim=0)[1:]
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight
        for layer_hidden in layers:
            # One head call per layer, as Megatron's loss does: with sequence parallelism the head gathers each
            # chunk's sequence shards, which a single call over the stacked chunks would interleave.
            logits, _ = self.output_layer(layer_hidden, weight=weight.detach() if detached else weight,
                                          runtime_gather_output=kwargs.get("runtime_gather_output"))
            self.ahead_logits.append(logits.transpose(0, 1))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # The last stage's copy of the embedding (MTP needs it) is tied by the data-parallel group
        # in `metadata`, which GPTModel, unlike its modules, does not default when absent.
        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))


def detach_mtp_inputs(chunks, detached: bool) -> None:
    """Have the MTP layers of `chunks` (model chunks, in their wrappers) take what they read from the main model
    detached (actor.mtp.detach), or not."""
    for chunk in chunks:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        if getattr(chunk, "mtp_process", False):
            chunk.mtp_inputs_detached = detached


def freeze_mtp_layers(model, freeze: bool) -> None:
    """Freeze (or unfreeze) the MTP layers' own weights (not the embedding and head they share). Layers no loss trains
    are frozen: no gradient buffer or Adam state for them, and no weight decay moving them between syncs."""
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        for param in mtp.parameters():
            param.requires_grad_(not freeze)


@contextlib.contextmanager
def predicting_ahead(model) -> Iterator[Optional[list]]:
    """Within it, a forward of `model` (the GPTModel inside its wrappers) also runs its MTP layers: yields the list
    that then holds MTP layer k's logits [b, s, V/TP] (position i predicting the token k + 2 places on), or None where
    this chunk holds no MTP layers (not the last pipeline stage, or a model without them)."""
    if not getattr(model, "mtp_process", False):
        yield None
        return
    model.ahead_logits = []
    try:
        yield model.ahead_logits
    finally:
        model.ahead_logits = None
