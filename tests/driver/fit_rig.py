"""A pure-Python rig around the real fit loop (`Trainer.fit`): fake ranks, engines and reward, no Megatron, no Ray.

Each fake answers in a way a test can work out by hand, and records what the loop asked of it: every generation call
(with the loop's label: rollout, validation, gen_baseline), every batch the actor and critic were updated with, every
checkpoint. A run of a few steps takes milliseconds, so a test can run the loop once per setting it checks.

    rig = run_rig(tmp_path, "rollout.n=3", "algorithm.norm_adv_by_std_in_grpo=false")
    rig.requests("rollout"), rig.ranks.updates["actor"], rig.history["critic/score/mean"]
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence


from rlmegatron.checkpoint import CheckpointManager
from rlmegatron.config import JobSpec
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
from rlmegatron.driver.engine_fleet import EngineFleet
from rlmegatron.driver.trainer import FitResult, Trainer
from rlmegatron.data import PromptDataLoader, Sample
from rlmegatron.rewards import RewardInput, RewardResult
from rlmegatron.rank.weight_push import SyncReport
from rlmegatron.rollout.engine import INITIAL_VERSION, GenerationRequest, GenerationResult
from rlmegatron.tracking import Tracker, TrackingSetup

REPO_ROOT = Path(__file__).resolve().parents[2]

# 4 prompts x 2 samples of at most 3 tokens per step, one rank; the files are never read (the rig brings its data).
BASE_SPEC = {
    "model": {"path": str(REPO_ROOT / "configs" / "quickstart" / "model")},
    "data": {"train_files": ["rig.jsonl"], "max_prompt_length": 8, "max_response_length": 3, "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 4},
    "rollout": {"engine": "local", "n": 2},
    "placement": {"device": "cpu", "nnodes": 1, "gpus_per_node": 1},
    "trainer": {"total_steps": 2, "val_before_train": False, "resume": "disable"},
}


def rig_spec(*overrides: str) -> JobSpec:
    """BASE_SPEC with dotted overrides, through every check and relevance rule a user's spec goes through."""
    return spec_from_raw(copy.deepcopy(BASE_SPEC), overrides)


def prompts(count: int, source: str = "rig") -> list[Sample]:
    """Prompt i is the tokens (1, 2 + i)."""
    return [Sample(index=i, prompt=[{"role": "user", "content": f"p{i}"}], prompt_ids=[1, 2 + i],
                   data_source=source, ground_truth=str(i)) for i in range(count)]


def response_length(request: GenerationRequest, sample: int) -> int:
    """Lengths vary over a group and between prompts, up to max_new_tokens."""
    return 1 + (request.prompt_token_ids[-1] + sample) % request.sampling.max_new_tokens


class FakeTokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def first_token_is_even(inputs: list[RewardInput]) -> list[float]:
    """The default reward: sample s of every request starts with token s, so a group of 2 scores [1, 0]."""
    return [float(int(item.solution_str.split()[0]) % 2 == 0) for item in inputs]


def constant(inputs: list[RewardInput]) -> list[float]:
    """Every group all-equal: nothing for dynamic sampling to keep."""
    return [0.5] * len(inputs)


class FakeRewardManager:
    def __init__(self, score: Callable[[list[RewardInput]], list[float]]) -> None:
        self.score = score
        self.seen: list[list[RewardInput]] = []

    def __call__(self, inputs: list[RewardInput]) -> RewardResult:
        self.seen.append(inputs)
        scores = self.score(inputs)
        return RewardResult(rewards=scores, scores=scores, extra={}, metrics={})


@dataclass
class FakeEngines:
    """Engines behind the real EngineFleet (driver.engine_fleet.EngineBackend): sample s of a request is token s then
    9s, `response_length` tokens, log-prob -0.5 each; the versions pushed to them are in `synced`, the engines
    relaunched in `relaunched`."""

    count: int = 1
    label: str = ""
    calls: list[tuple[str, list[GenerationRequest]]] = field(default_factory=list)
    synced: list[str] = field(default_factory=list)
    relaunched: list[list[int]] = field(default_factory=list)
    ranks: Optional["FakeRanks"] = None

    @property
    def engines(self) -> list[int]:
        return list(range(self.count))

    def generate(self, shares: dict[int, list[GenerationRequest]], progress=None) -> dict[int, list[GenerationResult]]:
        self.calls.append((self.label, [request for share in shares.values() for request in share]))
        answers = {}
        for engine, share in shares.items():
            answers[engine] = []
            for index, request in enumerate(share):
                for sample in range(request.sampling.n):
                    length = response_length(request, sample)
                    answers[engine].append(GenerationResult(index, sample, (sample,) + (9,) * (length - 1),
                                                            (-0.5,) * length, "length",
                                                            self.synced[-1] if self.synced else None))
        return answers

    def release_memory(self) -> None:
        pass

    def relaunch(self, engines: list[int]) -> None:
        self.relaunched.append(list(engines))

    def pause(self, engines: list[int]) -> list[int]:
        return engines

    def resume(self, engines: list[int]) -> None:
        pass

    def pushed(self, version: str, engines: list[int]) -> None:
        self.synced.append(version)

    def shutdown(self) -> None:
        pass


@dataclass
class FakeRanks:
    """The policy ranks as the loop addresses them (driver.trainer_client.TrainerClient): log-probs, reference and
    teacher log-probs and values are constants on every response token; every call is recorded by its method's name, and
    updates and checkpoints with what they were given."""

    log_prob: float = 0.0
    ref_log_prob: float = 0.0
    teacher_log_prob: float = 0.0
    value: float = 0.0
    world_size: int = 1
    calls: list[str] = field(default_factory=list)
    updates: dict[str, list] = field(default_factory=lambda: {"actor": [], "critic": []})
    owner: threading.RLock = field(default_factory=threading.RLock)
    pushes: list[tuple[str, list[int], bool]] = field(default_factory=list)

    def sync_weights(self, version: str, engines=None, fresh: bool = False) -> SyncReport:
        self.pushes.append((version, list(engines), fresh))
        return SyncReport(full=fresh)  # no engine went down during the push

    def compute_log_prob(self, batch):
        self.calls.append("compute_log_prob")
        return self.log_prob * batch.response_mask

    def compute_ref_log_prob(self, batch):
        self.calls.append("compute_ref_log_prob")
        return self.ref_log_prob * batch.response_mask

    def compute_teacher_log_prob(self, batch):
        self.calls.append("compute_teacher_log_prob")
        return self.teacher_log_prob * batch.response_mask

    def compute_values(self, batch):
        self.calls.append("compute_values")
        return self.value * batch.response_mask

    def update_actor(self, batch, progress=None) -> dict[str, float]:
        return self._update("actor", batch)

    def update_critic(self, batch, progress=None) -> dict[str, float]:
        return self._update("critic", batch)

    def _update(self, role: str, batch) -> dict[str, float]:
        self.calls.append(f"update_{role}")
        self.updates[role].append(batch)
        return {f"{role}/loss": 0.0}

    def save_checkpoint(self, path: str) -> None:
        self.calls.append("save_checkpoint")
        (Path(path) / "rank_0.pt").write_text("weights")

    def load_checkpoint(self, path: str) -> None:
        self.calls.append("load_checkpoint")

    def export_hf(self, path: str) -> None:
        self.calls.append("export_hf")


def failing_on_second_call(method: str, error: BaseException) -> FakeRanks:
    """Fake ranks whose `method` raises `error` on its second call (step 2's), after doing its work."""
    ranks = FakeRanks()
    call = getattr(ranks, method)

    def second_call_fails(*args, **kwargs):
        result = call(*args, **kwargs)
        if ranks.calls.count(method) == 2:
            raise error
        return result

    setattr(ranks, method, second_call_fails)
    return ranks


class RigTrainer(Trainer):
    """The fit loop unchanged; each generation call is labelled for the engines' record."""

    def generate(self, prompts, params, seed, label="rollout"):
        self.engines.backend.label = label
        return super().generate(prompts, params, seed, label)


@dataclass
class Rig:
    spec: JobSpec
    trainer: RigTrainer
    ranks: FakeRanks
    engines: FakeEngines
    reward: Callable[[list[RewardInput]], RewardResult]
    tracker: Tracker
    result: FitResult

    @property
    def history(self) -> dict[str, list[tuple[int, float]]]:
        return self.tracker.history

    def calls(self, label: str) -> list[list[GenerationRequest]]:
        """The requests of each generation call with this label, in order."""
        return [requests for call_label, requests in self.engines.calls if call_label == label]

    def requests(self, label: str) -> list[GenerationRequest]:
        return [request for requests in self.calls(label) for request in requests]


def run_rig(run_dir: Path, *overrides: str, reward=first_token_is_even, train_prompts: int = 8,
            val_prompts: int = 0, ranks: FakeRanks | None = None, engines: FakeEngines | None = None,
            reward_manager=None) -> Rig:
    """`Trainer.fit` on rig_spec(overrides), in `run_dir`; `reward_manager` (a real one) in place of `reward`."""
    spec = rig_spec(f"trainer.run_dir={run_dir}", *overrides)
    ranks = ranks or FakeRanks()
    engines, reward_manager = engines or FakeEngines(), reward_manager or FakeRewardManager(reward)
    engines.ranks = ranks
    loader = PromptDataLoader(prompts(train_prompts), spec.data.train_batch_size, shuffle=spec.data.shuffle,
                              seed=spec.data.seed)
    val_set = prompts(val_prompts, "val") if spec.data.val_files else None
    tracker = Tracker(TrackingSetup([], Path(run_dir), spec.tracking.project_name, spec.trainer.experiment_name))
    checkpoints = CheckpointManager(spec.trainer.run_dir, spec.trainer.max_ckpt_to_keep)
    checkpoints.plan_resume(spec.trainer.resume)  # as run_training does before the loop starts
    trainer = RigTrainer(spec, ranks, EngineFleet(engines, held=INITIAL_VERSION), FakeTokenizer(), loader, val_set,
                         reward_manager, tracker, checkpoints)
    result = trainer.fit()
    return Rig(spec, trainer, ranks, engines, reward_manager, tracker, result)
