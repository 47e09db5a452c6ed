"""Rank-side body of the train -> export -> local-engine test: a Megatron actor built from an HF checkpoint."""
from __future__ import annotations

import torch

from rlmegatron.runtime import ParallelLayout, init_model_parallel

PROMPT_LEN, RESPONSE_LEN = 5, 6


def _actor_from_hf(hf_dir: str, layout: ParallelLayout):
    from rlmegatron.models.convert import HFCheckpoint, load_hf_weights
    from rlmegatron.models.hf_config import build_gpt_model, model_facts, transformer_config
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.rank.roles import ActorSettings, ActorWorker, OptimizerSettings
    from rlmegatron.rank.roles.megatron_step import unwrap

    init_model_parallel(layout)
    checkpoint = HFCheckpoint(hf_dir)
    facts = model_facts(checkpoint.config, layout.tp)
    weight_map = WeightMap(facts, stacked_experts=checkpoint.stacked_experts)
    config = transformer_config(facts, layout)
    settings = ActorSettings(ppo_mini_batch_size=4, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-2),
                             vocab_size=facts.vocab_size)
    actor = ActorWorker(settings, lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
    actor.init(parallel_state_ready=True)
    load_hf_weights([unwrap(chunk) for chunk in actor.chunks], weight_map, checkpoint)
    checkpoint.close()
    return actor, weight_map


def _rollout_batch(prompts: torch.Tensor, results):
    """Prompts and the engine's samples as the actor's batch: left-padded prompt, right-padded response."""
    from rlmegatron.rank.roles import RolloutBatch

    n = len(results)
    input_ids = torch.zeros(n, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(n, RESPONSE_LEN)
    engine_log_probs = torch.zeros(n, RESPONSE_LEN)
    for row, result in enumerate(results):
        out = torch.tensor(result.output_token_ids)
        input_ids[row, :PROMPT_LEN] = prompts[result.request_index]
        input_ids[row, PROMPT_LEN : PROMPT_LEN + len(out)] = out
        attention_mask[row, : PROMPT_LEN + len(out)] = 1
        response_mask[row, : len(out)] = 1
        engine_log_probs[row, : len(out)] = torch.tensor(result.output_token_logprobs)
    return RolloutBatch(input_ids, attention_mask, response_mask), engine_log_probs


def train_sync_generate_job(hf_dir: str, layouts: list[ParallelLayout]) -> dict:
    """Per layout: two PPO updates, export into a local engine, then the engine's samples scored by the actor. The
    exporter is made before the updates, as a trainer rank makes it once for every sync: its plan holds."""
    from transformers import AutoModelForCausalLM

    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
    from rlmegatron.rollout.local import LocalEngine, checkpoint_named_weights

    engine = LocalEngine(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))
    vocab = engine.model.config.vocab_size
    prompts = torch.randint(1, vocab, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    sampling = SamplingSpec(n=2, temperature=1.0, max_new_tokens=RESPONSE_LEN, seed=11)
    report = {}
    for layout in layouts:
        actor, weight_map = _actor_from_hf(hf_dir, layout)
        exporter = HFWeightExporter(actor.chunks, weight_map)
        results = engine.generate([GenerationRequest(tuple(p.tolist()), sampling) for p in prompts])
        batch, _ = _rollout_batch(prompts, results)
        for _ in range(2):
            log_probs, _ = actor.compute_log_prob(batch, with_entropy=False)
            batch.old_log_probs = log_probs
            batch.advantages = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask
            actor.update(batch)

        streamed = dict(exporter.stream())
        engine.update_weights(iter(streamed.items()), version=str(layout))
        engine_state = checkpoint_named_weights(engine.model)
        results = engine.generate([GenerationRequest(tuple(p.tolist()), sampling) for p in prompts])
        batch, engine_log_probs = _rollout_batch(prompts, results)
        actor_log_probs, _ = actor.compute_log_prob(batch, with_entropy=False)
        report[str(layout)] = {
            "not_bitwise": sorted(k for k, v in streamed.items() if not torch.equal(engine_state[k], v)),
            "pushed": len(streamed),
            "changed_by_training": sum(
                not torch.equal(v, w) for (k, v), w in zip(streamed.items(), _initial(hf_dir, streamed))
            ),
            "log_prob_max_diff": float(((actor_log_probs - engine_log_probs) * batch.response_mask).abs().max()),
            "response_tokens": int(batch.response_mask.sum()),
        }
    return report


def _initial(hf_dir: str, names) -> list[torch.Tensor]:
    from safetensors import safe_open
    import os

    files = [os.path.join(hf_dir, f) for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    found = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            for key in handle.keys():
                if key in names:
                    found[key] = handle.get_tensor(key)
    return [found[k] for k in names]
