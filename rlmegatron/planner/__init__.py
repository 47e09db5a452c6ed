"""rlm plan: parameter counts, per-GPU memory, weight-sync cost and layout rejections, estimated from the spec."""
