"""Settings that would change nothing: a field the user set where the rest of the spec makes it meaningless.

A setting that does nothing is worse than a missing one (users tune it and plan around it), so a field written in
the YAML or on the command line is rejected when the spec it lands in never reads it: the KL coefficient without
the KL loss, the critic's optimizer without a critic, SGLang's memory fraction with the local engine. Only a value
the user wrote that differs from what the field would be without it counts: defaults, derived defaults (a
`ref.megatron` field equal to the actor's) and the fully resolved spec `rlm validate` prints all load back cleanly.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rlmegatron.config.errors import NO_VALUE, SpecProblem
from rlmegatron.config.spec import JobSpec
from rlmegatron.plugins import is_async_function, load_plugin


def explicit_paths(raw: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Every dotted path the raw spec writes, sections included ({"a": {"b": 1}} -> {"a", "a.b"})."""
    paths = set()
    for key, value in raw.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, Mapping):
            paths |= explicit_paths(value, f"{path}.")
    return paths


@dataclass(frozen=True)
class Rule:
    """`fields` (dotted paths; a trailing '.' covers a whole section) only matter when `applies(spec)`;
    `why(spec)` says why they don't here and what to do instead."""

    fields: tuple[str, ...]
    applies: Callable[[JobSpec], bool]
    why: Callable[[JobSpec], str]
    exempt: tuple[str, ...] = ()
    even_default_on_command_line: bool = False
    """Rejected when an override writes it, even to its default: a value typed on the command line is meant to take
    effect (verl's `trainer.total_epochs=1` is its default), while a resolved spec that holds every default in its
    YAML must still load."""


def _estimator_takes(option: str) -> Callable[[JobSpec], bool]:
    def applies(spec: JobSpec) -> bool:
        # The estimator's own signature says which options it reads, so a new or plug-in estimator needs no entry.
        from rlmegatron.algorithms.advantages import estimator_options

        try:
            return option in estimator_options(spec.algorithm.adv_estimator)
        except (LookupError, ValueError):  # an unknown name or a broken plug-in: checks.py reports that
            return True

    return applies


def _async_reward_on_one_loop(spec: JobSpec) -> bool:
    if spec.reward.num_workers > 0 or spec.reward.function is None:
        return False
    try:
        return is_async_function(load_plugin(spec.reward.function))
    except Exception:  # a broken plug-in: the plug-in checks report that
        return True


def _sglang_only(spec: JobSpec) -> str:
    return "only SGLang servers use it, and rollout.engine=local generates in every trainer rank; remove it"


def _dynamic_batching(switch: str, budget: str, count: str, packs: str = "micro-batches") -> tuple[Rule, Rule]:
    """With `switch` on, micro-batches are cut by the token `budget`, else by the sequence `count`: each matters in
    one of the two modes only."""

    def on(spec: JobSpec) -> bool:
        return bool(_value_at(spec, switch))

    return (Rule((budget,), on, lambda s: f"only applies with {switch}=true; remove it or turn dynamic batching on"),
            Rule((count,), lambda s: not on(s),
                 lambda s: f"{switch}=true packs {packs} by {budget} instead; remove it"))


RULES: tuple[Rule, ...] = (
    Rule(("ref.",), lambda s: s.needs_reference,
         lambda s: "the reference model is only built for a KL term (actor.use_kl_loss or "
                   "algorithm.use_kl_in_reward), and neither is on; remove it or turn one on"),
    Rule(("ref.megatron.use_distributed_optimizer", "ref.megatron.recompute_granularity",
          "ref.megatron.recompute_method", "ref.megatron.recompute_num_layers"), lambda s: False,
         lambda s: "the reference model never trains (no optimizer, no backward pass); remove it"),
    Rule(("teacher.",), lambda s: s.algorithm.distill is not None,
         lambda s: "the teacher only scores the student's tokens for on-policy distillation, and algorithm.distill is "
                   "not set; remove it or set algorithm.distill"),
    Rule(("algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo",
          "algorithm.use_kl_in_reward"),
         lambda s: s.algorithm.distill is None or not s.algorithm.distill.only,
         lambda s: "with algorithm.distill.only=true the advantage is the teacher's term alone: no estimator runs on "
                   "the reward; remove it or set algorithm.distill.only=false"),
    Rule(("teacher.megatron.use_distributed_optimizer", "teacher.megatron.recompute_granularity",
          "teacher.megatron.recompute_method", "teacher.megatron.recompute_num_layers"), lambda s: False,
         lambda s: "the teacher never trains (no optimizer, no backward pass); remove it"),
    Rule(("actor.mtp.detach",), lambda s: s.actor.mtp.loss_weight > 0,
         lambda s: "only applies while the MTP layers train (actor.mtp.loss_weight > 0); remove it or set a weight"),
    Rule(("actor.lora.alpha", "actor.lora.dropout", "actor.lora.target_modules", "actor.lora.weight_sync",
          "actor.lora.modules_to_save"),
         lambda s: s.actor.lora.rank > 0,
         lambda s: "only applies with LoRA (actor.lora.rank > 0); remove it or set a rank"),
    Rule(("ref.megatron.", "ref.offload."), lambda s: s.actor.lora.rank == 0,
         lambda s: "with LoRA (actor.lora.rank > 0) the reference is the actor with its adapters off, at the "
                   "actor's layout and in its memory; remove it"),
    Rule(("reward.model.",), lambda s: s.reward.model.path is not None,
         lambda s: "only applies with a reward model; remove it or set reward.model.path",
         exempt=("reward.model.path",)),
    Rule(("reward.model.weight", "reward.model.rule_weight"), lambda s: s.reward.model.combiner is None,
         lambda s: "reward.model.combiner computes the reward instead of the weighted sum; remove it"),
    Rule(("reward.function", "reward.num_workers", "reward.timeout_s", "reward.batch_timeout_s",
          "reward.max_timeout_fraction"),
         lambda s: s.rule_scores,
         lambda s: "the reward model scores alone (reward.model.rule_weight=0, no combiner), so no rule runs; "
                   "remove it or give the rule a weight"),
    Rule(("critic.",), lambda s: bool(s.critic.enable),
         lambda s: f"there is no critic: algorithm.adv_estimator={s.algorithm.adv_estimator} uses no value model; "
                   "remove it or use algorithm.adv_estimator=gae",
         exempt=("critic.enable",)),
    Rule(("actor.kl_loss_coef", "actor.kl_loss_type"), lambda s: s.actor.use_kl_loss,
         lambda s: "only applies with actor.use_kl_loss=true; remove it or turn the KL loss on"),
    Rule(("algorithm.kl_penalty", "algorithm.kl_ctrl."), lambda s: s.algorithm.use_kl_in_reward,
         lambda s: "only applies with algorithm.use_kl_in_reward=true; remove it or turn the in-reward KL on"),
    Rule(("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"),
         lambda s: s.algorithm.kl_ctrl.type == "adaptive",
         lambda s: "only the adaptive KL controller reads it; remove it or set algorithm.kl_ctrl.type=adaptive"),
    Rule(("algorithm.gamma",), _estimator_takes("gamma"),
         lambda s: f"algorithm.adv_estimator={s.algorithm.adv_estimator} does not discount rewards; remove it"),
    Rule(("algorithm.lam",), _estimator_takes("lam"),
         lambda s: f"algorithm.adv_estimator={s.algorithm.adv_estimator} has no GAE lambda; remove it"),
    Rule(("algorithm.norm_adv_by_std_in_grpo",), _estimator_takes("norm_adv_by_std"),
         lambda s: f"algorithm.adv_estimator={s.algorithm.adv_estimator} does not divide by a group std; remove it"),
    Rule(("reward.overlong_buffer.length", "reward.overlong_buffer.penalty_factor"),
         lambda s: s.reward.overlong_buffer.enable,
         lambda s: "only applies with reward.overlong_buffer.enable=true; remove it or enable the buffer"),
    Rule(("reward.async_concurrency",), _async_reward_on_one_loop,
         lambda s: "only bounds an `async def` reward function scored on one event loop (reward.num_workers=0), and "
                   + ("reward.num_workers>0 scores one sample at a time in each worker" if s.reward.num_workers else
                      f"reward.function={s.reward.function or 'null (the built-in rules)'} is not async")
                   + "; remove it"),
    Rule(("algorithm.dynamic_sampling.max_num_gen_batches",), lambda s: s.algorithm.dynamic_sampling.enable,
         lambda s: "only applies with algorithm.dynamic_sampling.enable=true; remove it or enable it"),
    Rule(("algorithm.rollout_correction.rollout_is_mode", "algorithm.rollout_correction.rollout_is_threshold"),
         lambda s: s.algorithm.rollout_correction.rollout_is is not None,
         lambda s: "only applies with importance weights; remove it or set algorithm.rollout_correction.rollout_is "
                   "(token or sequence)"),
    Rule(("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rollout_correction.rollout_rs_threshold_lower"),
         lambda s: s.algorithm.rollout_correction.rollout_rs is not None,
         lambda s: "only applies with rejection; remove it or set algorithm.rollout_correction.rollout_rs "
                   "(token, sequence or geometric)"),
    Rule(("trainer.max_staleness",), lambda s: s.trainer.mode == "async",
         lambda s: f"only bounds trainer.mode=async (trainer.mode={s.trainer.mode} lags "
                   f"{s.trainer.staleness_bound} weight versions); remove it or set trainer.mode=async"),
    Rule(("trainer.on_policy_check",), lambda s: s.trainer.mode == "sync",
         lambda s: f"trainer.mode={s.trainer.mode} samples with weights up to {s.trainer.staleness_bound} versions "
                   f"old by design, which the check would stop; remove it or set trainer.mode=sync"),
    Rule(("trainer.partial_rollout",), lambda s: s.trainer.mode != "sync",
         lambda s: "weights only arrive mid-generation when generation overlaps training; remove it or set "
                   "trainer.mode to one_step_off or async"),
    Rule(("trainer.total_epochs",), lambda s: s.trainer.total_steps is None,
         lambda s: f"trainer.total_steps={s.trainer.total_steps} is set and ends the run instead; remove it, or "
                   "remove trainer.total_steps (~trainer.total_steps on the command line) to train by epochs",
         even_default_on_command_line=True),
    Rule(("data.val_batch_size", "rollout.val_kwargs."), lambda s: bool(s.data.val_files),
         lambda s: "only applies to validation, and data.val_files is empty; remove it or add validation files"),
    Rule(("data.val_files",), lambda s: s.trainer.val_before_train or s.trainer.test_freq > 0,
         lambda s: "validation never runs (trainer.val_before_train=false, trainer.test_freq=-1); "
                   "remove it or set one of those"),
    Rule(("trainer.log_freq",), lambda s: "console" in s.tracking.backends,
         lambda s: "only the console backend prints metric tables; remove it or add console to tracking.backends"),
    Rule(("tracking.tracking_uri",), lambda s: "mlflow" in s.tracking.backends,
         lambda s: "only the mlflow backend uses it; remove it or add mlflow to tracking.backends"),
    Rule(("tracking.project_name",), lambda s: {"mlflow", "wandb"} & set(s.tracking.backends),
         lambda s: "only the mlflow and wandb backends use it; remove it or add one of them to tracking.backends"),
    Rule(("model.hf_config",), lambda s: s.model.architecture_source()[0] == "model.hf_config",
         lambda s: "model.path is a local directory, whose own config.json is read; remove it"),
    *_dynamic_batching("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu",
                       "actor.ppo_micro_batch_size_per_gpu"),
    *_dynamic_batching("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
                       "critic.ppo_micro_batch_size_per_gpu"),
    *_dynamic_batching("ref.log_prob_use_dynamic_bsz", "ref.log_prob_max_token_len_per_gpu",
                       "ref.log_prob_micro_batch_size_per_gpu"),
    # The old-log-prob pass batches like the actor's update; its budget rule is the actor's, above.
    _dynamic_batching("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu",
                      "rollout.log_prob_micro_batch_size_per_gpu", packs="the old-log-prob pass")[1],
    Rule(("rollout.seed",),
         lambda s: s.rollout.engine != "sglang"
         or bool(s.rollout.sglang.extra_args.get("enable-deterministic-inference")),
         lambda s: "SGLang samples by a request's seed only in deterministic-inference mode; remove it or set "
                   "rollout.sglang.extra_args.enable-deterministic-inference=true"),
    Rule(("actor.moe.routing_agreement",), lambda s: s.actor.moe.routing_replay != "r3",
         lambda s: "routing replay r3 measures the agreement anyway (its record is the rollout's routing); remove it"),
    Rule(("tracking.rollout_trace.prompts_per_step",), lambda s: s.tracking.rollout_trace.backend is not None,
         lambda s: "no samples are traced (tracking.rollout_trace.backend is null); remove it or set a backend"),
    Rule(("rollout.tensor_parallel_size", "rollout.expert_parallel_size", "rollout.enable_dp_attention",
          "rollout.mem_fraction_static", "rollout.num_gpus", "rollout.update_weights_bucket_mb", "rollout.sglang."),
         lambda s: s.rollout.engine == "sglang", _sglang_only,
         # The router fields have their own check (config/checks.py), which names the engine to use.
         exempt=("rollout.sglang.router", "rollout.sglang.router_url")),
    Rule(("placement.rollout_min_engines", "placement.rollout_max_engines", "rollout.autoscale"),
         lambda s: s.placement.mode == "disaggregate",
         lambda s: "only a rollout pool of its own (placement.mode=disaggregate) can grow or shrink; colocated "
                   "engines live in the trainer ranks; remove it or set placement.mode=disaggregate"),
    Rule(("rollout.full_sync_every",), lambda s: s.rollout.weight_sync == "delta",
         lambda s: "only delta weight sync has full pushes to space out (rollout.weight_sync is full); remove it or "
                   "set rollout.weight_sync=delta"),
    Rule(("rollout.multi_turn.",), lambda s: bool(s.rollout.multi_turn.tools),
         lambda s: "only multi-turn rollouts use it, and rollout.multi_turn.tools is empty; add the tools or remove it",
         exempt=("rollout.multi_turn.tools",)),
    Rule(("rollout.sglang.router_args",),
         lambda s: s.rollout.engine != "sglang" or (s.rollout.sglang.router and not s.rollout.sglang.router_url),
         lambda s: "only applies to a router rlm train starts (rollout.sglang.router=true without router_url); "
                   "remove it"),
)


def unused_settings(spec: JobSpec, raw: Mapping[str, Any], command_line: Collection[str] = ()) -> list[SpecProblem]:
    """One problem per field the raw spec sets, to a value of its own, that `spec` never reads (see RULES).
    `command_line`: the paths the overrides wrote (Rule.even_default_on_command_line)."""
    written = explicit_paths(raw)
    problems = []
    for rule in RULES:
        matched = sorted(path for path in written if _covered(path, rule) and not _has_child(path, written))
        if matched and not rule.applies(spec):
            problems += [SpecProblem(path, _value_at(spec, path), _on_the_command_line(rule.why(spec), path))
                         for path in matched if _value_at(spec, path) != _value_without(raw, path)
                         or (rule.even_default_on_command_line and path in command_line)]
    return problems


def _on_the_command_line(why: str, path: str) -> str:
    """`why`, saying how to remove the field without editing the YAML where it tells the user to remove it."""
    return why.replace("remove it", f"remove it (~{path} on the command line)", 1)


def _value_without(raw: Mapping[str, Any], path: str) -> Any:
    """What the field at `path` resolves to when the raw spec does not set it."""
    *sections, key = path.split(".")
    stripped = copy.deepcopy(dict(raw))
    node = stripped
    for section in sections:
        node = node[section]
    del node[key]
    try:
        return _value_at(JobSpec.model_validate(stripped), path)
    except ValueError:
        return NO_VALUE


def _covered(path: str, rule: Rule) -> bool:
    if any(path == e or path.startswith(e + ".") for e in rule.exempt):
        return False
    return any(path.startswith(f) if f.endswith(".") else path == f or path.startswith(f + ".") for f in rule.fields)


def _has_child(path: str, written: set[str]) -> bool:
    """A section the user wrote keys under: report the keys, not the section."""
    return any(other.startswith(path + ".") for other in written)


def _value_at(spec: JobSpec, path: str) -> Any:
    node: Any = spec
    for key in path.split("."):
        node = node.get(key, NO_VALUE) if isinstance(node, dict) else getattr(node, key, NO_VALUE)
        if node is NO_VALUE:
            return NO_VALUE
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node
