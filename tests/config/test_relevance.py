"""Settings the rest of the spec makes meaningless are rejected when the user sets them, never when defaulted."""
import pytest

from rlmegatron.config import dump_spec
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
from rlmegatron.config.yamlio import parse_yaml
from tests.config.specs import REPO_ROOT, minimal_spec, problems_with

ASYNC_REWARD = f"{REPO_ROOT / 'tests' / 'config' / 'async_reward.py'}:compute_score"
SGLANG_ONLY = "only SGLang servers use it, and rollout.engine=local generates in every trainer rank; remove it"


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"actor.kl_loss_coef": 0.1}, "actor.kl_loss_coef=0.1: only applies with actor.use_kl_loss=true"),
        ({"algorithm.kl_ctrl.kl_coef": 0.1}, "algorithm.kl_ctrl.kl_coef=0.1: only applies with "
                                             "algorithm.use_kl_in_reward=true"),
        ({"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.horizon": 5},
         "algorithm.kl_ctrl.horizon=5: only the adaptive KL controller reads it"),
        ({"algorithm.gamma": 0.9}, "algorithm.gamma=0.9: algorithm.adv_estimator=grpo does not discount rewards"),
        ({"algorithm.lam": 0.9}, "algorithm.lam=0.9: algorithm.adv_estimator=grpo has no GAE lambda"),
        ({"algorithm.adv_estimator": "rloo", "algorithm.norm_adv_by_std_in_grpo": False},
         "algorithm.norm_adv_by_std_in_grpo=false: algorithm.adv_estimator=rloo does not divide by a group std"),
        ({"critic.optim.lr": 0.1}, "critic.optim.lr=0.1: there is no critic"),
        ({"ref.offload.params": True}, "ref.offload.params=true: the reference model is only built for a KL term"),
        ({"actor.use_kl_loss": True, "ref.megatron.recompute_granularity": "full"},
         "ref.megatron.recompute_granularity=full: the reference model never trains"),
        ({"actor.mtp.detach": True}, "actor.mtp.detach=true: only applies while the MTP layers train "
                                     "(actor.mtp.loss_weight > 0)"),
        ({"actor.lora.alpha": 32}, "actor.lora.alpha=32.0: only applies with LoRA (actor.lora.rank > 0)"),
        ({"actor.lora.target_modules": ["linear_qkv"]},
         "actor.lora.target_modules=[linear_qkv]: only applies with LoRA (actor.lora.rank > 0)"),
        ({"actor.lora.rank": 8, "actor.use_kl_loss": True, "ref.offload.params": True},
         "ref.offload.params=true: with LoRA (actor.lora.rank > 0) the reference is the actor with its adapters off"),
        ({"actor.lora.rank": 8, "actor.use_kl_loss": True, "ref.megatron": {"tensor_model_parallel_size": 2}},
         "ref.megatron.tensor_model_parallel_size=2: with LoRA (actor.lora.rank > 0) the reference is the actor"),
        ({"reward.model.weight": 2.0}, "reward.model.weight=2.0: only applies with a reward model"),
        ({"reward.overlong_buffer.length": 8}, "reward.overlong_buffer.length=8: only applies with "
                                               "reward.overlong_buffer.enable=true"),
        ({"reward.async_concurrency": 8}, "reward.async_concurrency=8: only bounds an `async def` reward function "
                                          "scored on one event loop (reward.num_workers=0), and reward.function=null "
                                          "(the built-in rules) is not async; remove it"),
        ({"reward.function": ASYNC_REWARD, "reward.num_workers": 2,
          "reward.async_concurrency": 8},
         "reward.async_concurrency=8: only bounds an `async def` reward function scored on one event loop "
         "(reward.num_workers=0), and reward.num_workers>0 scores one sample at a time in each worker; remove it"),
        ({"algorithm.dynamic_sampling.max_num_gen_batches": 3},
         "algorithm.dynamic_sampling.max_num_gen_batches=3: only applies with algorithm.dynamic_sampling.enable"),
        ({"trainer.total_steps": 5, "trainer.total_epochs": 2},
         "trainer.total_epochs=2: trainer.total_steps=5 is set and ends the run instead; remove it "
         "(~trainer.total_epochs on the command line), or remove trainer.total_steps (~trainer.total_steps on the "
         "command line) to train by epochs"),
        ({"trainer.val_before_train": False}, "data.val_files=[val.parquet]: validation never runs"),
        ({"tracking.project_name": "p"}, "tracking.project_name=p: only the mlflow and wandb backends use it"),
        ({"tracking.backends": ["wandb"], "tracking.tracking_uri": "sqlite:///x.db"},
         "tracking.tracking_uri=sqlite:///x.db: only the mlflow backend uses it"),
        ({"model.hf_config": "x/config.json"}, "model.hf_config=x/config.json: model.path is a local directory"),
        ({"actor.ppo_max_token_len_per_gpu": 512}, "actor.ppo_max_token_len_per_gpu=512: only applies with "
                                                   "actor.use_dynamic_bsz=true"),
        ({"actor.use_dynamic_bsz": True, "actor.ppo_micro_batch_size_per_gpu": 2},
         "actor.ppo_micro_batch_size_per_gpu=2: actor.use_dynamic_bsz=true packs micro-batches by "
         "actor.ppo_max_token_len_per_gpu instead"),
        ({"actor.use_dynamic_bsz": True, "rollout.log_prob_micro_batch_size_per_gpu": 2},
         "rollout.log_prob_micro_batch_size_per_gpu=2: actor.use_dynamic_bsz=true packs the old-log-prob pass"),
        ({"tracking.rollout_trace.prompts_per_step": 4},
         "tracking.rollout_trace.prompts_per_step=4: no samples are traced"),
        ({"algorithm.rollout_correction.rollout_is_threshold": 3.0},
         "algorithm.rollout_correction.rollout_is_threshold=3.0: only applies with importance weights"),
        ({"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_rs_threshold": 3.0},
         "algorithm.rollout_correction.rollout_rs_threshold=3.0: only applies with rejection"),
        ({"rollout.mem_fraction_static": 0.5}, f"rollout.mem_fraction_static=0.5: {SGLANG_ONLY}"),
        ({"rollout.sglang.extra_args": {"foo": 1}}, f"rollout.sglang.extra_args.foo=1: {SGLANG_ONLY}"),
        ({"rollout.engine": "sglang", "rollout.sglang.router_args": {"policy": "round_robin"}},
         "rollout.sglang.router_args.policy=round_robin: only applies to a router rlm train starts"),
        ({"rollout.engine": "sglang", "rollout.seed": 3},
         "rollout.seed=3: SGLang samples by a request's seed only in deterministic-inference mode"),
        ({"trainer.mode": "async", "placement.mode": "disaggregate", "placement.rollout_nnodes": 1,
          "placement.rollout_gpus_per_node": 4, "trainer.on_policy_check": 1e-5},
         "trainer.on_policy_check=1.0e-05: trainer.mode=async samples with weights up to 2 versions old by design"),
    ],
    ids=lambda value: None if isinstance(value, dict) else value.split("=")[0],
)
def test_a_setting_that_would_change_nothing_is_rejected(settings, expected):
    problems = problems_with(settings)
    assert len(problems) == 1 and problems[0].startswith("job.yaml: " + expected), problems


@pytest.mark.parametrize(
    "settings",
    [
        {"actor.use_kl_loss": True, "actor.kl_loss_coef": 0.1},
        {"algorithm.adv_estimator": "gae", "algorithm.gamma": 0.9, "algorithm.lam": 0.9, "critic.optim.lr": 0.1,
         "critic.ppo_mini_batch_size": 8},
        {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.gamma": 0.9},
        {"actor.kl_loss_coef": 0.001},  # the default: nothing to reject
        {"tracking.backends": ["wandb", "tensorboard"], "tracking.project_name": "p"},
        {"actor.lora.rank": 8, "actor.lora.alpha": 16, "actor.lora.dropout": 0.05, "actor.use_kl_loss": True,
         "ref.log_prob_micro_batch_size_per_gpu": 2},
        {"reward.function": ASYNC_REWARD, "reward.async_concurrency": 8},
        {"actor.megatron": {"pipeline_model_parallel_size": 2}, "ref.megatron": {"pipeline_model_parallel_size": 2}},
        {"rollout.engine": "sglang", "rollout.mem_fraction_static": 0.5, "rollout.sglang.router": True,
         "rollout.sglang.router_args": {"policy": "round_robin"}},
    ],
)
def test_a_setting_that_is_read_passes(settings):
    assert problems_with(settings) == []


def test_the_resolved_spec_loads_back_although_it_writes_every_field():
    raw = minimal_spec()
    raw["actor"]["megatron"] = {"pipeline_model_parallel_size": 2}  # the ref and critic layouts derive from it
    resolved = parse_yaml(dump_spec(spec_from_raw(raw)))
    assert spec_from_raw(resolved) == spec_from_raw(raw)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"reward.model.combiner": "c.py:f", "reward.model.rule_weight": 1.0},
         "reward.model.rule_weight=1.0: reward.model.combiner computes the reward instead of the weighted sum"),
        ({"reward.function": "r.py:f"},
         "reward.function=r.py:f: the reward model scores alone (reward.model.rule_weight=0, no combiner)"),
        ({"reward.num_workers": 2},
         "reward.num_workers=2: the reward model scores alone (reward.model.rule_weight=0, no combiner)"),
    ],
)
def test_a_reward_model_setting_that_would_change_nothing_is_rejected(settings, expected, tmp_path):
    import json

    config = json.loads((REPO_ROOT / "configs" / "quickstart" / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"],
                                                      "id2label": {"0": "score"}}))
    # The plug-in files named do not exist; that is checks.py's to say, beside the rule's problem.
    problems = [p for p in problems_with({"reward.model.path": str(tmp_path), **settings}) if "is not a file" not in p]
    assert len(problems) == 1 and problems[0].startswith("job.yaml: " + expected), problems
