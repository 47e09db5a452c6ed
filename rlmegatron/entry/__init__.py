"""The commands: `rlm` (train, validate, plan, prepare, ...) and `rlm convert`, each the top of its process."""
