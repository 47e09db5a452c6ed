"""One trainer rank of the policy: actor, optional reference and critic, and a colocated rollout engine (the hybrid engine)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import random
import socket
import sys
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from rlmegatron.controller.role_settings import ModelSource, trainer_rank_settings
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, RolloutEngine
from rlmegatron.workers import RolloutBatch

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec


class PolicyRank:
    """Everything one trainer rank holds: a plain class; the process group must already be up.

    Every rank receives the same full batch and returns the same full result (the workers
    gather over data parallelism), except `generate`, which serves only the requests it is given.
    """

    def __init__(self, spec: JobSpec, total_steps: int) -> None:
        """`total_steps`: the run's trainer steps (Trainer.total_steps), which the learning-rate schedules span."""
        from rlmegatron.controller.engines import build_colocated_engine
        from rlmegatron.models.hf_config import build_gpt_model, transformer_config
        from rlmegatron.models.weight_map import WeightMap
        from rlmegatron.runtime import init_model_parallel, layout_scope
        from rlmegatron.workers import ActorWorker, CriticWorker, ReferenceWorker

        self.settings = settings = trainer_rank_settings(spec, total_steps)
        self.rank = torch.distributed.get_rank()
        # Each role runs at its own layout: all layouts' groups are built once, the actor's is the active one, and
        # `phase` switches to another role's for the duration of that role's work.
        roles = list(settings.roles)
        self.layouts = {role: settings.roles[role].layout for role in roles}
        init_model_parallel(self.layouts["actor"], seed=settings.seed,
                            others=[self.layouts[role] for role in roles[1:]])
        facts = _shared_model_facts(settings.model, [layout.tp for layout in self.layouts.values()])
        untied = dataclasses.replace(facts, tie_word_embeddings=False)  # the critic's output layer is its value head
        self.weight_map = WeightMap(facts)

        def provider_for(role, model_facts_):
            config = transformer_config(model_facts_, self.layouts[role], dtype=settings.model.dtype,
                                        options=settings.roles[role].config_options)
            return lambda pre, post, vp: build_gpt_model(model_facts_, config, vp_stage=vp)

        def build(role, worker_class, worker_settings, model_facts_):
            with layout_scope(self.layouts[role]):
                # Seeded alike, so each role's random init is the same on every rank and in every run.
                self._seed_everything(settings.seed)
                worker = worker_class(worker_settings, provider_for(role, model_facts_), self.layouts[role])
                worker.init(parallel_state_ready=True)
            return worker

        # The actor and reference compute log-probs over the tokenizer's vocabulary, not the padded one.
        vocab = {"vocab_size": facts.vocab_size}
        self.actor = build("actor", ActorWorker, dataclasses.replace(settings.roles["actor"].worker, **vocab), facts)
        self.reference = self.critic = None
        if "reference" in roles:
            self.reference = build("reference", ReferenceWorker,
                                   dataclasses.replace(settings.roles["reference"].worker, **vocab), facts)
        if "critic" in roles:
            self.critic = build("critic", CriticWorker, settings.roles["critic"].worker, untied)
        self._load_initial_weights(untied)

        # Roles whose memory waits in host memory between the phases that use them (`*.offload`).
        self.offload_parts = {role: settings.roles[role].offload for role in roles if settings.roles[role].offload}
        for role, parts in self.offload_parts.items():
            getattr(self, role).offload(parts)
        # Colocated: `engine` is the engine this rank leads, or its EngineMember share of one led by another rank.
        self.engine_index, self.engine, self.engine_asleep, self.weight_push = None, None, False, None
        if settings.colocated:
            self.engine_index, self.engine = build_colocated_engine(settings.rollout, settings.model.hf_config())
            self.sync_weights("init")

    @contextlib.contextmanager
    def phase(self, role: str):
        """`role`'s parallel groups active, and its memory back in the device if offloaded, for one phase."""
        from rlmegatron.runtime import layout_scope

        offloaded = self.offload_parts.get(role)
        with layout_scope(self.layouts[role]):
            if offloaded:
                getattr(self, role).onload()
            try:
                yield
            finally:
                if offloaded:
                    getattr(self, role).offload(offloaded)

    def _load_initial_weights(self, untied) -> None:
        """The HF checkpoint into the actor and reference; the actor's initial weights into the critic (or a reward
        model), and into the reference of a random-init run: each at its role's layout."""
        from rlmegatron.models.convert import HFCheckpoint, load_hf_weights
        from rlmegatron.runtime import layout_scope
        from rlmegatron.workers.engine import unwrap

        settings = self.settings
        if not settings.model.random_init:
            checkpoint = HFCheckpoint(settings.model.path)
            for role in ("actor", "reference"):
                if getattr(self, role) is not None:
                    with layout_scope(self.layouts[role]):
                        load_hf_weights([unwrap(chunk) for chunk in getattr(self, role).chunks], self.weight_map,
                                        checkpoint)
            checkpoint.close()
        # A distributed checkpoint of the actor reshards to any other role's layout.
        from_actor = [role for role, wanted in (("reference", settings.model.random_init),
                                                ("critic", settings.critic_init_from == "actor"))
                      if wanted and getattr(self, role) is not None]
        if from_actor:
            path = settings.init_dir
            self.actor.save_weights(path)
            for role in from_actor:
                with layout_scope(self.layouts[role]):
                    if role == "critic":
                        self.critic.load_actor_weights(path)  # the value head keeps its own init
                    else:
                        self.reference.load_weights(path)
        if self.critic is not None and settings.critic_init_from != "actor":
            with layout_scope(self.layouts["critic"]):
                self.critic.load_reward_model(settings.critic_init_from, untied)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # --- the step's phases, in the order the trainer calls them ---

    def serves_rollout(self) -> bool:
        return isinstance(self.engine, RolloutEngine)

    def generate(self, requests: list[GenerationRequest], progress=None) -> Optional[list[GenerationResult]]:
        from rlmegatron.controller.engines import generate_or_none

        return generate_or_none(self.engine, requests, progress)

    def release_rollout_memory(self) -> None:
        """Colocated: the engine gives its memory back while the trainer runs; `sync_weights` wakes it."""
        if self.engine is not None:
            self.engine.release_memory()
            self.engine_asleep = True

    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.phase("actor"):
            log_probs, entropy = self.actor.compute_log_prob(batch, with_entropy=True)
        return log_probs.cpu(), entropy.cpu()

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        with self.phase("reference"):
            return self.reference.compute_log_prob(batch).cpu()

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        with self.phase("critic"):
            return self.critic.compute_values(batch).cpu()

    def update_critic(self, batch: RolloutBatch, progress=None) -> dict[str, float]:
        with self.phase("critic"):
            return self.critic.update(batch, progress if self.rank == 0 else None)

    def update_actor(self, batch: RolloutBatch, progress=None) -> dict[str, float]:
        with self.phase("actor"):
            return self.actor.update(batch, progress if self.rank == 0 else None)

    def connect_engines(self, endpoints: list[tuple[int, str, int]]) -> None:
        """Disaggregated: rank 0 joins a weight-update group with each (engine, url, tp_size) server."""
        from rlmegatron.rollout.buckets import travel_rules_for
        from rlmegatron.rollout.sglang import DistributedGroupSpec, DistributedWeightPush
        from rlmegatron.runtime.launcher import free_port

        if self.rank != 0:
            return
        if self.weight_push is None:
            self.weight_push = DistributedWeightPush(self.settings.rollout.bucket_bytes,
                                                     travel_rules_for(self.settings.model.hf_config()))
        address = socket.gethostbyname(socket.gethostname())
        for engine, url, tp_size in endpoints:
            port = free_port("")
            group = DistributedGroupSpec(address, port, f"rlmegatron_sync_{engine}_{port}",
                                         self.settings.rollout.weight_group_backend)
            self.weight_push.connect(engine, url, tp_size, group)

    def sync_weights(self, version: str, restarted: Optional[list[int]] = None) -> None:
        """Trained weights -> the engines (all, or the `restarted` ones), as HF-named full tensors. The export is
        collective, so every rank walks the whole stream; ranks with nothing to feed just let it pass."""
        from rlmegatron.resharding import HFWeightExporter

        with self.phase("actor"):
            stream = HFWeightExporter(self.actor.chunks, self.weight_map).stream()
            if self.weight_push is not None:
                self.weight_push.push(stream, version, only=restarted)
                return
            if self.engine is None or (restarted is not None and self.engine_index not in restarted):
                collections.deque(stream, maxlen=0)
                return
            if restarted is not None:
                self.engine.relaunch()
            if self.engine_asleep:
                self.engine.wake_up_with_weights(stream, version)
                self.engine_asleep = False
            else:
                self.engine.update_weights(stream, version)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    # --- checkpoints ---

    def save_checkpoint(self, path: str) -> None:
        from rlmegatron.checkpoint.state import save_rank_state

        save_rank_state(self, path)

    def load_checkpoint(self, path: str) -> None:
        from rlmegatron.checkpoint.integrity import load_failures_named
        from rlmegatron.checkpoint.state import load_rank_state

        with load_failures_named(path):
            load_rank_state(self, path)

    def export_hf(self, path: str) -> Optional[str]:
        """The policy as an HF checkpoint (safetensors shards + config.json), written by rank 0; returns the path there."""
        from rlmegatron.models.convert import export_hf

        with self.phase("actor"):
            export_hf(self.actor.chunks, self.weight_map, path, self.weight_map.facts.hf)
        return path if self.rank == 0 else None


def vocab_tp(tps: list[int]) -> int:
    """The TP size to pad the vocabulary for, given the roles' TP sizes: one padded vocabulary that splits into
    aligned shares at each of them, so every role's weights have the same shapes and move between the roles'
    layouts through a distributed checkpoint. It is the actor's own when every other role's TP divides the actor's."""
    return math.lcm(*tps)


def _shared_model_facts(model: ModelSource, tps: list[int]):
    """The model's facts for roles at TP sizes `tps` (see vocab_tp); from a checkpoint, the checkpoint decides
    whether DeepSeek's MTP layers are built."""
    from rlmegatron.models.convert import HFCheckpoint
    from rlmegatron.models.hf_config import model_facts, read_hf_config

    if model.random_init:
        return model_facts(read_hf_config(model.path), vocab_tp(tps))
    facts = HFCheckpoint(model.path).facts(vocab_tp(tps))
    if torch.distributed.get_rank() == 0 and facts.mtp_off_note:
        print(f"{model.path}: {facts.mtp_off_note}", file=sys.stderr, flush=True)
    return facts

