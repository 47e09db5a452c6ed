"""Rank-side body of the activation-recompute test and benchmark: one forward-backward per recompute setting.

Each setting is a spec `megatron` section turned into the model the trainer builds (spec_config_options ->
transformer_config -> build_gpt_model). Activation memory is measured as the bytes of the distinct
storages autograd saves for backward during the forward pass, parameters excluded
(torch.autograd.graph.saved_tensors_hooks): what the graph keeps alive between the forward and the
backward pass, i.e. the activation part of the peak. The recompute itself briefly rebuilds one recompute
group's activations during the backward pass; that transient is not in this number. Core-attention calls are
counted too: a recomputed layer runs its attention twice.
"""
from __future__ import annotations

import time

import torch

from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS


def hf_config(family: str, **overrides) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**COMMON, **FAMILY_CONFIGS[family], **overrides}).to_dict()


def _saved_activation_bytes(model, run) -> tuple[torch.Tensor, int]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    return loss, sum(saved.values())


def recompute_job(hf: dict, settings: dict[str, dict], batch: int, seq_len: int) -> dict[str, dict]:
    """{label: {loss, saved_bytes, core_attention_calls, seconds, grad_max_abs_diff (vs the first label),
    grad_abs_max}}."""
    from rlmegatron.config.spec import MegatronConfig
    from rlmegatron.models.hf_config import build_gpt_model, model_facts, spec_config_options, transformer_config
    from rlmegatron.runtime import ParallelLayout, init_model_parallel

    layout = ParallelLayout()
    init_model_parallel(layout)
    facts = model_facts(hf, tp=1)
    tokens = torch.randint(0, facts.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq_len).expand(batch, seq_len)
    reference_grads, initial, report = None, None, {}
    for label, megatron in settings.items():
        config = transformer_config(facts, layout, options=spec_config_options(MegatronConfig(**megatron)))
        torch.manual_seed(0)
        model = build_gpt_model(facts, config)
        if initial is None:
            initial = model.state_dict()
        model.load_state_dict(initial)
        model.train()
        calls = []
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(lambda *_: calls.append(1))
        start = time.perf_counter()
        loss, saved = _saved_activation_bytes(
            model, lambda: model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean())
        loss.backward()
        seconds = time.perf_counter() - start
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        reference_grads = reference_grads or grads
        report[label] = {
            "loss": float(loss),
            "saved_bytes": saved,
            "core_attention_calls": len(calls),
            "seconds": seconds,
            "grad_max_abs_diff": max(float((grads[n] - g).abs().max()) for n, g in reference_grads.items()),
            "grad_abs_max": max(float(g.abs().max()) for g in grads.values()),
        }
    return report
