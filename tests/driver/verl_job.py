"""Entry point the verl-command test runs in a fresh process: the quickstart with verl's keys translated on top
(as `rlm train --verl` does), trained in-process; writes the metric history, the notes, and every cut of a batch
into micro-batches (sequences, micro-batch size) in the order the workers made them."""
import json
import sys

from rlmegatron.config.verl_keys import load_verl_spec
from rlmegatron.driver.job import run_training
from rlmegatron.rank.roles import megatron_step

# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    out, *verl_args = sys.argv[1:]
    spec, notes = load_verl_spec("configs/quickstart.yaml", verl_args)
    cuts = []
    shard = megatron_step.shard_micro_batches

    def recording_shard(batch, pack, micro_batch_size, max_token_len, share_prompts=False):
        cuts.append([len(batch), micro_batch_size])
        return shard(batch, pack, micro_batch_size, max_token_len, share_prompts)

    megatron_step.shard_micro_batches = recording_shard
    report = run_training(spec, in_process=True)
    with open(out, "w") as handle:
        json.dump({"history": report.history, "notes": notes, "cuts": cuts, "run_dir": spec.trainer.run_dir}, handle)
