"""Entry point the verl-command test runs in a fresh process: the quickstart with verl's keys translated on top
(as `rlm train --verl` does), trained in-process; writes the metric history, the notes, and every cut of a batch
into micro-batches (sequences, micro-batch size) in the order the workers made them."""
import json
import sys

from rlmegatron.driver.job import check_training, run_training
from rlmegatron.prelaunch.spec_pipeline import SpecSource
from rlmegatron.rank.roles import megatron_step

# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    out, *verl_args = sys.argv[1:]
    job = check_training(SpecSource("configs/quickstart.yaml", verl_args, verl=True), in_process=True)
    cuts = []
    shard = megatron_step.shard_micro_batches

    def recording_shard(batch, pack, micro_batch_size, max_token_len, share_prompts=False):
        cuts.append([len(batch), micro_batch_size])
        return shard(batch, pack, micro_batch_size, max_token_len, share_prompts)

    megatron_step.shard_micro_batches = recording_shard
    report = run_training(job)
    with open(out, "w") as handle:
        json.dump({"history": report.history, "notes": job.notes, "cuts": cuts, "run_dir": job.spec.trainer.run_dir},
                  handle)
