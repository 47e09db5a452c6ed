"""HF config -> Megatron TransformerConfig and layer spec; one declarative weight map per model family."""
