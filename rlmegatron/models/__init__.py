"""HF config -> Megatron TransformerConfig, layer spec and GPTModel; one module per model family (families/) over
the shared engine (hf_config, weight_map, convert). Importing the package imports nothing heavy."""
