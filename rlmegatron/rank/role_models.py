"""Model building inside a trainer rank: the Megatron roles (the actor; the reference, the critic, a reward model and
a distillation teacher when the run has them), each at its own parallel layout, started from the HF checkpoint or from
the actor's initial weights (the reward model and the teacher from their own), and kept in host memory between the phases that use them when their
`offload` section asks."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
from typing import Iterator

import numpy as np
import torch

from rlmegatron.models.source import ModelSource

from rlmegatron.rank.settings import TrainerRankSettings
from rlmegatron.models.convert import ConvertMeta, HFCheckpoint, load_hf_weights
from rlmegatron.models.hf_config import build_gpt_model, model_facts, read_hf_config, transformer_config
from rlmegatron.models.lora import add_adapters, remember_base_weights
from rlmegatron.models.weight_map import WeightMap
from rlmegatron.runtime import init_model_parallel, layout_scope
from rlmegatron.rank.roles import ActorWorker, CriticWorker, ReferenceWorker
from rlmegatron.rank.roles.megatron_step import load_weights, unwrap
from rlmegatron.rank.roles.reward_model import RewardModelWorker

WORKERS = {"actor": ActorWorker, "reference": ReferenceWorker, "critic": CriticWorker}


class RoleModels:
    """The roles of one trainer rank. All layouts' groups are built once and the actor's is the active one;
    `phase(role)` switches to another role's, and brings its offloaded memory back, for that role's work."""

    def __init__(self, settings: TrainerRankSettings) -> None:
        self.settings = settings
        roles = list(settings.roles)
        self.layouts = {role: settings.roles[role].layout for role in roles}
        # With LoRA the reference's model and memory are the actor's (the spec leaves it no offload of its own).
        self.memory_of = {role: "actor" if role == "reference" and settings.lora else role for role in roles}
        init_model_parallel(self.layouts["actor"], seed=settings.seed,
                            others=[self.layouts[role] for role in roles[1:]])
        policy_roles = [role for role in roles if role not in ("reward", "teacher")]  # those two are models of their own
        facts = _shared_model_facts(settings.model, [self.layouts[role].tp for role in policy_roles])
        untied = dataclasses.replace(facts, tie_word_embeddings=False)  # the critic's output layer is its value head
        self.weight_map = WeightMap(facts)
        self.actor = self.reference = self.critic = self.reward = self.teacher = None
        for role in policy_roles:
            worker_settings = settings.roles[role].worker
            if role != "critic":  # log-probs over the tokenizer's vocabulary, not the padded one
                worker_settings = dataclasses.replace(worker_settings, vocab_size=facts.vocab_size)
            setattr(self, role, self._build(role, worker_settings, untied if role == "critic" else facts))
        self._load_initial_weights(untied)
        if settings.lora is not None:  # the modules LoRA trains whole start from, and switch off to, these weights
            remember_base_weights(self.actor.chunks)
        if "reward" in roles:
            self.reward = self._build_reward_model(settings.reward_model_path)
        if "teacher" in roles:
            self.teacher = self._build_teacher(settings.teacher_path)
        self.offload_parts = {role: settings.roles[role].offload for role in roles if settings.roles[role].offload}
        for role, parts in self.offload_parts.items():
            getattr(self, role).offload(parts)

    def _build(self, role: str, worker_settings, facts):
        layout, lora = self.layouts[role], self.settings.lora
        if role == "reference" and lora is not None:  # the actor with its adapters off: no second model
            return ReferenceWorker.base_of(worker_settings, self.actor.chunks, layout)
        with layout_scope(layout):
            # Seeded alike, so each role's random init is the same on every rank and in every run.
            seed_everything(self.settings.seed)
            config = transformer_config(facts, layout, dtype=self.settings.model.dtype,
                                        options=self.settings.roles[role].config_options)

            # lazy: models.vision subclasses GPTModel, so it imports Megatron-Core, which the driver (importing
            # this module for PolicyRank's method references) must not pay for or print the notices of.
            from rlmegatron.models.mtp import detach_mtp_inputs, freeze_mtp_layers
            from rlmegatron.models.vision import freeze_vision_tower

            # Only the actor's MTP loss trains the MTP layers (actor.mtp.loss_weight), alone with actor.mtp.detach.
            trains_mtp = role == "actor" and worker_settings.mtp_loss_weight > 0

            def provide(pre, post, vp):
                model = build_gpt_model(facts, config, vp_stage=vp)
                freeze_vision_tower([model], self.settings.freeze_vision)  # before DDP, which skips frozen weights
                freeze_mtp_layers(model, not trains_mtp)
                detach_mtp_inputs([model], trains_mtp and worker_settings.mtp_detach)
                return add_adapters(model, lora, self.settings.seed) if role == "actor" and lora else model

            worker = WORKERS[role](worker_settings, provide, layout)
            worker.init(parallel_state_ready=True)
        return worker

    def _build_reward_model(self, path: str) -> RewardModelWorker:
        """The reward model at its layout, from its own HF checkpoint (its own architecture and vocabulary)."""
        layout = self.layouts["reward"]
        with layout_scope(layout):
            facts = dataclasses.replace(HFCheckpoint(path).facts(layout.tp), tie_word_embeddings=False)
            config = transformer_config(facts, layout, dtype=self.settings.model.dtype)
            worker = RewardModelWorker(self.settings.roles["reward"].worker,
                                       lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
            worker.init()
            worker.load(path, facts)
        return worker

    def _build_teacher(self, path: str) -> ReferenceWorker:
        """On-policy distillation's teacher at its layout, from its own checkpoint (HF, or written by `rlm convert
        hf-to-mcore`): its own architecture, the student's tokenizer (the spec's preflight compared them), its
        log-probs computed as the reference's are."""
        layout, role = self.layouts["teacher"], self.settings.roles["teacher"]
        converted = ConvertMeta.written_in(path)
        with layout_scope(layout):
            checkpoint = None if converted else HFCheckpoint(path)
            facts = (ConvertMeta.load(path) if converted else checkpoint).facts(layout.tp)
            config = transformer_config(facts, layout, dtype=self.settings.model.dtype, options=role.config_options)
            worker = ReferenceWorker(dataclasses.replace(role.worker, vocab_size=facts.vocab_size),
                                     lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout,
                                     label="teacher")
            worker.init(parallel_state_ready=True)
            if converted:
                load_weights(worker.chunks, path)
            else:
                load_hf_weights([unwrap(chunk) for chunk in worker.chunks], WeightMap(facts), checkpoint)
                checkpoint.close()
        return worker

    @contextlib.contextmanager
    def phase(self, role: str) -> Iterator[None]:
        """`role`'s parallel groups active, and its memory back in the device if offloaded, for one phase."""
        owner = self.memory_of[role]
        offloaded = self.offload_parts.get(owner)
        with layout_scope(self.layouts[role]):
            if offloaded:
                getattr(self, owner).onload()
            try:
                yield
            finally:
                if offloaded:
                    getattr(self, owner).offload(offloaded)

    def trained(self) -> list[tuple[str, object]]:
        """(name, worker) of each role that trains (actor, critic); the reference is frozen and rebuilt."""
        return [(role, getattr(self, role)) for role in ("actor", "critic") if getattr(self, role) is not None]

    def _load_initial_weights(self, untied) -> None:
        """The HF checkpoint into the actor and reference; the actor's initial weights into the critic (or a reward
        model), and into the reference of a random-init run: each at its role's layout."""
        settings = self.settings
        if not settings.model.random_init:
            checkpoint = HFCheckpoint(settings.model.path)
            for role in ("actor", "reference"):
                if getattr(self, role) is not None and self.memory_of[role] == role:
                    with layout_scope(self.layouts[role]):
                        load_hf_weights([unwrap(chunk) for chunk in getattr(self, role).chunks], self.weight_map,
                                        checkpoint)
            checkpoint.close()
        # A distributed checkpoint of the actor reshards to any other role's layout.
        from_actor = [role for role, wanted in (("reference", settings.model.random_init and not settings.lora),
                                                ("critic", settings.critic_init_from == "actor"))
                      if wanted and getattr(self, role) is not None]
        if from_actor:
            self.actor.save_weights(settings.init_dir)
            for role in from_actor:
                with layout_scope(self.layouts[role]):
                    if role == "critic":
                        self.critic.load_actor_weights(settings.init_dir)  # the value head keeps its own init
                    else:
                        self.reference.load_weights(settings.init_dir)
        if self.critic is not None and settings.critic_init_from != "actor":
            with layout_scope(self.layouts["critic"]):
                self.critic.load_reward_model(settings.critic_init_from, untied)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def vocab_tp(tps: list[int]) -> int:
    """The TP size to pad the vocabulary for, given the roles' TP sizes: one padded vocabulary that splits into
    aligned shares at each of them, so every role's weights have the same shapes and move between the roles'
    layouts through a distributed checkpoint. It is the actor's own when every other role's TP divides the actor's."""
    return math.lcm(*tps)


def _shared_model_facts(model: ModelSource, tps: list[int]):
    """The model's facts for roles at TP sizes `tps` (see vocab_tp); from a checkpoint, the checkpoint decides
    whether DeepSeek's MTP layers are built."""
    if model.random_init:
        return model_facts(read_hf_config(model.path), vocab_tp(tps))
    facts = HFCheckpoint(model.path).facts(vocab_tp(tps))
    if torch.distributed.get_rank() == 0 and facts.mtp_off_note:
        print(f"{model.path}: {facts.mtp_off_note}", file=sys.stderr, flush=True)
    return facts
