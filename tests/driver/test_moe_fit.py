"""`rlm train` on a tiny Qwen3-MoE at EP=2 and EP=2 x TP=2 for 20 steps (the fit loop used to hang at step 2: its
ranks ran different numbers of micro-batches, so their all-to-alls never paired up), multi-turn rollouts replaying their
model turns' routing, and a rank that stops answering stops the run within trainer.collective_timeout_s, naming the
step and the call."""
import json
import os
import shutil
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.driver.test_train import QUICKSTART, REPO_ROOT, RLM
from tests.helpers import warm_runs

STEPS = 20
# Validation before training and after the last step; no checkpoints: the subject is the loop.
RUN = [f"trainer.total_steps={STEPS}", f"trainer.test_freq={STEPS}", "trainer.val_before_train=true",
       "trainer.save_freq=-1", "tracking.backends=[console]"]


# The quickstart's task and tokenizer on a Qwen3-MoE: 3 layers of 8 experts, top-2 (random weights).
MOE_MODEL = REPO_ROOT / "configs" / "quickstart" / "moe_model"


def train(tmp: Path, name: str, *overrides: str, timeout_s: float = 240):
    return warm_runs.run([RLM, "train", QUICKSTART, f"model.path={MOE_MODEL}", f"trainer.run_dir={tmp / name}",
                           *overrides], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)


def validation_scores(stdout: str) -> list[float]:
    """The run summary's held-out score before and after training."""
    [line] = [line for line in stdout.splitlines() if line.startswith("validation: val/next_digit/score/mean")]
    return [float(score) for score in re.findall(r"(\d\.\d+) \(step", line)]


@pytest.mark.parametrize("layout", [
    # The repro: each prompt's 8 responses laid out once (shared-prompt micro-batches), whose units cut the
    # two ranks' shares into different numbers of micro-batches once a batch repeats a prompt. The actor replays the
    # rollout's routing (r3), and every step checks that the engine sampled what the actor scores (fp32).
    ["actor.megatron.expert_model_parallel_size=2", "actor.moe.routing_replay=r3", "trainer.on_policy_check=1e-5",
     "trainer.log_freq=1"],
    # 4 ranks: experts split over EP=2 and TP=2 (with sequence parallelism), micro-batches cut by a token budget.
    ["actor.megatron.expert_model_parallel_size=2", "actor.megatron.tensor_model_parallel_size=2",
     "actor.megatron.sequence_parallel=true", "placement.gpus_per_node=4", "actor.use_dynamic_bsz=true",
     "actor.ppo_max_token_len_per_gpu=48", "~actor.ppo_micro_batch_size_per_gpu"],
], ids=["ep2-shared-prompts-r3", "ep2xtp2-token-budget"])
def test_a_moe_policy_trains_twenty_steps_at_expert_parallelism_and_learns(tmp_path, layout):
    run = train(tmp_path, "run", *RUN, *layout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"trained steps 1-{STEPS} ({STEPS} steps)" in run.stdout
    before, after = validation_scores(run.stdout)
    assert before == 0.0 and after > 0.3, (before, after)  # the random model echoes the digit; it learns the next
    if "actor.moe.routing_replay=r3" in layout:
        agreement = [float(v) for v in re.findall(r"moe/routing_agreement +([\d.e-]+)", run.stdout)]
        assert len(agreement) == STEPS and min(agreement) == 1.0, agreement  # fp32: the engine routes as Megatron


@pytest.mark.parametrize("placement", [
    [],  # the engine in the trainer rank's process, turn by turn in batches
    # the engine's server in a process of its own, answering in SGLang's format (base64 routed_experts), every
    # trajectory in flight at once through the SGLang client
    ["placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1"],
], ids=["colocated", "disaggregated"])
def test_multi_turn_rollouts_replay_their_model_turns_routing_and_stay_on_policy_at_ep2(tmp_path, placement):
    """configs/tool_lookup_cpu.yaml (the model calls a tool, reads its answer, answers) on a Qwen3-MoE of its
    tokenizer, at EP=2 with r3: in fp32 every step's old log-probs must equal the engine's on every model token
    (trainer.on_policy_check), which holds only if each token after a tool answer replays the experts the engine gave
    it; the actor's router agrees with the rollout's on every replayed token."""
    model = tmp_path / "moe_tool_lookup"
    shutil.copytree(REPO_ROOT / "configs" / "tool_lookup" / "model", model)
    dense = json.loads((model / "config.json").read_text())
    moe = json.loads((MOE_MODEL / "config.json").read_text())
    experts = {key: moe[key] for key in ("architectures", "model_type", "num_experts", "num_experts_per_tok",
                                         "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                                         "norm_topk_prob", "output_router_logits", "router_aux_loss_coef")}
    (model / "config.json").write_text(json.dumps({**dense, **experts}))
    run = warm_runs.run([RLM, "train", "configs/tool_lookup_cpu.yaml", f"model.path={model}",
                          f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.save_freq=-1",
                          "trainer.test_freq=-1", "trainer.val_before_train=false", "data.val_files=[]",
                          "tracking.backends=[console]", "trainer.log_freq=1",
                          "actor.megatron.expert_model_parallel_size=2", "actor.moe.routing_replay=r3",
                          "trainer.on_policy_check=1e-5", *placement],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    turns = [float(v) for v in re.findall(r"agent/turns/mean +([\d.e-]+)", run.stdout)]
    assert len(turns) == 3 and max(turns) > 1, turns  # some trajectories called the tool and went on
    agreement = [float(v) for v in re.findall(r"moe/routing_agreement +([\d.e-]+)", run.stdout)]
    assert agreement == [1.0] * 3, agreement


def test_a_rank_that_stops_answering_stops_the_run_within_the_collective_timeout_naming_step_and_call(tmp_path):
    """Rank 1 sleeps 120 s in its first loss of step 2 (once step 1's checkpoint is written); rank 0 waits in an
    all-to-all of the update. With trainer.collective_timeout_s=3 the run stops long before rank 1 wakes, with one
    line and exit 3, the step-1 checkpoint kept."""
    env = {**os.environ, "RLM_SLOW_RANK_S": "120",
           "RLM_SLOW_ONCE_EXISTS": str(tmp_path / "run" / "checkpoints" / "step_1")}
    command = [RLM, "train", QUICKSTART, f"model.path={MOE_MODEL}", f"trainer.run_dir={tmp_path / 'run'}",
               "trainer.total_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.val_files=[]",
               "trainer.save_freq=1", "trainer.collective_timeout_s=3", "actor.megatron.expert_model_parallel_size=2",
               "tracking.backends=[console]", "trainer.log_freq=1",
               "actor.policy_loss.loss_mode=tests/driver/slow_rank_loss.py:compute_policy_loss"]
    with warm_runs.popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as run:
        step_one = None
        for line in run.stdout:  # the metric table of step 1 is printed once step 1 is done
            if line.startswith("── step 1 "):
                step_one = time.monotonic()
        stderr = run.stderr.read()
        run.wait(timeout=150)
    assert step_one is not None, stderr[-4000:]
    # From step 1's end: its checkpoint, step 2's rollout, 3 s of waiting and 5 s for the peer to report; far less
    # than rank 1's sleep, however loaded the machine.
    assert time.monotonic() - step_one < 60
    assert run.returncode == 3, stderr[-4000:]
    last = stderr.strip().splitlines()[-1]
    assert last == (f"training stopped: step 2: update_actor: trainer rank 0 waited 3 s in a collective that other "
                    f"ranks of its group did not join (trainer.collective_timeout_s): one of them is stuck or slower "
                    f"than that, or they ran different collectives. No checkpoint is written for this step; the last "
                    f"complete one is {tmp_path / 'run' / 'checkpoints' / 'step_1'}"), last
    assert "Traceback" not in stderr
