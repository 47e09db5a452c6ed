"""Cross-field checks: each fires with the exact field, value and fix; valid layouts pass untouched.

The minimal spec is the tiny Qwen3 (4 heads, 2 KV heads, 4 layers, max 512 positions) on
8 CPU ranks, 16 prompts per step, mini-batches of 8, 4 responses per prompt, micro-batches of 2.
"""
import json

import pytest

from rlmegatron.config import JobSpec, check_spec
from rlmegatron.config.checks import GROUP_ESTIMATORS
from tests.config.specs import MODELS_DIR, REPO_ROOT, minimal_spec, problems_of, problems_with
from tests.helpers.remote_code import write_remote_code_model

RANKS = "the 8 trainer CPU ranks (placement.nnodes × placement.gpus_per_node)"
QWEN25 = {"model.path": "Qwen/Qwen2.5-0.5B", "model.hf_config": str(MODELS_DIR / "qwen2.5-0.5b")}
DEEPSEEK = {"model.path": "deepseek-ai/DeepSeek-V3", "model.hf_config": str(MODELS_DIR / "deepseek-v3")}
QWEN35 = {"model.path": "Qwen/Qwen3.5-397B-A17B", "model.hf_config": str(MODELS_DIR / "qwen3.5-397b-a17b")}
PLUGINS = REPO_ROOT / "tests" / "config" / "algorithm_plugins.py"
# 24 ranks so that sizes like 3 fit the cluster and only the model can reject them.
RANKS_24 = {"placement.nnodes": 3, "data.train_batch_size": 24, "actor.ppo_mini_batch_size": 24}

CASES = [
    pytest.param(
        {"actor.megatron.tensor_model_parallel_size": 3},
        "tiny-qwen3",
        f"job.yaml: actor.megatron.tensor_model_parallel_size=3: does not divide {RANKS}; use 1, 2, 4 or 8",
        id="tp-divides-world",
    ),
    pytest.param(
        {"actor.megatron.tensor_model_parallel_size": 4, "actor.megatron.pipeline_model_parallel_size": 4},
        "tiny-qwen3",
        "job.yaml: actor.megatron={tensor_model_parallel_size: 4, pipeline_model_parallel_size: 4, "
        f"context_parallel_size: 1}}: their product 16 does not divide {RANKS}; lower one of them until it does",
        id="tp-pp-cp-divides-world",
    ),
    pytest.param(
        {
            "actor.megatron.expert_model_parallel_size": 8,
            "actor.megatron.tensor_model_parallel_size": 2,
            "actor.megatron.sequence_parallel": True,
        },
        "tiny-qwen3-moe",
        "job.yaml: actor.megatron={expert_model_parallel_size: 8, expert_tensor_parallel_size: 2, "
        f"pipeline_model_parallel_size: 1}}: their product 16 does not divide {RANKS}; lower one of them until it does",
        id="ep-etp-pp-divides-world",
    ),
    pytest.param(
        {**QWEN25, "actor.megatron.tensor_model_parallel_size": 4},
        "tiny-qwen3",
        "job.yaml: actor.megatron.tensor_model_parallel_size=4: does not divide the model's 14 attention heads; "
        "use 1 or 2",
        id="tp-divides-heads",
    ),
    pytest.param(
        {**RANKS_24, "actor.megatron.expert_model_parallel_size": 3},
        "tiny-qwen3-moe",
        "job.yaml: actor.megatron.expert_model_parallel_size=3: does not divide the 8 experts; use 1, 2, 4 or 8",
        id="ep-divides-experts",
    ),
    pytest.param(
        {"actor.megatron.expert_model_parallel_size": 2},
        "tiny-qwen3",
        "job.yaml: actor.megatron.expert_model_parallel_size=2: the model is dense "
        "(its config.json declares no routed experts); use 1",
        id="ep-on-dense-model",
    ),
    pytest.param(
        {**RANKS_24, "actor.megatron.expert_tensor_parallel_size": 3},
        "tiny-qwen3-moe",
        "job.yaml: actor.megatron.expert_tensor_parallel_size=3: does not divide the experts' hidden size 32; "
        "use 1, 2, 4 or 8",
        id="etp-divides-expert-ffn",
    ),
    pytest.param(
        {"placement.gpus_per_node": 6, "actor.megatron.pipeline_model_parallel_size": 3},
        "tiny-qwen3",
        "job.yaml: actor.megatron.pipeline_model_parallel_size=3: does not divide the model's 4 layers; use 1 or 2, "
        "or split unevenly with extra.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage",
        id="pp-divides-layers",
    ),
    pytest.param(
        {
            "actor.megatron.pipeline_model_parallel_size": 2,
            "actor.megatron.virtual_pipeline_model_parallel_size": 4,
        },
        "tiny-qwen3",
        "job.yaml: actor.megatron.virtual_pipeline_model_parallel_size=4: does not divide the layers of each "
        "pipeline stage (2); use 1 or 2",
        id="pp-vpp-divides-layers",
    ),
    pytest.param(
        {"actor.megatron.virtual_pipeline_model_parallel_size": 2},
        "tiny-qwen3",
        "job.yaml: actor.megatron.virtual_pipeline_model_parallel_size=2: needs pipeline_model_parallel_size > 1; "
        "remove it or raise the pipeline size",
        id="vpp-needs-pp",
    ),
    pytest.param(
        {"model.path": "openai/gpt-oss-120b", "model.hf_config": str(MODELS_DIR / "gpt-oss-120b"),
         "actor.megatron.tensor_model_parallel_size": 2, "actor.megatron.sequence_parallel": True,
         "actor.megatron.expert_model_parallel_size": 4},
        "tiny-qwen3",
        "job.yaml: actor.megatron.expert_tensor_parallel_size=2: the experts have biases, which Megatron-Core supports "
        "at expert tensor parallelism 1 only (it follows tensor_model_parallel_size when unset); set it to 1",
        id="biased-experts-at-etp-1",
    ),
    pytest.param(
        {"model.path": "MiniMaxAI/MiniMax-M2", "model.hf_config": str(MODELS_DIR / "minimax-m2"),
         "placement.nnodes": 2, "actor.megatron.tensor_model_parallel_size": 16,
         "actor.megatron.sequence_parallel": True},
        "tiny-qwen3",
        "job.yaml: actor.megatron.tensor_model_parallel_size=16: is more than the model's 8 key/value heads, which its "
        "query/key norms over all heads need whole on each rank; use 1, 2, 4 or 8",
        id="all-heads-norms-within-the-key-heads",
    ),
    pytest.param(
        {"model.path": "deepseek-ai/DeepSeek-V3.2", "model.hf_config": str(MODELS_DIR / "deepseek-v3.2"),
         "actor.megatron.context_parallel_size": 2, "actor.megatron.expert_model_parallel_size": 4},
        "tiny-qwen3",
        "job.yaml: actor.megatron.context_parallel_size=2: DeepSeek Sparse Attention's indexer scores whole "
        "sequences, which Megatron-Core gives it without context parallelism only; use 1",
        id="sparse-attention-without-cp",
    ),
    pytest.param(
        {**QWEN35, "placement.nnodes": 4, "actor.megatron.tensor_model_parallel_size": 32,
         "actor.megatron.sequence_parallel": True, "actor.megatron.expert_model_parallel_size": 1},
        "tiny-qwen3",
        "job.yaml: actor.megatron.tensor_model_parallel_size=32: does not divide the model's 16 linear-attention key "
        "heads, which Gated DeltaNet splits whole over TP ranks; use 1, 2, 4, 8 or 16",
        id="gated-deltanet-key-heads-whole-per-tp-rank",
    ),
    pytest.param(
        {**QWEN35, "actor.megatron.context_parallel_size": 2, "actor.megatron.expert_model_parallel_size": 4},
        "tiny-qwen3",
        "job.yaml: actor.megatron.context_parallel_size=2: Gated DeltaNet's recurrence runs over whole sequences, which "
        "context parallelism splits over ranks; use 1",
        id="gated-deltanet-without-cp",
    ),
    pytest.param(
        {**QWEN35, "actor.lora.rank": 8, "actor.megatron.expert_model_parallel_size": 8},
        "tiny-qwen3",
        "job.yaml: actor.lora.rank=8: LoRA adapts Megatron's attention and MLP linears; this model's Gated DeltaNet "
        "layers (models/gated_delta_net.py) have no adapters, so their mixers would stay frozen; use 0",
        id="no-lora-on-gated-deltanet",
    ),
    pytest.param(
        {**QWEN35, "rollout.quantization": "fp8", "actor.megatron.expert_model_parallel_size": 8},
        "tiny-qwen3",
        "job.yaml: rollout.quantization=fp8: FP8 rollout is not bridged for a model with Gated DeltaNet layers "
        "(Qwen3-Next, Qwen3.5); use rollout.quantization=none",
        id="no-fp8-rollout-with-gated-deltanet",
    ),
    pytest.param(
        {**DEEPSEEK, "actor.megatron.pipeline_model_parallel_size": 4, "actor.megatron.expert_model_parallel_size": 2},
        "tiny-qwen3",
        "job.yaml: actor.megatron.pipeline_model_parallel_size=4: does not divide the model's 61 layers; use 1, "
        "or split unevenly with extra.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage",
        id="pp-on-61-layers",
    ),
    pytest.param(
        {
            **DEEPSEEK,
            "actor.megatron.pipeline_model_parallel_size": 4,
            "actor.megatron.expert_model_parallel_size": 2,
            "actor.megatron.extra": {"num_layers_in_first_pipeline_stage": 10, "num_layers_in_last_pipeline_stage": 10},
        },
        "tiny-qwen3",
        "job.yaml: actor.megatron.pipeline_model_parallel_size=4: leaves 41 layers for 2 middle stages after "
        "extra.num_layers_in_first/last_pipeline_stage; they must split evenly",
        id="uneven-pp-middle-stages",
    ),
    pytest.param(
        {"actor.megatron.extra": {"num_layers_in_first_pipeline_stage": 1}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.num_layers_in_first_pipeline_stage=1: sizes a pipeline stage, so it needs "
        "pipeline_model_parallel_size > 1; remove it or raise the pipeline size",
        id="uneven-pp-needs-pp",
    ),
    pytest.param(
        {"actor.megatron.extra": {"hidden_dropot": 0.1}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.hidden_dropot=0.1: is not a field of Megatron-Core's TransformerConfig; "
        "did you mean 'hidden_dropout'?",
        id="extra-unknown-key",
    ),
    pytest.param(
        {**DEEPSEEK, "actor.megatron.extra": {"q_lora_rnk": 8}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.q_lora_rnk=8: is not a field of Megatron-Core's MLATransformerConfig; "
        "did you mean 'q_lora_rank'? That one comes from the model's config.json (model.path / model.hf_config)",
        id="extra-unknown-key-near-a-reserved-one",
    ),
    pytest.param(
        {"actor.megatron.extra": {"hidden_size": 128}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.hidden_size=128: comes from the model's config.json "
        "(model.path / model.hf_config)",
        id="extra-model-field",
    ),
    pytest.param(
        {"actor.megatron.extra": {"tensor_model_parallel_size": 2}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.tensor_model_parallel_size=2: is set from "
        "actor.megatron.tensor_model_parallel_size; set that instead",
        id="extra-layout-field",
    ),
    pytest.param(
        {"actor.megatron.extra": {"bf16": True}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.bf16=true: is set from model.dtype; set that instead",
        id="extra-dtype-field",
    ),
    pytest.param(
        {"actor.megatron.extra": {"account_for_loss_in_pipeline_split": True}},
        "tiny-qwen3",
        "job.yaml: actor.megatron.extra.account_for_loss_in_pipeline_split=true: is not supported; use "
        "actor.megatron.extra.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for lighter "
        "end stages",
        id="extra-other-pipeline-split",
    ),
    pytest.param(
        {"actor.megatron.recompute_method": "block"},
        "tiny-qwen3",
        "job.yaml: actor.megatron.recompute_method=block: picks the layers of full recompute, but "
        "recompute_granularity=none; remove it or set recompute_granularity=full",
        id="recompute-method-needs-full",
    ),
    pytest.param(
        {"actor.megatron.recompute_granularity": "selective", "actor.megatron.recompute_num_layers": 2},
        "tiny-qwen3",
        "job.yaml: actor.megatron.recompute_num_layers=2: picks the layers of full recompute, but "
        "recompute_granularity=selective; remove it or set recompute_granularity=full",
        id="recompute-layers-need-full",
    ),
    pytest.param(
        {"trainer.total_steps": 5, "actor.optim.lr_warmup_steps": 5},
        "tiny-qwen3",
        "job.yaml: actor.optim.lr_warmup_steps=5: must be below the run's 5 steps (trainer.total_steps); lower it",
        id="warmup-below-total-steps",
    ),
    pytest.param(
        {"actor.megatron.tensor_model_parallel_size": 2},
        "tiny-qwen3-moe",
        "job.yaml: actor.megatron.sequence_parallel=false: MoE layers at tensor_model_parallel_size=2 need "
        "sequence parallelism; set it to true",
        id="moe-tp-needs-sp",
    ),
    pytest.param(
        {"actor.megatron.sequence_parallel": True},
        "tiny-qwen3",
        "job.yaml: actor.megatron.sequence_parallel=true: needs tensor_model_parallel_size > 1 "
        "(Megatron refuses it at TP=1); set it to false",
        id="sp-needs-tp",
    ),
    pytest.param(
        {"actor.megatron.context_parallel_size": 3},
        "tiny-qwen3",
        f"job.yaml: actor.megatron.context_parallel_size=3: does not divide {RANKS}; use 1, 2, 4 or 8",
        id="cp-divides-the-ranks",
    ),
    pytest.param(
        {"actor.use_kl_loss": True, "ref.megatron.tensor_model_parallel_size": 3},
        "tiny-qwen3",
        f"job.yaml: ref.megatron.tensor_model_parallel_size=3: does not divide {RANKS}; use 1, 2, 4 or 8",
        id="ref-layout-checked-when-used",
    ),
    pytest.param(
        {"actor.ppo_mini_batch_size": 5},
        "tiny-qwen3",
        "job.yaml: actor.ppo_mini_batch_size=5: does not divide data.train_batch_size=16; use 1, 2, 4, 8 or 16",
        id="mini-batch-divides-train-batch",
    ),
    pytest.param(
        {"actor.ppo_mini_batch_size": 1, "rollout.n": 2},
        "tiny-qwen3",
        "job.yaml: actor.ppo_mini_batch_size=1: makes 2 sequences (× rollout.n=2), which do not split evenly "
        "over 8 data-parallel ranks; use a multiple of 4",
        id="mini-batch-splits-over-dp",
    ),
    pytest.param(
        {"actor.ppo_micro_batch_size_per_gpu": 3},
        "tiny-qwen3",
        "job.yaml: actor.ppo_micro_batch_size_per_gpu=3: does not divide the 4 sequences each of 8 data-parallel "
        "ranks gets per mini-batch (actor.ppo_mini_batch_size=8 × rollout.n=4 / 8); use 1, 2 or 4",
        id="micro-batch-divides-rank-share",
    ),
    pytest.param(
        {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 100},
        "tiny-qwen3",
        "job.yaml: actor.ppo_max_token_len_per_gpu=100: is below one full sequence "
        "(data.max_prompt_length + data.max_response_length = 128); use at least 128",
        id="dynamic-token-budget",
    ),
    pytest.param(
        {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 60, "actor.megatron.context_parallel_size": 2},
        "tiny-qwen3",
        "job.yaml: actor.ppo_max_token_len_per_gpu=60: is below one full sequence "
        "(data.max_prompt_length + data.max_response_length = 128, of which each of the "
        "actor.megatron.context_parallel_size=2 ranks holds 1/2); use at least 64",
        id="dynamic-token-budget-per-context-parallel-rank",
    ),
    pytest.param(
        {"actor.use_kl_loss": True, "ref.log_prob_use_dynamic_bsz": True, "ref.log_prob_max_token_len_per_gpu": 64},
        "tiny-qwen3",
        "job.yaml: ref.log_prob_max_token_len_per_gpu=64: is below one full sequence "
        "(data.max_prompt_length + data.max_response_length = 128); use at least 128",
        id="ref-token-budget",
    ),
    pytest.param(
        {"algorithm.adv_estimator": "gae"},
        "tiny-qwen3",
        "job.yaml: critic.ppo_mini_batch_size=256: does not divide data.train_batch_size=16; use 1, 2, 4, 8 or 16",
        id="critic-batches-checked-when-enabled",
    ),
    pytest.param(
        {"data.max_prompt_length": 500},
        "tiny-qwen3",
        "job.yaml: data.max_response_length=64: data.max_prompt_length + data.max_response_length = 564 exceeds "
        "the model's 512 positions (max_position_embeddings)",
        id="lengths-fit-positions",
    ),
    pytest.param(
        {"rollout.max_new_tokens": 100},
        "tiny-qwen3",
        "job.yaml: rollout.max_new_tokens=100: exceeds data.max_response_length=64, the longest response the "
        "trainer accepts; lower it or raise that",
        id="max-new-tokens-fits-response",
    ),
    pytest.param(
        {"rollout.engine": "local", "rollout.sglang.router": True},
        "tiny-qwen3",
        "job.yaml: rollout.engine=local: a router spreads requests over SGLang servers; use rollout.engine=sglang "
        "or turn the router off",
        id="router-needs-sglang",
    ),
    pytest.param(
        {"placement.gpus_per_node": 4, "placement.nnodes": 2, "rollout.tensor_parallel_size": 6},
        "tiny-qwen3",
        "job.yaml: rollout.tensor_parallel_size=6: is larger than a node's 4 GPUs but not a whole number of nodes; "
        "a multi-node engine spans whole nodes, so use a divisor of 4 or a multiple of it",
        id="engine-spans-whole-nodes",
    ),
    pytest.param(
        {"placement.device": "cuda", "rollout.engine": "sglang", "rollout.sglang.enable_memory_saver": False},
        "tiny-qwen3",
        "job.yaml: rollout.sglang.enable_memory_saver=false: colocated engines must release GPU memory while the "
        "trainer runs; set it to true, or use placement.mode=disaggregate",
        id="colocated-sglang-needs-memory-saver",
    ),
    pytest.param(
        {"rollout.tensor_parallel_size": 3},
        "tiny-qwen3",
        "job.yaml: rollout.tensor_parallel_size=3: does not divide the 8 rollout GPUs; use 1, 2, 4 or 8",
        id="rollout-tp-divides-gpus",
    ),
    pytest.param(
        {
            "placement.mode": "disaggregate",
            "placement.rollout_nnodes": 1,
            "placement.rollout_gpus_per_node": 6,
            "rollout.tensor_parallel_size": 4,
        },
        "tiny-qwen3",
        "job.yaml: rollout.tensor_parallel_size=4: does not divide the 6 rollout GPUs; use 1, 2, 3 or 6",
        id="rollout-tp-divides-disaggregated-pool",
    ),
    pytest.param(
        {"rollout.num_gpus": 16},
        "tiny-qwen3",
        "job.yaml: rollout.num_gpus=16: exceeds the 8 GPUs of the rollout pool",
        id="rollout-gpus-fit-pool",
    ),
    pytest.param(
        {**QWEN25, "rollout.tensor_parallel_size": 4},
        "tiny-qwen3",
        "job.yaml: rollout.tensor_parallel_size=4: does not divide the model's 14 attention heads; use 1, 2, 7 or 14",
        id="rollout-tp-divides-heads",
    ),
    pytest.param(
        {"rollout.tensor_parallel_size": 2, "rollout.expert_parallel_size": 4},
        "tiny-qwen3-moe",
        "job.yaml: rollout.expert_parallel_size=4: must divide rollout.tensor_parallel_size=2; use 1 or 2",
        id="rollout-ep-divides-tp",
    ),
    pytest.param(
        {"rollout.tensor_parallel_size": 2, "rollout.expert_parallel_size": 2},
        "tiny-qwen3",
        "job.yaml: rollout.expert_parallel_size=2: the model is dense (its config.json declares no routed experts); "
        "use 1",
        id="rollout-ep-on-dense-model",
    ),
    pytest.param(
        {**QWEN25, "rollout.engine": "sglang", "rollout.quantization": "fp8", "rollout.tensor_parallel_size": 2},
        "tiny-qwen3",
        "job.yaml: rollout.quantization=fp8: q_proj would have 448 rows per rollout TP rank (896 in all), not whole "
        "128-row FP8 scale blocks, and SGLang stacks it with the projections fused with it; use "
        "rollout.tensor_parallel_size=1, rollout.quantization=none or rollout.engine=local",
        id="fp8-rollout-needs-whole-blocks-where-sglang-fuses",
    ),
    pytest.param(
        {"rollout.engine": "sglang", "rollout.quantization": "fp8"},
        "tiny-qwen3-moe",
        "job.yaml: rollout.quantization=fp8: the experts' gate_proj would have 32 rows per rollout TP rank "
        "(32 in all), not whole 128-row FP8 scale blocks, and SGLang stacks it with the projections fused with it; use "
        "rollout.quantization=none or rollout.engine=local",
        id="fp8-rollout-needs-whole-expert-blocks",
    ),
    pytest.param(
        {"placement.mode": "disaggregate", "placement.rollout_gpus_per_node": 8},
        "tiny-qwen3",
        "job.yaml: placement.rollout_nnodes: is required when placement.mode=disaggregate, where the engines have "
        "their own nodes",
        id="disaggregate-needs-rollout-nodes",
    ),
    pytest.param(
        {"placement.rollout_nnodes": 2},
        "tiny-qwen3",
        "job.yaml: placement.rollout_nnodes=2: only applies to placement.mode=disaggregate; "
        "remove it or switch the mode",
        id="colocate-rejects-rollout-nodes",
    ),
    pytest.param(
        {"placement.transport": "processes", "placement.nnodes": 2},
        "tiny-qwen3",
        "job.yaml: placement.transport=processes: runs the ranks on this machine without Ray, but placement.nnodes=2 "
        "needs Ray; use placement.transport=ray or auto",
        id="processes-on-one-node",
    ),
    pytest.param(
        {"placement.transport": "processes", "placement.device": "cuda", "placement.mode": "disaggregate",
         "placement.rollout_nnodes": 1, "placement.rollout_gpus_per_node": 8},
        "tiny-qwen3",
        "job.yaml: placement.transport=processes: runs the ranks on this machine without Ray, but a rollout pool of "
        "GPUs of its own (placement.mode=disaggregate) needs Ray; use placement.transport=ray or auto",
        id="processes-place-no-gpu-pool",
    ),
    pytest.param(
        {"rollout.n": 1, "actor.ppo_micro_batch_size_per_gpu": 1},
        "tiny-qwen3",
        "job.yaml: rollout.n=1: algorithm.adv_estimator=grpo compares the responses to each prompt, which needs "
        "rollout.n >= 2",
        id="group-estimator-needs-group",
    ),
    pytest.param(
        {"algorithm.adv_estimator": "gae", "critic.enable": False},
        "tiny-qwen3",
        "job.yaml: critic.enable=false: algorithm.adv_estimator=gae needs a value model; "
        "set it to true or leave it unset",
        id="gae-needs-critic",
    ),
    pytest.param(
        {"critic.enable": True, "critic.ppo_mini_batch_size": 8},
        "tiny-qwen3",
        "job.yaml: critic.enable=true: algorithm.adv_estimator=grpo does not use a value model; set it to false, "
        "or use algorithm.adv_estimator=gae",
        id="critic-unused-by-grpo",
    ),
    pytest.param(
        {"algorithm.adv_estimator": "grpoo"},
        "tiny-qwen3",
        "job.yaml: algorithm.adv_estimator=grpoo: is not a registered advantage estimator (gae, gpg, grpo, gspo, "
        "opo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax or rloo) nor a path/to/file.py:function "
        "plug-in; did you mean 'grpo'?",
        id="estimator-name-is-registered",
    ),
    pytest.param(
        {"actor.policy_loss.loss_mode": "clipcov"},
        "tiny-qwen3",
        "job.yaml: actor.policy_loss.loss_mode=clipcov: is not a registered policy loss (cispo, clip_cov, gpg, gspo, "
        "kl_cov, ppo or vanilla) nor a path/to/file.py:function plug-in; did you mean 'clip_cov'?",
        id="loss-mode-is-registered",
    ),
    pytest.param(
        {"actor.loss_agg_mode": "token-sum"},
        "tiny-qwen3",
        "job.yaml: actor.loss_agg_mode=token-sum: is not a registered loss aggregation mode (seq-mean-token-mean, "
        "seq-mean-token-sum, seq-mean-token-sum-norm or token-mean); did you mean 'token-mean'?",
        id="loss-agg-mode-is-registered",
    ),
    pytest.param(
        {"actor.kl_loss_type": "k4", "actor.use_kl_loss": True},
        "tiny-qwen3",
        "job.yaml: actor.kl_loss_type=k4: is not a registered KL estimator (abs, k1, k2, k3, kl, low_var_kl or mse)",
        id="kl-loss-type-is-registered",
    ),
    pytest.param(
        {"actor.policy_loss.clip_cov_ratio": 0.01},
        "tiny-qwen3",
        "job.yaml: actor.policy_loss.clip_cov_ratio=0.01: actor.policy_loss.loss_mode=vanilla does not use it; "
        "remove it, or use a loss that does (clip_cov)",
        id="loss-knob-the-loss-ignores",
    ),
    pytest.param(
        {"algorithm.adv_estimator": "gspo", "actor.clip_ratio_c": 10.0},
        "tiny-qwen3",
        "job.yaml: actor.clip_ratio_c=10.0: actor.policy_loss.loss_mode=gspo does not use it; remove it, "
        "or use a loss that does (ppo or vanilla)",
        id="gspo-has-no-dual-clip",
    ),
    pytest.param(
        {"algorithm.adv_estimator": "gspo", "actor.policy_loss.loss_mode": "vanilla"},
        "tiny-qwen3",
        "job.yaml: actor.policy_loss.loss_mode=vanilla: algorithm.adv_estimator=gspo is grpo's advantage with the "
        "gspo loss; to pair grpo's advantage with another loss, use algorithm.adv_estimator=grpo",
        id="gspo-estimator-means-gspo-loss",
    ),
    pytest.param(
        {"actor.policy_loss.loss_mode": "clip_cov", "actor.policy_loss.clip_cov_lb": 6.0},
        "tiny-qwen3",
        "job.yaml: actor.policy_loss.clip_cov_lb=6.0: must be below actor.policy_loss.clip_cov_ub=5.0",
        id="clip-cov-window",
    ),
    pytest.param(
        {"actor.policy_loss.loss_mode": "/nonexistent/my_loss.py:reinforce"},
        "tiny-qwen3",
        "job.yaml: actor.policy_loss.loss_mode=/nonexistent/my_loss.py:reinforce: no such file /nonexistent/my_loss.py",
        id="loss-plugin-file-exists",
    ),
    pytest.param(
        {"actor.policy_loss.loss_mode": f"{PLUGINS}:reinforce"},
        "tiny-qwen3",
        f"job.yaml: actor.policy_loss.loss_mode={PLUGINS}:reinforce: algorithm_plugins.py defines no 'reinforce'",
        id="loss-plugin-function-exists",
    ),
    pytest.param(
        {"actor.policy_loss.loss_mode": f"{PLUGINS}:loss_without_aggregation"},
        "tiny-qwen3",
        f"job.yaml: actor.policy_loss.loss_mode={PLUGINS}:loss_without_aggregation: cannot be called as "
        "loss_without_aggregation(old_log_prob, log_prob, advantages, response_mask, config=, aggregation=, "
        "rollout_is_weights=): got an unexpected keyword argument 'aggregation'",
        id="loss-plugin-signature-fits",
    ),
    pytest.param(
        {"algorithm.adv_estimator": f"{PLUGINS}:estimator_wanting_a_teacher"},
        "tiny-qwen3",
        f"job.yaml: algorithm.adv_estimator={PLUGINS}:estimator_wanting_a_teacher: cannot be called as "
        "estimator_wanting_a_teacher(token_level_rewards, response_mask): missing a required argument: "
        "'teacher_scores'; an estimator may take values, group_index, reward_baselines, gamma, lam, "
        "norm_adv_by_std or epsilon by name",
        id="estimator-plugin-signature-fits",
    ),
    pytest.param(
        {"algorithm.adv_estimator": f"{PLUGINS}:value_baseline_estimator"},
        "tiny-qwen3",
        f"job.yaml: critic.enable=false: algorithm.adv_estimator={PLUGINS}:value_baseline_estimator needs a value "
        "model; set it to true",
        id="estimator-plugin-taking-values-needs-critic",
    ),
    pytest.param(
        {"algorithm.adv_estimator": f"{PLUGINS}:centred_estimator", "rollout.n": 1,
         "actor.ppo_micro_batch_size_per_gpu": 1},
        "tiny-qwen3",
        f"job.yaml: rollout.n=1: algorithm.adv_estimator={PLUGINS}:centred_estimator compares the responses to "
        "each prompt, which needs rollout.n >= 2",
        id="group-plugin-estimator-needs-group",
    ),
    pytest.param(
        {"reward.overlong_buffer.enable": True, "reward.overlong_buffer.length": 16},
        "tiny-qwen3",
        "job.yaml: reward.overlong_buffer.enable=true: is applied by the dapo reward manager; set reward.manager=dapo",
        id="overlong-buffer-needs-dapo",
    ),
    pytest.param(
        {"reward.manager": "dapo", "reward.overlong_buffer.enable": True},
        "tiny-qwen3",
        "job.yaml: reward.overlong_buffer.length=4096: must be below data.max_response_length=64, "
        "the end of which it penalises",
        id="overlong-buffer-fits-response",
    ),
    pytest.param(
        {
            "algorithm.adv_estimator": "remax",
            "rollout.n": 1,
            "actor.ppo_micro_batch_size_per_gpu": 1,
            "algorithm.dynamic_sampling.enable": True,
        },
        "tiny-qwen3",
        "job.yaml: algorithm.dynamic_sampling.enable=true: drops groups whose rewards are all equal, which needs "
        "rollout.n >= 2",
        id="dynamic-sampling-needs-group",
    ),
    pytest.param(
        {"algorithm.rollout_correction.rollout_rs": "token", "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
         "algorithm.rollout_correction.rollout_rs_threshold_lower": 3.0},
        "tiny-qwen3",
        "job.yaml: algorithm.rollout_correction.rollout_rs_threshold_lower=3.0: must be below "
        "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        id="rejection-bounds-ordered",
    ),
    pytest.param(
        {"actor.optim.min_lr": 1e-5},
        "tiny-qwen3",
        "job.yaml: actor.optim.min_lr=1.0e-05: exceeds actor.optim.lr=1.0e-06",
        id="min-lr-below-lr",
    ),
    pytest.param(
        {"trainer.critic_warmup": 2},
        "tiny-qwen3",
        "job.yaml: trainer.critic_warmup=2: lets only the critic train for its first steps, and there is no critic; "
        "set it to 0",
        id="critic-warmup-needs-critic",
    ),
    pytest.param(
        {"tracking.rollout_trace.backend": "mlflow"},
        "tiny-qwen3",
        "job.yaml: tracking.rollout_trace.backend=mlflow: the samples go to the run's mlflow tracker; add mlflow to "
        "tracking.backends",
        id="rollout-trace-backend-is-tracked",
    ),
    pytest.param(
        {"model.path": "Qwen/Qwen3-1.7B"},
        "tiny-qwen3",
        "job.yaml: model.path=Qwen/Qwen3-1.7B: is not a local directory and model.hf_config is not set; hub ids "
        "cannot be fetched here, so set model.hf_config to the model's config.json (configs/models/ has common ones)",
        id="hub-id-needs-hf-config",
    ),
    pytest.param(
        {"model.path": "Qwen/Qwen3-1.7B", "model.hf_config": "/nonexistent/config.json"},
        "tiny-qwen3",
        "job.yaml: model.hf_config=/nonexistent/config.json: no config.json at /nonexistent/config.json",
        id="hf-config-must-exist",
    ),
    pytest.param(
        {"reward.function": "/nonexistent/reward.py:score"},
        "tiny-qwen3",
        "job.yaml: reward.function=/nonexistent/reward.py:score: /nonexistent/reward.py is not a file "
        "(relative paths start at the working directory)",
        id="reward-function-file-exists",
    ),
    pytest.param(
        {"data.dataset_class": "/nonexistent/data.py:Prompts"},
        "tiny-qwen3",
        "job.yaml: data.dataset_class=/nonexistent/data.py:Prompts: /nonexistent/data.py is not a file "
        "(relative paths start at the working directory)",
        id="dataset-class-file-exists",
    ),
    pytest.param(
        {"trainer.resume": "/nonexistent/step_10"},
        "tiny-qwen3",
        "job.yaml: trainer.resume=/nonexistent/step_10: is not auto, disable, or an existing checkpoint path",
        id="resume-path-exists",
    ),
    pytest.param(
        {"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 8, "critic.init_from": "/nonexistent/vm"},
        "tiny-qwen3",
        "job.yaml: critic.init_from=/nonexistent/vm: is neither `actor` nor an HF reward/value model directory "
        "(no config.json there)",
        id="critic-init-path-exists",
    ),
    pytest.param(
        {"actor.lora.rank": 8, "actor.megatron.extra": {"moe_grouped_gemm": True}},
        "tiny-qwen3-moe",
        "job.yaml: actor.megatron.extra={moe_grouped_gemm: true}: LoRA adapts each expert's own linears, which "
        "grouped-GEMM experts do not have; remove moe_grouped_gemm or set actor.lora.rank=0",
        id="lora-needs-experts-own-linears",
    ),
    pytest.param(
        {"actor.lora.rank": 8, "actor.lora.weight_sync": "adapter"},
        "tiny-qwen3",
        "job.yaml: actor.lora.weight_sync=adapter: only SGLang loads LoRA adapters; use actor.lora.weight_sync=merge "
        "or rollout.engine=sglang",
        id="lora-adapter-sync-needs-sglang",
    ),
    pytest.param(
        {"actor.lora.rank": 8, "actor.lora.weight_sync": "adapter", "rollout.engine": "sglang"},
        "tiny-qwen3-moe",
        "job.yaml: actor.lora.weight_sync=adapter: adapters travel from dense models on one pipeline stage (no "
        "experts, actor.megatron.pipeline_model_parallel_size=1); use actor.lora.weight_sync=merge",
        id="lora-adapter-sync-needs-a-dense-model",
    ),
    pytest.param(
        {"actor.lora.rank": 8, "actor.lora.weight_sync": "adapter", "rollout.engine": "sglang",
         "rollout.quantization": "fp8"},
        "tiny-qwen3",
        "job.yaml: actor.lora.weight_sync=adapter: with rollout.quantization=fp8 the base weights would be quantised "
        "without the adapters; use actor.lora.weight_sync=merge, whose merged weights are quantised, or "
        "rollout.quantization=none",
        id="lora-adapter-sync-is-not-quantised-with-its-adapters",
    ),
    pytest.param(
        {"actor.lora.rank": 8, "actor.lora.modules_to_save": ["output_layer"]},
        "tiny-qwen3",
        "job.yaml: actor.lora.modules_to_save=[output_layer]: the model ties its output layer to the embedding "
        "(tie_word_embeddings): name embedding",
        id="lora-saves-no-tied-output-layer",
    ),
    pytest.param(
        {"actor.lora.rank": 8, "actor.lora.modules_to_save": ["embedding"], "actor.lora.weight_sync": "adapter",
         "rollout.engine": "sglang"},
        "tiny-qwen3",
        "job.yaml: actor.lora.modules_to_save=[embedding]: SGLang loads LoRA factors, not whole modules; use "
        "actor.lora.weight_sync=merge",
        id="lora-adapter-sync-takes-no-saved-modules",
    ),
    pytest.param(
        {"reward.model.path": "/nonexistent/rm"},
        "tiny-qwen3",
        "job.yaml: reward.model.path=/nonexistent/rm: has no config.json; give the directory of an HF "
        "*ForSequenceClassification reward model with one label",
        id="reward-model-path-exists",
    ),
    pytest.param(
        {"reward.model.path": str(REPO_ROOT / "configs" / "quickstart" / "model")},
        "tiny-qwen3",
        f"job.yaml: reward.model.path={REPO_ROOT / 'configs' / 'quickstart' / 'model'}: holds Qwen3ForCausalLM; "
        "give the directory of an HF *ForSequenceClassification reward model with one label",
        id="reward-model-is-a-sequence-classifier",
    ),
    pytest.param(
        {"data.val_files": []},
        "tiny-qwen3",
        "job.yaml: trainer.val_before_train=true: needs data.val_files; add some or set it to false",
        id="val-before-train-needs-val-files",
    ),
    pytest.param(
        {"rollout.engine": "sglang", "rollout.quantization": "fp8", "placement.mode": "disaggregate",
         "placement.rollout_nnodes": 1, "placement.rollout_gpus_per_node": 1},
        "tiny-qwen3",
        "job.yaml: rollout.quantization=fp8: SGLang receives a disaggregated push over gloo on CPU, which cannot carry "
        "FP8 weights; use rollout.quantization=none, or placement.device=cuda (NCCL carries them)",
        id="fp8-to-sglang-never-over-gloo",
    ),
    pytest.param(
        {"placement.mode": "disaggregate", "placement.rollout_nnodes": 1, "placement.rollout_gpus_per_node": 2,
         "placement.rollout_min_engines": 3},
        "tiny-qwen3",
        "job.yaml: placement.rollout_min_engines=3: exceeds the 2 engine(s) the rollout pool starts with; use at most 2",
        id="pool-min-above-its-start",
    ),
    pytest.param(
        {"placement.mode": "disaggregate", "placement.rollout_nnodes": 1, "placement.rollout_gpus_per_node": 2,
         "placement.rollout_max_engines": 1},
        "tiny-qwen3",
        "job.yaml: placement.rollout_max_engines=1: is below the 2 engine(s) the rollout pool starts with; use at "
        "least 2",
        id="pool-max-below-its-start",
    ),
    pytest.param(
        {"placement.mode": "disaggregate", "placement.rollout_nnodes": 1, "placement.rollout_gpus_per_node": 2,
         "rollout.autoscale": True},
        "tiny-qwen3",
        "job.yaml: rollout.autoscale=true: has no room: the pool's engines are bounded to 2; set "
        "placement.rollout_min_engines below or rollout_max_engines above 2",
        id="autoscale-needs-room",
    ),
    pytest.param(
        {"rollout.engine": "sglang", "rollout.weight_sync": "delta"},
        "tiny-qwen3",
        "job.yaml: rollout.weight_sync=delta: colocated SGLang takes each bucket by IPC from the trainer rank on its "
        "GPU, which sends no bytes a delta could save; use rollout.weight_sync=full, or placement.mode=disaggregate",
        id="delta-sync-not-to-colocated-sglang",
    ),
    pytest.param(
        {"rollout.weight_sync": "delta", "actor.lora.rank": 4, "actor.lora.weight_sync": "adapter"},
        "tiny-qwen3",
        "job.yaml: rollout.weight_sync=delta: with actor.lora.weight_sync=adapter the engines load each step's "
        "adapter, not weights; use actor.lora.weight_sync=merge for delta sync of the merged weights, or "
        "rollout.weight_sync=full",
        id="delta-sync-not-with-adapter-sync",
    ),
    pytest.param(
        {"rollout.engine": "sglang", "trainer.check_sync_every": 5},
        "tiny-qwen3",
        "job.yaml: trainer.check_sync_every=5: compares the local engine's weights by HF name; SGLang's are fused "
        "and sharded under names of its own; use rollout.engine=local for the check, or 0",
        id="sync-check-reads-the-local-engine-only",
    ),
    pytest.param(
        {"placement.nnodes": 2, "placement.gpus_per_node": 4, "actor.megatron.tensor_model_parallel_size": 8},
        "tiny-qwen3",
        "job.yaml: actor.megatron.tensor_model_parallel_size=8: does not divide a node's 4 CPU ranks "
        "(placement.gpus_per_node): its groups would span nodes; use 1, 2 or 4, or a node with more CPU ranks",
        id="tp-groups-stay-within-a-node",
    ),
    pytest.param(
        {"placement.nnodes": 2, "placement.gpus_per_node": 6, "actor.megatron.expert_model_parallel_size": 4,
         "data.train_batch_size": 12, "actor.ppo_mini_batch_size": 12},
        "tiny-qwen3-moe",
        "job.yaml: actor.megatron.expert_model_parallel_size=4: its groups of 4 ranks (expert_tensor_parallel_size x "
        "expert_model_parallel_size) fit in a node's 6 CPU ranks but would straddle two nodes; make the product "
        "divide 6",
        id="ep-groups-that-fit-a-node-stay-within-it",
    ),
    pytest.param(
        {"data.val_files": [], "trainer.val_before_train": False, "trainer.test_freq": 5},
        "tiny-qwen3",
        "job.yaml: trainer.test_freq=5: needs data.val_files; add some or set it to -1",
        id="test-freq-needs-val-files",
    ),
]


@pytest.mark.parametrize("settings, model, message", CASES)
def test_check_fires_with_field_value_and_fix(settings, model, message):
    assert message in problems_with(settings, model)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_minimal_spec_has_no_problems(model):
    assert problems_of(minimal_spec(model)) == []


@pytest.mark.parametrize(
    "settings",
    [
        {"actor.clip_ratio_c": None},
        {"algorithm.adv_estimator": "gspo"},
        {"actor.policy_loss.loss_mode": "clip_cov", "actor.policy_loss.clip_cov_ratio": 0.01,
         "actor.policy_loss.clip_cov_lb": 0.5, "actor.policy_loss.clip_cov_ub": 2.0},
        {"actor.policy_loss.loss_mode": "kl_cov", "actor.policy_loss.kl_cov_ratio": 0.01,
         "actor.policy_loss.ppo_kl_coef": 1.0, "actor.clip_ratio_low": 0.2},
        {"actor.policy_loss.loss_mode": f"{PLUGINS}:reinforce_loss", "actor.policy_loss.clip_cov_ratio": 0.01},
        {"algorithm.adv_estimator": f"{PLUGINS}:centred_estimator"},
        {"algorithm.adv_estimator": f"{PLUGINS}:value_baseline_estimator", "critic.enable": True,
         "critic.ppo_mini_batch_size": 8, "algorithm.gamma": 0.9},
        {"algorithm.adv_estimator": "gpg", "actor.policy_loss.loss_mode": "gpg"},
        {"actor.loss_agg_mode": "seq-mean-token-sum-norm", "actor.kl_loss_type": "mse", "actor.use_kl_loss": True},
    ],
    ids=["no-dual-clip", "gspo", "clip-cov-knobs", "kl-cov-knobs-and-the-default-clip", "loss-plugin-reads-anything",
         "estimator-plugin", "value-estimator-plugin-with-critic", "gpg", "verl-names"],
)
def test_algorithm_choices_that_pass(settings):
    """Registered names, plug-ins that fit their protocol, and knobs the chosen algorithm reads (or left default)."""
    assert problems_with(settings) == []


def test_group_estimators_are_exactly_those_that_take_group_index():
    from rlmegatron.algorithms import ADVANTAGE_ESTIMATORS, estimator_inputs

    takes_groups = {name for name in ADVANTAGE_ESTIMATORS
                    if "group_index" in estimator_inputs(ADVANTAGE_ESTIMATORS.get(name))}
    assert GROUP_ESTIMATORS == takes_groups


@pytest.mark.parametrize(
    "settings, model",
    [
        # TP 4 over 2 KV heads: Megatron replicates each KV head on 2 ranks.
        ({"actor.megatron.tensor_model_parallel_size": 4}, "tiny-qwen3"),
        (
            {
                "actor.megatron.tensor_model_parallel_size": 2,
                "actor.megatron.sequence_parallel": True,
                "actor.megatron.expert_model_parallel_size": 4,
                "actor.megatron.expert_tensor_parallel_size": 1,
                "actor.megatron.pipeline_model_parallel_size": 2,
                "actor.megatron.virtual_pipeline_model_parallel_size": 2,
                "actor.ppo_micro_batch_size_per_gpu": 4,
            },
            "tiny-qwen3-moe",
        ),
        (
            {
                **DEEPSEEK,
                "actor.megatron.pipeline_model_parallel_size": 4,
                "actor.megatron.expert_model_parallel_size": 2,
                "actor.megatron.extra": {
                    "num_layers_in_first_pipeline_stage": 13,
                    "num_layers_in_last_pipeline_stage": 12,
                },
            },
            "tiny-qwen3",
        ),
        ({"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 256}, "tiny-qwen3"),
        # SGLang's FP8 fusions fit DeepSeek-V3's sizes at TP 8 with EP 8; the local engine fuses nothing.
        ({**DEEPSEEK, "rollout.engine": "sglang", "rollout.quantization": "fp8", "rollout.tensor_parallel_size": 8,
          "rollout.expert_parallel_size": 8}, "tiny-qwen3"),
        ({"rollout.quantization": "fp8"}, "tiny-qwen3"),
    ],
    ids=["kv-head-replication", "moe-tp-sp-ep-pp-vpp", "deepseek-uneven-pp", "dynamic-bsz-token-budget",
         "fp8-rollout-deepseek-v3", "fp8-rollout-local-engine"],
)
def test_valid_layouts_pass(settings, model):
    assert problems_with(settings, model) == []


def test_kv_heads_must_divide_or_be_divided_by_tp(tmp_path):
    config = {"hidden_size": 96, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    assert problems_with({"model.path": str(tmp_path), "actor.megatron.tensor_model_parallel_size": 2}) == [
        "job.yaml: actor.megatron.tensor_model_parallel_size=2: must divide or be a multiple of the model's "
        "3 key/value heads (Megatron's num_query_groups rule); use 1"
    ]


def test_fp8_rollout_names_each_projection_sglang_cannot_hold_in_whole_fp8_blocks(tmp_path):
    """DeepSeek-V3 at rollout TP 32: SGLang would refuse 576 gate rows and 64 shared-expert rows per rank; TP 16 with
    EP 16 fits. An MLA model whose q_a_proj has 96 rows: SGLang would concatenate its scales with
    kv_a_proj_with_mqa's, whose rows would then read the scales of the wrong blocks; no rollout TP changes a
    replicated projection's rows."""
    fp8 = {"rollout.engine": "sglang", "rollout.quantization": "fp8"}
    stacked = "not whole 128-row FP8 scale blocks, and SGLang stacks it with the projections fused with it"
    fix = "use rollout.quantization=none or rollout.engine=local"
    smaller = ("use rollout.tensor_parallel_size=1, 2, 4, 8 or 16 (with rollout.expert_parallel_size dividing it), "
               "rollout.quantization=none or rollout.engine=local")
    assert problems_with({**DEEPSEEK, **fp8, "rollout.tensor_parallel_size": 32, "rollout.expert_parallel_size": 32,
                          "placement.nnodes": 4}, "tiny-qwen3") == [
        f"job.yaml: rollout.quantization=fp8: gate_proj would have 576 rows per rollout TP rank (18432 in all), "
        f"{stacked}; {smaller}",
        f"job.yaml: rollout.quantization=fp8: the shared experts' gate_proj would have 64 rows per rollout TP rank "
        f"(2048 in all), {stacked}; {smaller}"]
    config = json.loads((MODELS_DIR / "deepseek-v3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "q_lora_rank": 96}))
    assert problems_with({**DEEPSEEK, "model.hf_config": str(tmp_path), **fp8, "rollout.tensor_parallel_size": 8,
                          "rollout.expert_parallel_size": 8}, "tiny-qwen3") == [
        "job.yaml: rollout.quantization=fp8: q_a_proj would have 96 rows per rollout TP rank (96 in all), not whole "
        f"128-row FP8 scale blocks, and SGLang concatenates it and its scales with kv_a_proj_with_mqa's; {fix}"]


def test_local_model_dir_without_config_json_is_named(tmp_path):
    assert problems_with({"model.path": str(tmp_path)}) == [
        f"job.yaml: model.path={tmp_path}: no config.json at {tmp_path}/config.json"
    ]


def test_a_ref_layout_without_a_kl_term_is_rejected_not_checked():
    assert problems_with({"ref.megatron.tensor_model_parallel_size": 3}) == [
        "job.yaml: ref.megatron.tensor_model_parallel_size=3: the reference model is only built for a KL term "
        "(actor.use_kl_loss or algorithm.use_kl_in_reward), and neither is on; remove it "
        "(~ref.megatron.tensor_model_parallel_size on the command line) or turn one on"
    ]


def test_role_laid_out_like_the_actor_does_not_repeat_its_problems():
    problems = problems_with({"actor.use_kl_loss": True, "actor.megatron.tensor_model_parallel_size": 3})
    assert problems and not any("ref.megatron" in problem for problem in problems)


def test_check_spec_returns_every_problem():
    raw = minimal_spec()
    raw["rollout"]["n"] = 1
    raw["actor"]["megatron"] = {"tensor_model_parallel_size": 3}
    raw["placement"]["rollout_nnodes"] = 2
    fields = {problem.field for problem in check_spec(JobSpec.model_validate(raw))}
    assert fields >= {"actor.megatron.tensor_model_parallel_size", "rollout.n", "placement.rollout_nnodes"}


def test_a_tokenizer_that_loads_only_with_its_own_code_needs_trust_remote_code(tmp_path):
    model = write_remote_code_model(tmp_path / "model")
    assert problems_with({"model.path": str(model)}) == [
        f"job.yaml: model.trust_remote_code=false: {model}/tokenizer_config.json names its own code "
        "(tokenization_echo.EchoTokenizer), without which transformers cannot load it; "
        "set it to true if you trust that code"
    ]
    # Its config.json names code too, but transformers has a class of its own for model_type qwen3.
    quickstart_tokenizer = str(REPO_ROOT / "configs" / "quickstart" / "model")
    assert problems_with({"model.path": str(model), "model.tokenizer_path": quickstart_tokenizer}) == []
    assert problems_with({"model.path": str(model), "model.trust_remote_code": True}) == []


def test_a_reward_model_with_two_labels_or_a_layout_that_does_not_fit_is_named(tmp_path):
    config = json.loads((REPO_ROOT / "configs" / "quickstart" / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"],
                                                      "id2label": {"0": "bad", "1": "good"}}))
    assert problems_with({"reward.model.path": str(tmp_path)}) == [
        f"job.yaml: reward.model.path={tmp_path}: scores 2 labels, not one; give the directory of an HF "
        "*ForSequenceClassification reward model with one label"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"],
                                                      "id2label": {"0": "score"}}))
    assert problems_with({"reward.model.path": str(tmp_path)}) == []
    [problem] = problems_with({"reward.model.path": str(tmp_path), "reward.model.tensor_model_parallel_size": 3})
    assert problem.startswith("job.yaml: reward.model.tensor_model_parallel_size=3: does not divide the ")


def test_the_local_engines_speculative_decoding_records_no_routing_for_r3(tmp_path):
    from tests.models.tiny_hf import save_tiny_model

    spec = minimal_spec()
    spec["model"]["path"] = save_tiny_model("deepseek_v3", str(tmp_path / "mtp"))
    spec["data"].update(max_prompt_length=32, max_response_length=32)  # the tiny model's 64 positions
    drafting = "rollout.speculative={method: mtp, num_draft_tokens: 2}"
    assert problems_of(spec, drafting, "actor.moe.routing_replay=r2") == []
    for routing in ("actor.moe.routing_replay=r3", "actor.moe.routing_agreement=true"):
        assert problems_of(spec, drafting, routing) == [
            "command line: rollout.speculative.method=mtp: the local engine's speculative decoding records no routed "
            "experts, which actor.moe's r3 and routing_agreement read from the rollout; remove one of them (r2 "
            "replays the old-log-prob pass's routing instead)"]


def test_routing_replay_needs_routers_a_pass_to_record_and_engines_that_return_routing():
    for field in ("actor.moe.routing_replay=r3", "actor.moe.routing_agreement=true"):
        assert problems_of(minimal_spec(), field) == [
            f"command line: {field}: the model is dense (its config.json declares no routed experts); remove it"]
    # minimal_spec's update has 2 mini-batches: r2 has the old-log-prob pass to record; one mini-batch has none.
    assert problems_of(minimal_spec("tiny-qwen3-moe"), "actor.moe.routing_replay=r2") == []
    on_policy = problems_of(minimal_spec("tiny-qwen3-moe"), "actor.moe.routing_replay=r2",
                            "actor.ppo_mini_batch_size=16")
    assert len(on_policy) == 1 and on_policy[0].startswith(
        "command line: actor.moe.routing_replay=r2: replays the old-log-prob pass's routing in the update, and this "
        "update is on-policy"), on_policy
    assert problems_of(minimal_spec("tiny-qwen3-moe"), "actor.moe.routing_replay=r2",
                       "actor.megatron.extra.moe_router_fusion=true") == [
        "command line: actor.megatron.extra.moe_router_fusion=true: routing replay and its agreement need "
        "Megatron-Core's unfused top-k routing; remove it"]
    assert problems_of(minimal_spec("tiny-qwen3-moe"), "actor.moe.routing_agreement=true",
                       "model.trust_remote_code=true") == [
        "command line: actor.moe.routing_agreement=true: the local engine records routing from transformers' own MoE "
        "routers, and model.trust_remote_code runs the model's own code; use rollout.engine=sglang, or r2 without "
        "routing_agreement"]
    # Multi-turn trajectories carry their model turns' routing (rollout/agent_loop.py).
    assert problems_of(minimal_spec("tiny-qwen3-moe"), "actor.moe.routing_replay=r3",
                       "rollout.multi_turn.tools=[{plugin: rlmegatron/agent/python_tool.py:PythonTool}]") == []
    # r3 measures the agreement itself; asking for it too changes nothing.
    assert problems_of(minimal_spec("tiny-qwen3-moe"), "actor.moe.routing_replay=r3",
                       "actor.moe.routing_agreement=true") == [
        "command line: actor.moe.routing_agreement=true: routing replay r3 measures the agreement anyway (its record "
        "is the rollout's routing); remove it (~actor.moe.routing_agreement on the command line)"]


def test_mtp_training_and_drafting_need_a_checkpoint_that_holds_mtp_layers(tmp_path):
    from tests.models.tiny_hf import save_tiny_model

    asks = ("actor.mtp.loss_weight=0.3", "rollout.speculative={method: mtp, num_draft_tokens: 2}")
    with_mtp = save_tiny_model("deepseek_v3", str(tmp_path / "mtp"))
    spec = minimal_spec()
    spec["model"]["path"] = with_mtp
    spec["data"].update(max_prompt_length=32, max_response_length=32)  # the tiny model's 64 positions
    assert problems_of(spec, *asks) == []
    spec["model"]["path"] = save_tiny_model("deepseek_v3_no_mtp", str(tmp_path / "no_mtp"))
    held_none = ("the checkpoint at model.path holds none of the MTP layers config.json declares (transformers saves "
                 "none); remove it, or use a checkpoint with MTP layers (DeepSeek-V3, GLM-4.5 as published)")
    assert problems_of(spec, *asks) == [f"command line: actor.mtp.loss_weight=0.3: {held_none}",
                                        f"command line: rollout.speculative.method=mtp: {held_none}"]
    declares_none = ("the model has no multi-token-prediction layers (config.json declares no "
                     "num_nextn_predict_layers); remove it, or use a checkpoint with MTP layers (DeepSeek-V3, GLM-4.5 "
                     "as published)")
    assert problems_of(minimal_spec(), asks[0]) == [f"command line: actor.mtp.loss_weight=0.3: {declares_none}"]
    assert problems_of(minimal_spec("qwen3.5-397b-a17b"), asks[0]) == [
        "command line: actor.mtp.loss_weight=0.3: Qwen3.5-MoE's MTP layer (mtp.*) is carried as released, not built "
        "in Megatron, so it neither trains nor reaches the engines with the sync; remove it, or use a checkpoint with "
        "MTP layers (DeepSeek-V3, GLM-4.5 as published)"]
    spec["model"]["path"] = with_mtp
    assert problems_of(spec, asks[0], "actor.megatron.context_parallel_size=2") == [
        "command line: actor.mtp.loss_weight=0.3: the MTP loss is not supported at actor.megatron."
        "context_parallel_size > 1; use 0, or context_parallel_size=1"]
    assert problems_of(spec, asks[0], "actor.lora.rank=8") == [
        "command line: actor.mtp.loss_weight=0.3: trains the MTP layers whole, and actor.lora freezes every base "
        "weight; use 0 with LoRA, or train without it (actor.lora.rank=0)"]
    # What the schema refuses: a negative weight, another method, no draft tokens.
    for bad in ("actor.mtp.loss_weight=-1", "rollout.speculative={method: eagle3}",
                "rollout.speculative={method: mtp, num_draft_tokens: 0}"):
        assert len(problems_of(spec, bad)) == 1, bad
