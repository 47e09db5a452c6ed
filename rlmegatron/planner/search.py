"""`rlm plan --search`: the layouts a spec's cluster can run, ranked by the step-time model, as override lines.

The cluster is the spec's placement: its GPUs (the trainer's, and the rollout pool's when disaggregated) may be
split again. What varies: the actor's TP/PP/VPP/CP/EP/ETP, recompute and offload, colocated or disaggregated with
the rollout:trainer split, and the engine's TP. A field the command line sets is held fixed.

Pruned in three stages so a 671B model on 64 nodes takes seconds, not a brute force over every combination:
1. per trainer world size, every trainer layout whose sizes divide the model and the GPUs is priced by
   memory.training_memory (a few microseconds) and, if it fits the GPU, by step_time.training_seconds; the fastest
   few are kept;
2. per rollout pool, every engine TP whose weights leave a KV cache is priced by step_time.generation_seconds; the
   fastest few are kept;
3. each pairing becomes a spec through the loader (every check `rlm validate` runs) and a whole plan (every memory
   phase against the GPU); those with no problem are ranked by the plan's predicted step time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from rlmegatron.config.errors import SpecError
from rlmegatron.config.spec import JobSpec, OffloadConfig
from rlmegatron.models.families import ModelArchitecture, built_mtp_layers
from rlmegatron.models.pipeline import PipelineSplitError
from rlmegatron.planner.memory import GB, engine_memory, micro_batch, rollout_weight_bytes, training_memory
from rlmegatron.planner.parameters import ParameterCount, count_parameters
from rlmegatron.planner.plan import PlanSettings, build_plan
from rlmegatron.planner.step_time import StepTime, generation_seconds, running_cap, training_phases, workload_of
from rlmegatron.prelaunch.spec_pipeline import SPEC_STAGES, SpecSource, check_job

KEEP_TRAINER_LAYOUTS = 6
KEEP_ENGINE_LAYOUTS = 3
MEGATRON = "actor.megatron."
SEARCHED = (MEGATRON + "tensor_model_parallel_size", MEGATRON + "pipeline_model_parallel_size",
            MEGATRON + "virtual_pipeline_model_parallel_size", MEGATRON + "context_parallel_size",
            MEGATRON + "expert_model_parallel_size", MEGATRON + "expert_tensor_parallel_size",
            MEGATRON + "recompute_granularity", "actor.offload.params", "actor.offload.grads",
            "actor.offload.optimizer", "placement.mode", "rollout.tensor_parallel_size")


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]
    step_time: StepTime
    peak_gb: float


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]  # fastest first
    trainer_layouts: int  # priced in stage 1
    engine_layouts: int
    specs_checked: int
    specs_rejected: int  # by the spec checks or the plan's memory phases


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** k for k in range(limit.bit_length()) if 2 ** k <= limit]


def _fixed(overrides: Sequence[str]) -> set[str]:
    return {item.split("=", 1)[0].lstrip("~") for item in overrides}


def freed(raw: Any, overrides: Sequence[str]) -> list[str]:
    """`~key` for each field the search chooses that the YAML `raw` sets and the command line leaves alone: the YAML's
    layout is what the search replaces, so it is not checked (a PP=16 recipe on a node of 8 GPUs is searched too)."""
    fixed = _fixed(overrides)
    # Sequence parallelism follows TP (each layout sets it): freed with it, kept where the command line sets TP.
    follows_tp = () if MEGATRON + "tensor_model_parallel_size" in fixed else (MEGATRON + "sequence_parallel",)
    removals = []
    for key in (*SEARCHED, *follows_tp, "rollout.expert_parallel_size", FIRST_STAGE):
        node = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and key not in fixed:
            removals.append(f"~{key}")
    return removals


def _placements(spec: JobSpec, fixed: set[str]) -> Iterator[tuple[str, int, int, int, int]]:
    """(mode, trainer nodes, trainer GPUs per node, rollout nodes, rollout GPUs per node) over the same GPUs."""
    placement = spec.placement
    per_node = placement.gpus_per_node
    nodes = placement.nnodes + (placement.rollout_nnodes or 0 if placement.mode == "disaggregate" else 0)
    modes = [placement.mode] if "placement.mode" in fixed else ["colocate", "disaggregate"]
    if "colocate" in modes:
        yield "colocate", nodes, per_node, 0, 0
    if "disaggregate" in modes:
        if nodes > 1:  # whole nodes: an eighth to seven eighths of them generate
            for rollout in sorted({max(1, min(nodes - 1, round(nodes * k / 8))) for k in range(1, 8)}):
                yield "disaggregate", nodes - rollout, per_node, rollout, per_node
        else:
            for rollout in _powers_of_two(per_node // 2):
                yield "disaggregate", 1, per_node - rollout, 1, rollout


def _trainer_layouts(spec: JobSpec, arch: ModelArchitecture, world: int, per_node: int, colocated: bool,
                     fixed: set[str]) -> Iterator[dict[str, Any]]:
    actor = spec.actor.megatron

    def choices(field: str, values: list) -> list:
        return [getattr(actor, field)] if MEGATRON + field in fixed else values

    offloads = [(True, True, True), (True, True, False), (False, False, False)] if colocated \
        else [(False, False, True), (False, False, False)]
    if {"actor.offload.params", "actor.offload.grads", "actor.offload.optimizer"} & fixed:
        offload = spec.actor.offload
        offloads = [(offload.params, offload.grads, offload.optimizer)]
    layers = arch.num_hidden_layers
    for tp, pp, cp, ep, recompute, offload in itertools.product(
            choices("tensor_model_parallel_size", _powers_of_two(per_node)),
            choices("pipeline_model_parallel_size", _powers_of_two(min(world, layers))),
            choices("context_parallel_size", [1, 2]),
            choices("expert_model_parallel_size", _powers_of_two(min(world, arch.num_experts)) if arch.is_moe
                    else [1]),
            choices("recompute_granularity", ["none", "selective", "full"]), offloads):
        if world % (tp * pp * cp) or arch.num_attention_heads % tp or (arch.is_moe and arch.num_experts % ep):
            continue
        if (world // pp) % ep:
            continue
        for vpp in choices("virtual_pipeline_model_parallel_size",
                           [None] + ([2] if pp > 1 and layers % (pp * 2) == 0 else [])):
            for etp in choices("expert_tensor_parallel_size", sorted({1, tp}) if arch.is_moe else [None]):
                if etp and (world // pp) % (ep * etp):
                    continue
                yield {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                       "virtual_pipeline_model_parallel_size": vpp, "context_parallel_size": cp,
                       "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
                       "recompute_granularity": recompute, "sequence_parallel": tp > 1, "offload": offload}


FIRST_STAGE = MEGATRON + "extra.num_layers_in_first_pipeline_stage"


def _first_stage_layers(layers: int, pp: int) -> int | None:
    """Layers that do not split evenly: the first stage takes fewer (it also holds the embedding)."""
    return layers - (pp - 1) * -(-layers // pp) if pp > 1 and layers % pp else None


def _current(spec: JobSpec, dotted: str) -> Any:
    value: Any = spec
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    return value


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _layout_overrides(spec: JobSpec, layout: dict[str, Any], arch: ModelArchitecture) -> list[str]:
    """The overrides that turn the spec's layout into `layout`: only what differs (`~key` drops a setting)."""
    params, grads, optimizer = layout["offload"]
    wanted = {**{MEGATRON + key: value for key, value in layout.items() if key != "offload"},
              "actor.offload.params": params, "actor.offload.grads": grads, "actor.offload.optimizer": optimizer}
    wanted[FIRST_STAGE] = _first_stage_layers(arch.num_hidden_layers, layout["pipeline_model_parallel_size"])
    overrides = []
    for key, value in wanted.items():
        current = _current(spec, key)
        if value is None and current is not None:
            overrides.append(f"~{key}")
        elif value is not None and _text(value) != _text(current):
            overrides.append(f"{key}={_text(value)}")
    return overrides


def _price_trainer(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount, world: int, layout: dict,
                   settings: PlanSettings, work) -> float | None:
    """Training seconds of the step at this layout, or None when its memory estimate exceeds the GPU."""
    offload = OffloadConfig(params=layout["offload"][0], grads=layout["offload"][1], optimizer=layout["offload"][2])
    extra = {k: v for k, v in spec.actor.megatron.extra.items() if k != FIRST_STAGE.removeprefix(MEGATRON + "extra.")}
    first = _first_stage_layers(arch.num_hidden_layers, layout["pipeline_model_parallel_size"])
    if first is not None:
        extra[FIRST_STAGE.removeprefix(MEGATRON + "extra.")] = first
    megatron = spec.actor.megatron.model_copy(update={**{k: v for k, v in layout.items() if k != "offload"},
                                                      "extra": extra})
    # training_memory reads the trainer's world size from the placement: one with `world` trainer GPUs (their split
    # into nodes does not change the memory).
    sized = spec.model_copy(update={"placement": spec.placement.model_copy(update={"nnodes": 1,
                                                                                   "gpus_per_node": world})})
    batch = micro_batch(sized, spec.actor.ppo_micro_batch_size_per_gpu, spec.actor.use_dynamic_bsz,
                        spec.actor.ppo_max_token_len_per_gpu, megatron)
    memory = training_memory(sized, arch, params, megatron, offload, batch,
                             mtp_runs=spec.actor.mtp.loss_weight > 0)
    if memory.total > settings.gpu_mem_gb * GB:
        return None
    # The reference follows the actor's layout here, as the spec's unset ref.megatron fields do.
    phases = training_phases(spec, arch, params, megatron, megatron, world, work,
                             settings.hardware(spec.placement.gpus_per_node))
    return sum(phases.values())


def search(raw: dict[str, Any], overrides: Sequence[str], spec: JobSpec, arch: ModelArchitecture,
           settings: PlanSettings, file: str, top: int = 5) -> SearchResult:
    """`raw`, `overrides`: the spec's YAML and the command line's, to which each candidate's overrides are added.
    `spec`: theirs with the fields `freed` removes at their defaults; a candidate removes those it does not set."""
    fixed = _fixed(overrides)
    removals = freed(raw, overrides)
    params = count_parameters(arch, built_mtp_layers(arch, spec.model.path, spec.model.random_init))
    work = workload_of(spec, settings.prompt_tokens, settings.response_tokens)
    hw = settings.hardware(spec.placement.gpus_per_node)
    priced_trainers, priced_engines, checked, rejected = {}, {}, 0, 0
    candidates: list[Candidate] = []
    for mode, nodes, per_node, rollout_nodes, rollout_per_node in _placements(spec, fixed):
        world = nodes * per_node
        if world not in priced_trainers:
            priced = []
            for layout in _trainer_layouts(spec, arch, world, per_node, mode == "colocate", fixed):
                try:
                    seconds = _price_trainer(spec, arch, params, world, layout, settings, work)
                except PipelineSplitError:  # the stages cannot take these layers (virtual stages, say)
                    continue
                if seconds is not None:
                    priced.append((seconds, layout))
            priced_trainers[world] = sorted(priced, key=lambda item: item[0])
        rollout_gpus = world if mode == "colocate" else rollout_nodes * rollout_per_node
        if rollout_gpus not in priced_engines:
            engines = []
            tps = [spec.rollout.tensor_parallel_size] if "rollout.tensor_parallel_size" in fixed \
                else _powers_of_two(rollout_gpus)
            for tp in tps:
                sized = spec.model_copy(update={"rollout": spec.rollout.model_copy(
                    update={"tensor_parallel_size": tp})})
                engine = engine_memory(sized, arch, params, settings.gpu_mem_gb * GB)
                if engine.kv_tokens <= 0 or rollout_gpus % tp:
                    continue
                engines.append((generation_seconds(arch, params, engine, rollout_gpus // tp, tp, work,
                                                   rollout_weight_bytes(spec, params) / params.total, hw,
                                                   drafts=spec.rollout.speculative.num_draft_tokens
                                                   if spec.rollout.speculative is not None else 0,
                                                   max_running=running_cap(spec)), tp))
            priced_engines[rollout_gpus] = sorted(engines)
        placement = [f"placement.mode={mode}", f"placement.nnodes={nodes}", f"placement.gpus_per_node={per_node}"]
        if mode == "disaggregate":
            placement += [f"placement.rollout_nnodes={rollout_nodes}",
                          f"placement.rollout_gpus_per_node={rollout_per_node}"]
        for (_, layout), (_, engine_tp) in itertools.product(priced_trainers[world][:KEEP_TRAINER_LAYOUTS],
                                                              priced_engines[rollout_gpus][:KEEP_ENGINE_LAYOUTS]):
            engine = [f"rollout.tensor_parallel_size={engine_tp}"]
            if arch.is_moe and "rollout.expert_parallel_size" not in fixed:
                engine.append(f"rollout.expert_parallel_size={engine_tp if arch.num_experts % engine_tp == 0 else 1}")
            chosen = [item for item in [*placement, *engine]
                      if _text(_current(spec, item.split("=", 1)[0])) != item.split("=", 1)[1]]
            chosen = [item for item in [*chosen, *_layout_overrides(spec, layout, arch)]
                      if item.split("=", 1)[0].lstrip("~") not in fixed]
            chosen += [removal for removal in removals if removal[1:] not in _fixed(chosen)]
            checked += 1
            try:
                candidate_spec = check_job(SpecSource(file, (*overrides, *chosen), raw=raw), SPEC_STAGES).spec
            except SpecError:
                rejected += 1
                continue
            plan = build_plan(candidate_spec, arch, settings, file)
            if plan.problems:
                rejected += 1
                continue
            candidates.append(Candidate(tuple(chosen), plan.step_time, plan.peak_bytes / GB))
    candidates.sort(key=lambda candidate: candidate.step_time.total)
    return SearchResult(tuple(candidates[:top]), sum(len(v) for v in priced_trainers.values()),
                        sum(len(v) for v in priced_engines.values()), checked, rejected)
