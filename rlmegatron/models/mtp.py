"""The GPTModel of checkpoints with multi-token-prediction layers: MTP weights are held, logits come from the main head."""
from __future__ import annotations

import copy

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group


class GPTModelWithMTP(GPTModel):
    """GPTModel with MTP layers, closing two gaps of Megatron-Core 0.16's MTP support.

    Forward without labels returns the main head's logits, as HF transformers' does: Megatron runs
    MTP layers only to add their loss to the main one, and reads the labels to do so even when none
    are given. The MTP weights stay in the model for checkpoints and weight sync.
    """

    def _postprocess(self, *, labels=None, mtp_in_postprocess=None, **kwargs):
        if labels is not None:
            return super()._postprocess(labels=labels, mtp_in_postprocess=mtp_in_postprocess, **kwargs)
        config = self.config
        # Only this module's view loses its MTP layers: the MTP block and the decoder keep the shared config.
        self.config = copy.copy(config)
        self.config.mtp_num_layers = None
        try:
            return super()._postprocess(labels=None, mtp_in_postprocess=False, **kwargs)
        finally:
            self.config = config

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # The last stage's copy of the embedding (MTP needs it) is tied by the data-parallel group
        # in `metadata`, which GPTModel, unlike its modules, does not default when absent.
        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))
