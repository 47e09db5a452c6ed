"""Rank-side code for the parallel-layout parity tests: tiny GPTModels trained one step at any layout.

Every layout starts from the same weights: the TP=PP=EP=1 reference model is
saved with megatron.core.dist_checkpointing and loaded into each layout. Each
layout's gradients are saved the same way and loaded back at TP=PP=EP=1, so
dist_checkpointing does the resharding and the comparison is full tensor
against full tensor.
"""
from __future__ import annotations

import os
from functools import partial

import torch

from rlmegatron.models.context_parallel import chunk_positions
from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.runtime.distributed import transformer_config_overrides
from rlmegatron.rank.roles.megatron_step import load_weights, save_weights

SEQ_LEN = 16
MICRO_BATCH = 2
VOCAB = 128


def transformer_config(kind: str, layout: ParallelLayout, dispatcher: str = "allgather"):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        **transformer_config_overrides("cpu"),
        **layout.transformer_config_fields(),
    )
    moe = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=dispatcher,
        moe_shared_expert_intermediate_size=32,
    )
    if kind == "dense":  # Qwen3-shaped: GQA, qk-norm
        return TransformerConfig(num_layers=4, num_query_groups=2, ffn_hidden_size=128, qk_layernorm=True, **common)
    if kind == "sinks_window":  # gpt-oss-shaped attention: a learned sink per head, a window of 4 keys every other layer
        return TransformerConfig(num_layers=4, num_query_groups=2, ffn_hidden_size=128, softmax_type="learnable",
                                 window_size=(3, 0), window_attn_skip_freq=[1, 0, 1, 0], **common)
    if kind == "moe":  # Qwen2-MoE-shaped: softmax router with aux loss, gated shared expert
        return TransformerConfig(
            num_layers=2, num_query_groups=2, ffn_hidden_size=128, moe_shared_expert_gate=True, **moe, **common
        )
    if kind == "mla_moe":  # DeepSeek-V3-shaped
        return MLATransformerConfig(
            num_layers=3,
            ffn_hidden_size=96,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
            qk_layernorm=True,
            rope_type="yarn",
            rotary_scaling_factor=4.0,
            original_max_position_embeddings=8,
            mscale=1.0,
            mscale_all_dim=1.0,
            moe_layer_freq=[0, 1, 1],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.5,
            moe_router_dtype="fp32",
            **moe,
            **common,
        )
    raise ValueError(kind)


def build_model(kind: str, layout: ParallelLayout, dispatcher: str = "allgather", use_distributed_optimizer=False):
    """Megatron DDP-wrapped model chunks for this rank (one chunk, or VPP chunks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    from rlmegatron.models.spec import decoder_block_spec

    config = transformer_config(kind, layout, dispatcher)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, use_te=False, vp_stage=vp),
            vocab_size=VOCAB,
            max_sequence_length=SEQ_LEN,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=(kind == "dense"),
            position_embedding_type="rope",
            vp_stage=vp,
        )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
        )
        chunks.append(DistributedDataParallel(config, ddp_config, model))
    return chunks


def microbatches(n: int, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN + 1), generator=gen)
        mask = torch.ones(MICRO_BATCH, SEQ_LEN)
        mask[0, -3:] = 0  # a padded tail, so the masked mean is exercised
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], mask=mask))
    return batches


def _loss_func(mask, count, output):
    # At CP>1, this rank's tokens' share of the micro-batch loss: Megatron's schedule multiplies it by CP
    # and DDP averages the gradients over DP × CP.
    loss = (output * mask).sum() / count
    return loss, {"lm loss": loss.detach().clone()}  # clone: the schedule scales `loss` in place


def _forward_step(data_iterator, model):
    from megatron.core import parallel_state as ps

    batch = next(data_iterator)
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["mask"]
    position_ids = torch.arange(SEQ_LEN).expand(MICRO_BATCH, SEQ_LEN)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:  # this rank's load-balanced chunks of each sequence
        mine = chunk_positions(SEQ_LEN, cp, ps.get_context_parallel_rank())
        tokens, labels, position_ids = tokens[:, mine], labels[:, mine], position_ids[:, mine]
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, mask if cp == 1 else mask[:, mine], mask.sum())


def train_step(chunks, batches) -> float | None:
    """One forward-backward over `batches`; returns the mean loss on last-stage ranks, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    iterators = [iter(batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=SEQ_LEN,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    torch.distributed.all_reduce(loss, group=ps.get_context_parallel_group())  # the CP ranks' shares
    return float(loss)


def _save_grads(chunks, path):
    """Save main grads in place of the weights, so dist_checkpointing reshards them like parameters."""
    saved = []
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.module.parameters():
                saved.append(param.detach().clone())
                param.copy_(param.main_grad)
    save_weights(chunks, path)
    with torch.no_grad():
        params = [p for chunk in chunks for p in chunk.module.parameters()]
        for param, value in zip(params, saved):
            param.copy_(value)


def _full_tensors(chunks):
    return {name: p.detach().clone() for name, p in chunks[0].module.named_parameters()}


def parity_job(kind: str, layouts: list[tuple[ParallelLayout, str]], num_microbatches: int, workdir: str):
    """Compare each (layout, dispatcher) with the TP=PP=EP=1 reference; every rank runs this."""
    batches = microbatches(num_microbatches)
    reference = ParallelLayout()
    init_model_parallel(reference)
    torch.manual_seed(1234)
    ref_chunks = build_model(kind, reference)
    # Saved before the step: finalize_model_grads updates the MoE router's expert bias in place.
    save_weights(ref_chunks, os.path.join(workdir, "weights"))
    ref_loss = train_step(ref_chunks, batches)
    ref_grads = {name: p.main_grad.clone() for name, p in ref_chunks[0].module.named_parameters()}

    report = {"reference_loss": ref_loss, "layouts": {}}
    for layout, dispatcher in layouts:
        label = f"{layout}-{dispatcher}" if kind != "dense" else str(layout)
        init_model_parallel(layout)
        chunks = build_model(kind, layout, dispatcher)
        load_weights(chunks, os.path.join(workdir, "weights"))
        loss = train_step(chunks, batches)
        _save_grads(chunks, os.path.join(workdir, f"grads-{label}"))
        report["layouts"][label] = {
            "decoder_layers": sum(len(chunk.module.decoder.layers) for chunk in chunks),  # on this rank
            "loss": loss,
        }

    # Every layout's gradients, loaded as full tensors into one reference-layout model.
    init_model_parallel(reference)
    full = build_model(kind, reference)
    for label, entry in report["layouts"].items():
        load_weights(full, os.path.join(workdir, f"grads-{label}"))
        grads = _full_tensors(full)
        entry["grad_max_abs_diff"] = {name: float((grads[name] - g).abs().max()) for name, g in ref_grads.items()}
        entry["ref_grad_abs_max"] = {name: float(g.abs().max()) for name, g in ref_grads.items()}
    return report


def optimizer_job(layout: ParallelLayout, use_distributed_optimizer: bool, workdir: str, steps: int = 2):
    """Adam steps on the dense model from the shared initial weights; returns the full parameters after."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_model_parallel(ParallelLayout())
    torch.manual_seed(1234)
    weights = os.path.join(workdir, "weights")
    if not os.path.exists(os.path.join(weights, "metadata.json")):
        save_weights(build_model("dense", ParallelLayout()), weights)
    init_model_parallel(layout)
    chunks = build_model("dense", layout, use_distributed_optimizer=use_distributed_optimizer)
    load_weights(chunks, weights)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=use_distributed_optimizer
        ),
        chunks,
    )
    grad_norms = []
    for step in range(steps):
        optimizer.zero_grad()
        train_step(chunks, microbatches(2, seed=step))
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(grad_norm)
    out = os.path.join(workdir, f"after-{layout}-{use_distributed_optimizer}")
    save_weights(chunks, out)
    init_model_parallel(ParallelLayout())
    full = build_model("dense", ParallelLayout())
    load_weights(full, out)
    return {"params": _full_tensors(full), "grad_norms": grad_norms}
