"""What a rank's colocated engine holds against its actor, with rollout.quantization fp8."""
from __future__ import annotations

import torch


def engine_vs_fp8_actor(rank) -> dict:
    """The engine's weights against the actor's HF-named weights (merged, with LoRA) quantised block-wise then
    dequantised (the projections) or as they are (the rest): how many are quantised, which differ, and which
    projections the engine holds unquantised."""
    from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT
    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.rollout.local import checkpoint_named_weights

    served = checkpoint_named_weights(rank.engine.leader.model)
    with rank.models.phase("actor"):
        actor = {name: tensor.clone() for name, tensor in
                 HFWeightExporter(rank.models.actor.chunks, rank.models.weight_map).stream()}
    quantised = [name for name in actor if FP8_ROLLOUT.quantises(name)]
    expected = {name: FP8_ROLLOUT.dequantise(*FP8_ROLLOUT.quantise(tensor)).to(tensor.dtype) if name in quantised
                else tensor for name, tensor in actor.items()}
    return {"quantised": len(quantised), "differ": sorted(n for n in actor if not torch.equal(served[n], expected[n])),
            "unchanged_by_fp8": sorted(n for n in quantised if torch.equal(served[n], actor[n]))}
