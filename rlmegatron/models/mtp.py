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

    def _postprocess(self, *, hidden_states, labels=None, mtp_in_postprocess=None, **kwargs):
        if labels is not None:
            return super()._postprocess(hidden_states=hidden_states, labels=labels,
                                        mtp_in_postprocess=mtp_in_postprocess, **kwargs)
        if mtp_in_postprocess and self.ahead_logits is not None:
            hidden_states = self._run_mtp_layers(hidden_states, kwargs)
        config = self.config
        # Only this module's view loses its MTP layers: the MTP block and the decoder keep the shared config.
        self.config = copy.copy(config)
        self.config.mtp_num_layers = None
        try:
            return super()._postprocess(hidden_states=hidden_states, labels=None, mtp_in_postprocess=False, **kwargs)
        finally:
            self.config = config

    def _run_mtp_layers(self, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Megatron's MTP block over the main model's hidden states; each MTP layer's logits [b, s, V/TP] go into
        `ahead_logits`, and the main model's hidden states come back for its own head."""
        # Without post_process, GPTModel's _postprocess runs the MTP block (with the arguments Megatron gives it) and
        # returns the main hidden states followed by each MTP layer's, along the sequence.
        self.post_process = False
        try:
            stacked = super()._postprocess(hidden_states=hidden_states, labels=None, mtp_in_postprocess=True,
                                           **kwargs)
        finally:
            self.post_process = True
        main, *layers = torch.chunk(stacked, 1 + self.config.mtp_num_layers, dim=0)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        for layer_hidden in layers:
            # One head call per layer, as Megatron's loss does: with sequence parallelism the head gathers each
            # chunk's sequence shards, which a single call over the stacked chunks would interleave.
            logits, _ = self.output_layer(layer_hidden, weight=weight,
                                          runtime_gather_output=kwargs.get("runtime_gather_output"))
            self.ahead_logits.append(logits.transpose(0, 1))
        return main

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # The last stage's copy of the embedding (MTP needs it) is tied by the data-parallel group
        # in `metadata`, which GPTModel, unlike its modules, does not default when absent.
        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))


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
