"""The driver process (`rlm train`): the job that starts everything, the fit loop, its handles on the trainer ranks
(`trainer_client`) and the rollout engines (`engine_fleet`), the rollout data and the buffer that overlaps it with
training. It reaches the other processes only through `rlmegatron.transport`."""
