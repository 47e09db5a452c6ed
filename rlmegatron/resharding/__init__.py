"""Streaming export of HF-named full tensors from any Megatron layout (the weight-sync source), and HF checkpoints."""
from rlmegatron.resharding.export import HFWeightExporter, export_hf, export_hf_weights, export_peft_adapter

__all__ = ["HFWeightExporter", "export_hf", "export_hf_weights", "export_peft_adapter"]
