"""What runs on the rollout pool (disaggregated placement): one engine host per GPU, each supervising its share of an
SGLang server (or a local-engine server)."""
