"""Entry point of tests/driver/test_algorithms_fit.py, run in a fresh process: one in-process policy rank (actor,
critic, local engine) built once, then `Trainer.fit` for a couple of steps per case (an estimator or a policy loss
chosen by spec overrides) on that same rank. Writes, per case, the metric history and what each step computed."""
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

from rlmegatron.prelaunch.spec_pipeline import load_spec
from rlmegatron.driver.trainer import Trainer

QUICKSTART = "configs/quickstart.yaml"
# 4 prompts x 4 samples of up to 3 tokens; a stop token ends about a quarter of the responses early, so masks vary.
# One actor (and critic) optimizer step per fit step. Every case shares the rank and so its Adam state: with
# beta1 = 0 a step descends its own loss whatever the earlier cases did, and without weight decay any weight change
# comes from the gradient.
BASE = ["placement.gpus_per_node=1", "data.train_batch_size=4", "rollout.n=4", "data.max_response_length=3",
        f"rollout.stop_token_ids=[{','.join(map(str, range(41, 73)))}]", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=16",
        "actor.optim.adam_beta1=0", "actor.optim.weight_decay=0",
        "reward.function=tests/driver/graded_reward.py:compute_score", "trainer.total_steps=2",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "data.val_files=[]", "trainer.val_before_train=false",
        "trainer.resume=disable", "tracking.backends=[console]"]
CRITIC = ["critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=16", "critic.optim.lr=1e-3"]


def overrides_for(estimator: str) -> list[str]:
    """BASE plus what `estimator` reads: the spec rejects a critic section or a gamma nobody uses."""
    from rlmegatron.algorithms.advantages import estimator_options

    return (BASE + [f"algorithm.adv_estimator={estimator}"] + (CRITIC if estimator == "gae" else [])
            + (["algorithm.gamma=0.9"] if "gamma" in estimator_options(estimator) else []))


def logit_gap(model, prompt_ids, output_ids) -> float:
    """Largest (max logit - chosen token's logit) over a response's tokens: 0 for a greedy response."""
    tokens = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, len(prompt_ids) - 1 : -1].float()
    chosen = logits.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1)
    return float((logits.max(-1).values - chosen).max())


class RecordingTrainer(Trainer):
    """The fit loop unchanged; each phase's result is kept for the checks, plus the actor's log-probs after its
    update (one more forward pass) and how far the generated tokens are from greedy under the engine's weights."""

    def __init__(self, *args, engine_model):
        super().__init__(*args)
        self.engine_model = engine_model
        self.steps: list[dict] = []

    def collect_rollout(self, step, timer, metrics):
        self.steps.append({"sample_gap": 0.0, "greedy": None, "baselines": None})
        rollout = super().collect_rollout(step, timer, metrics)
        self.steps[-1].update(sample_ids=[p.sample_id for p in rollout.prompts], uids=list(rollout.uids),
                              scores=rollout.scores, rewards=rollout.rewards)
        return rollout

    def generate(self, prompts, params, seed, label="rollout"):
        results = super().generate(prompts, params, seed, label)
        gap = max(logit_gap(self.engine_model, prompts[r.request_index].prompt_ids, r.output_token_ids)
                  for r in results)
        if label == "gen_baseline":
            self.steps[-1]["greedy"] = {
                "n": params.n, "temperature": params.temperature, "gap": gap,
                "lengths": [len(r.output_token_ids) for r in results],
                "sample_ids": [prompts[r.request_index].sample_id for r in results],
                "ground_truths": [prompts[r.request_index].ground_truth for r in results],
                "texts": [self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in results]}
        else:
            self.steps[-1]["sample_gap"] = max(self.steps[-1]["sample_gap"], gap)
        return results

    def greedy_baselines(self, rollout, timer, metrics):
        self.steps[-1]["baselines"] = super().greedy_baselines(rollout, timer, metrics)
        return self.steps[-1]["baselines"]

    def update(self, role, batch):
        # An on-policy update has no old-log-prob pass: the policy before it is measured here instead.
        old_log_probs = batch.old_log_probs
        if role == "actor" and old_log_probs is None:
            old_log_probs = self.ranks.compute_log_prob(batch)
        metrics = super().update(role, batch)
        if role == "actor":
            self.steps[-1].update(response_mask=batch.response_mask, advantages=batch.advantages,
                                  returns=batch.returns, values=batch.values, old_log_probs=old_log_probs,
                                  new_log_probs=self.ranks.compute_log_prob(batch))
        return metrics


def engine_weights(rank) -> dict[str, torch.Tensor]:
    from rlmegatron.rollout.local import checkpoint_named_weights

    return {name: tensor.clone() for name, tensor in checkpoint_named_weights(rank.engine.leader.model).items()}


def run_case(case: dict, rank, ranks, engines, tokenizer, train_set, reward_manager, run_dir: Path) -> dict:
    from rlmegatron.checkpoint import CheckpointManager
    from rlmegatron.driver.role_settings import actor_settings
    from rlmegatron.data import PromptDataLoader
    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.tracking import Tracker, TrackingSetup

    spec = load_spec(QUICKSTART, overrides_for(case["estimator"]) + case["overrides"] + [f"trainer.run_dir={run_dir}"])
    settings = dataclasses.replace(actor_settings(spec, spec.trainer.total_steps),
                                   vocab_size=rank.models.actor.settings.vocab_size)
    rank.models.actor.settings = settings
    loader = PromptDataLoader(train_set, spec.data.train_batch_size, shuffle=spec.data.shuffle, seed=spec.data.seed)
    tracker = Tracker(TrackingSetup([], run_dir, spec.tracking.project_name, spec.trainer.experiment_name))
    before = engine_weights(rank)
    checkpoints = CheckpointManager(spec.trainer.run_dir, None)
    checkpoints.plan_resume(spec.trainer.resume)
    trainer = RecordingTrainer(spec, ranks, engines, tokenizer, loader, None, reward_manager, tracker,
                               checkpoints, engine_model=rank.engine.leader.model)
    trainer.fit()
    after = engine_weights(rank)
    exported = dict(HFWeightExporter(rank.models.actor.chunks, rank.models.weight_map).stream())
    return {
        "history": tracker.history,
        "steps": trainer.steps,
        "policy_loss": rank.models.actor.settings.policy_loss,
        "engine_change": max(float((after[n] - before[n]).abs().max()) for n in after),
        "sync_error": max(float((after[name] - tensor).abs().max()) for name, tensor in exported.items()),
    }


def main(out: str, cases: list[dict]) -> None:
    from transformers import AutoTokenizer

    from rlmegatron.driver.trainer_client import TrainerClient
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.driver.engine_fleet import EngineFleet, InTrainerRanks
    from rlmegatron.rollout.engine import INITIAL_VERSION
    from rlmegatron.transport.worker_group import LocalWorkerGroup
    from rlmegatron.data import build_dataset
    from rlmegatron.rewards import build_reward_manager

    run_root = Path(out).parent
    # Built for gae, so the rank holds a critic; the other cases' specs leave it unused.
    spec = load_spec(QUICKSTART, overrides_for("gae") + [f"trainer.run_dir={run_root / 'build'}"])
    group = LocalWorkerGroup(spec.placement.device, PolicyRank, trainer_rank_settings(spec, spec.trainer.total_steps))
    rank, ranks = group[0], TrainerClient(group)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_path)
    train_set = build_dataset(spec.data.train_files, tokenizer, spec.data)
    reward_manager = build_reward_manager(spec.reward, spec.data.max_response_length)
    engines = EngineFleet(InTrainerRanks(ranks), held=INITIAL_VERSION)
    results = {}
    try:
        for case in cases:
            try:
                results[case["name"]] = run_case(case, rank, ranks, engines, tokenizer, train_set, reward_manager,
                                                 run_root / case["name"])
            except Exception:  # noqa: BLE001 - one case failing must not hide the others' results
                results[case["name"]] = {"error": traceback.format_exc()}
    finally:
        reward_manager.close()
        ranks.shutdown()
    torch.save(results, out)


# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
