"""One trainer rank of the policy: actor, optional reference and critic, and a colocated rollout engine (the hybrid engine)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import random
import socket
import sys
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, RolloutEngine
from rlmegatron.workers import RolloutBatch

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec


def parallel_layout(megatron):
    from rlmegatron.config.transformer_config import FIRST_STAGE, LAST_STAGE
    from rlmegatron.runtime import ParallelLayout

    return ParallelLayout(
        tp=megatron.tensor_model_parallel_size,
        pp=megatron.pipeline_model_parallel_size,
        vpp=megatron.virtual_pipeline_model_parallel_size,
        cp=megatron.context_parallel_size,
        ep=megatron.expert_model_parallel_size,
        etp=megatron.expert_tensor_parallel_size,
        sequence_parallel=megatron.sequence_parallel,
        first_stage_layers=megatron.extra.get(FIRST_STAGE),
        last_stage_layers=megatron.extra.get(LAST_STAGE),
    )


def actor_settings(spec: JobSpec, total_steps: int):
    """The actor's worker settings from the spec; mini-batches count prompts in the spec, sequences here;
    the learning-rate schedule spans the run's `total_steps` trainer steps."""
    from rlmegatron.algorithms import PolicyLossConfig
    from rlmegatron.workers import ActorSettings

    actor = spec.actor
    return ActorSettings(
        **_training_fields(actor, spec, total_steps),
        temperature=spec.rollout.temperature or 1.0,
        policy_loss=actor.policy_loss.loss_mode,
        policy_loss_config=PolicyLossConfig(**{name: value for name, (_, value) in
                                               actor.policy_loss_settings().items()}),
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        entropy_coeff=actor.entropy_coeff,
        log_prob_micro_batch_size=spec.rollout.log_prob_micro_batch_size_per_gpu,
    )


def reference_settings(actor, ref):
    """The actor's settings `actor` (log-probs are computed exactly as the actor's: temperature, vocabulary) with
    the reference's own forward batching from its spec section `ref`."""
    return dataclasses.replace(
        actor,
        micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
        max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
    )


def critic_settings(spec: JobSpec, total_steps: int):
    from rlmegatron.workers import CriticSettings

    return CriticSettings(**_training_fields(spec.critic, spec, total_steps),
                          cliprange_value=spec.critic.cliprange_value)


def _training_fields(role, spec: JobSpec, total_steps: int) -> dict:
    """Batching and optimizer settings of a trained role (actor or critic) from its spec section."""
    return dict(
        ppo_mini_batch_size=role.ppo_mini_batch_size * spec.rollout.n,
        ppo_epochs=role.ppo_epochs,
        micro_batch_size=role.ppo_micro_batch_size_per_gpu,
        max_token_len=role.ppo_max_token_len_per_gpu if role.use_dynamic_bsz else None,
        loss_agg_mode=spec.actor.loss_agg_mode,
        optimizer=_optimizer_settings(role.optim, total_steps),
        use_distributed_optimizer=role.megatron.use_distributed_optimizer,
    )


def _optimizer_settings(optim, total_steps: int):
    from rlmegatron.workers import OptimizerSettings

    return OptimizerSettings(
        lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_style=optim.lr_decay_style,
        lr_decay_steps=total_steps,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
    )


class PolicyRank:
    """Everything one trainer rank holds: a plain class; the process group must already be up.

    Every rank receives the same full batch and returns the same full result (the workers
    gather over data parallelism), except `generate`, which serves only the requests it is given.
    """

    def __init__(self, spec: JobSpec, total_steps: int) -> None:
        """`total_steps`: the run's trainer steps (Trainer.total_steps), which the learning-rate schedules span."""
        from rlmegatron.controller.engines import build_colocated_engine
        from rlmegatron.models.hf_config import build_gpt_model, spec_config_options, transformer_config
        from rlmegatron.models.weight_map import WeightMap
        from rlmegatron.runtime import init_model_parallel, layout_scope
        from rlmegatron.workers import ActorWorker, CriticWorker, ReferenceWorker

        self.spec = spec
        self.rank = torch.distributed.get_rank()
        # Each role runs at its own layout: all layouts' groups are built once, the actor's is the active one, and
        # `phase` switches to another role's for the duration of that role's work.
        sections = {"actor": spec.actor.megatron, "reference": spec.ref.megatron, "critic": spec.critic.megatron}
        roles = ["actor"] + ["reference"] * spec.needs_reference + ["critic"] * bool(spec.critic.enable)
        self.layouts = {role: parallel_layout(sections[role]) for role in roles}
        init_model_parallel(self.layouts["actor"], seed=spec.trainer.seed,
                            others=[self.layouts[role] for role in roles[1:]])
        facts = _shared_model_facts(spec, [layout.tp for layout in self.layouts.values()])
        untied = dataclasses.replace(facts, tie_word_embeddings=False)  # the critic's output layer is its value head
        self.weight_map = WeightMap(facts)

        def provider_for(role, model_facts_):
            config = transformer_config(model_facts_, self.layouts[role], dtype=spec.model.dtype,
                                        options=spec_config_options(sections[role]))
            return lambda pre, post, vp: build_gpt_model(model_facts_, config, vp_stage=vp)

        def build(role, worker_class, settings, model_facts_):
            with layout_scope(self.layouts[role]):
                # Seeded alike, so each role's random init is the same on every rank and in every run.
                self._seed_everything(spec.trainer.seed)
                worker = worker_class(settings, provider_for(role, model_facts_), self.layouts[role])
                worker.init(parallel_state_ready=True)
            return worker

        settings = dataclasses.replace(actor_settings(spec, total_steps), vocab_size=facts.vocab_size)
        self.actor = build("actor", ActorWorker, settings, facts)
        self.reference = self.critic = None
        if "reference" in roles:
            self.reference = build("reference", ReferenceWorker, reference_settings(settings, spec.ref), facts)
        if "critic" in roles:
            self.critic = build("critic", CriticWorker, critic_settings(spec, total_steps), untied)
        self._load_initial_weights(untied)

        # Roles whose memory waits in host memory between the phases that use them (`*.offload`).
        self.offload_parts = {role: parts for role, parts in (
            ("actor", _offload_parts(spec.actor.offload)), ("reference", _offload_parts(spec.ref.offload)),
            ("critic", _offload_parts(spec.critic.offload))) if parts and getattr(self, role) is not None}
        for role, parts in self.offload_parts.items():
            getattr(self, role).offload(parts)
        # Colocated: `engine` is the engine this rank leads, or its EngineMember share of one led by another rank.
        self.engine_index, self.engine, self.engine_asleep, self.weight_push = None, None, False, None
        if spec.placement.mode == "colocate":
            self.engine_index, self.engine = build_colocated_engine(spec, self._hf_config())
            self.sync_weights("init")

    def _hf_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.spec.model.path, trust_remote_code=self.spec.model.trust_remote_code)

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

        spec = self.spec
        if not spec.model.random_init:
            checkpoint = HFCheckpoint(spec.model.path)
            for role in ("actor", "reference"):
                if getattr(self, role) is not None:
                    with layout_scope(self.layouts[role]):
                        load_hf_weights([unwrap(chunk) for chunk in getattr(self, role).chunks], self.weight_map,
                                        checkpoint)
            checkpoint.close()
        # A distributed checkpoint of the actor reshards to any other role's layout.
        from_actor = [role for role, wanted in (("reference", spec.model.random_init),
                                                ("critic", spec.critic.init_from == "actor"))
                      if wanted and getattr(self, role) is not None]
        if from_actor:
            path = os.path.join(spec.trainer.run_dir, "init_actor")
            self.actor.save_weights(path)
            for role in from_actor:
                with layout_scope(self.layouts[role]):
                    if role == "critic":
                        self.critic.load_actor_weights(path)  # the value head keeps its own init
                    else:
                        self.reference.load_weights(path)
        if self.critic is not None and spec.critic.init_from != "actor":
            with layout_scope(self.layouts["critic"]):
                self.critic.load_reward_model(spec.critic.init_from, untied)

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
            self.weight_push = DistributedWeightPush(self.spec.rollout.update_weights_bucket_mb << 20,
                                                     travel_rules_for(self._hf_config()))
        address = socket.gethostbyname(socket.gethostname())
        for engine, url, tp_size in endpoints:
            port = free_port("")
            group = DistributedGroupSpec(address, port, f"rlmegatron_sync_{engine}_{port}",
                                         "nccl" if self.spec.placement.device == "cuda" else "gloo")
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
        from rlmegatron.resharding import export_hf

        with self.phase("actor"):
            export_hf(self.actor.chunks, self.weight_map, path, self.weight_map.facts.hf)
        return path if self.rank == 0 else None


def vocab_tp(tps: list[int]) -> int:
    """The TP size to pad the vocabulary for, given the roles' TP sizes: one padded vocabulary that splits into
    aligned shares at each of them, so every role's weights have the same shapes and move between the roles'
    layouts through a distributed checkpoint. It is the actor's own when every other role's TP divides the actor's."""
    return math.lcm(*tps)


def _shared_model_facts(spec: JobSpec, tps: list[int]):
    """The model's facts for roles at TP sizes `tps` (see vocab_tp); from a checkpoint, the checkpoint decides
    whether DeepSeek's MTP layers are built."""
    from rlmegatron.models.convert import HFCheckpoint
    from rlmegatron.models.hf_config import model_facts, read_hf_config

    if spec.model.random_init:
        return model_facts(read_hf_config(spec.model.path), vocab_tp(tps))
    facts = HFCheckpoint(spec.model.path).facts(vocab_tp(tps))
    if torch.distributed.get_rank() == 0 and facts.mtp_off_note:
        print(f"{spec.model.path}: {facts.mtp_off_note}", file=sys.stderr, flush=True)
    return facts


def _offload_parts(offload) -> tuple[str, ...]:
    """The parts an `*.offload` section asks for (the reference's has params only)."""
    from rlmegatron.workers.offload import PARTS

    return tuple(part for part in PARTS if getattr(offload, part, False))
