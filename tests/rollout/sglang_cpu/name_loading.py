"""Runs SGLang 0.5.23's own model construction and `load_weights` on CPU: argv[1] is a JSON job, {"models": {label:
{"model": a HF model directory (its config.json says the architecture), "tensors": a safetensors file of the
HF-named weights a weight sync streams, and optionally "args": the server's command line (the launch's own flags) and
"draft": true, to load the draft model SGLang's speculative decoding builds from those arguments instead of the
target}}, "tp": TP sizes}.

For each TP rank of each TP size it builds the architecture's SGLang model class (SGLang's ModelRegistry, with the
rank set through SGLang's own get_parallel().override, as fp8_loading.py does), fills every parameter with NaN, hands
the tensors to the model's `load_weights` (SGLang's name mapping: stacked q/k/v and gate/up, expert parameters,
and its silent `continue` for a name it has no parameter for) and prints, as JSON, per "tp{size}.rank{rank}": the
parameters some element of which is still NaN (a tensor it expected and never got), and, for the parameters that
take one HF tensor as it is, those whose value differs from that tensor's TP slice.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import types

import gpu_stubs

gpu_stubs.install()

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.srt.models.registry import ModelRegistry  # noqa: E402
from sglang.srt.runtime_context import get_parallel, publish  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from transformers import AutoConfig  # noqa: E402


class Group:
    """A process group of `size` as SGLang's layers read it while they are built and loaded (no collective runs)."""

    def __init__(self, size: int, rank: int):
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, rank
        self.ranks = list(range(size))
        self.is_first_rank = self.is_last_rank = True  # the pipeline group: one stage
        self.device_group = self.cpu_group = None


def parallel(size: int, rank: int) -> dict:
    tp, one = Group(size, rank), Group(1, 0)
    return dict(tp_group=tp, tp_size=size, tp_rank=rank, attn_tp_group=tp, attn_tp_size=size, attn_tp_rank=rank,
                moe_tp_group=tp, moe_tp_size=size, moe_tp_rank=rank, shared_experts_tp_group=tp,
                pp_group=one, pp_rank=0, attn_dp_rank=0, attn_dp_enabled=False, attn_cp_group=one, attn_cp_rank=0,
                attn_dcp_rank=0, attn_dcp_size=1, dcp_enabled=False, dcp_group=one, dcp_rank=0, dp_rank=0,
                moe_ep_group=one, moe_ep_rank=0, moe_ep_size=1, moe_dp_group=one, moe_dp_rank=0, world_group=tp,
                num_dp_ranks=1, launch_world_rank=rank, launch_world_size=size, max_world_size=size)


def main() -> None:
    job = json.loads(sys.argv[1])
    report = {}
    for label, model in job["models"].items():
        try:
            report[label] = loaded(model["model"], model["tensors"], job["tp"], model.get("args"),
                                   model.get("draft", False))
        except Exception as err:  # one model SGLang cannot build or load fails its own test, not the others'
            report[label] = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(report))


def _resolvable(model_dir: str) -> str:
    """A model directory SGLang resolves its server arguments for on a CPU. For a DeepSeek Sparse Attention model
    SGLang picks its kernels by the GPU's compute capability while it resolves them; they are resolved for the same
    model without the indexer's keys (nothing the model's construction or loading reads depends on them: the model
    class is built from the real config)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if "index_topk" not in config:
        return model_dir
    stripped = tempfile.mkdtemp(prefix="rlm-sglang-")
    keep = {k: v for k, v in config.items() if not k.startswith("index_")}
    with open(os.path.join(stripped, "config.json"), "w") as f:
        json.dump({**keep, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, f)
    return stripped


def build(model_class, config) -> torch.nn.Module:
    """SGLang's model of `config`. Kimi-K2.5's MoonViT tower reads the fields of Moonshot's own config class, which
    transformers' does not have; no sync sends the tower (the bridge carries it, the engines keep what they loaded),
    so its language model is built alone, as SGLang's language_only mode does, behind the wrapper's own
    load_weights (which takes language_model. off each name and hands the rest to its DeepSeek-V3 model)."""
    if model_class.__name__ != "KimiK25ForConditionalGeneration":
        return model_class(config, quant_config=None)
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

    model = torch.nn.Module()
    model.config = type("Config", (), {"language_only": True})()
    model.language_model = DeepseekV3ForCausalLM(config.text_config, quant_config=None)
    model.load_weights = types.MethodType(model_class.load_weights, model)
    return model


def draft_config(server_args):
    """The config of the draft model SGLang builds for these (resolved) server arguments: its own ModelConfig for
    the draft, whose architecture is the *NextN class of a checkpoint that carries its MTP layer."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.configs.model_config import ModelConfig

    path = resolved_view(server_args).speculative_draft_model_path
    return ModelConfig.from_server_args(server_args, model_path=path, is_draft_model=True).hf_config


def checkpoint_name(draft_parameter: str, config) -> str:
    """The HF name a NextN draft's parameter is loaded from: SGLang's nextn loader takes `model.layers.{N}.` (N the
    decoder layers' count) off the MTP layer's names, keeping its own tensors (enorm, eh_proj, ...) under `model.`
    and the transformer layer's under `model.decoder.`."""
    rest = draft_parameter.removeprefix("model.").removeprefix("decoder.")
    return f"model.layers.{config.num_hidden_layers}.{rest}"


def loaded(model_dir: str, tensors_file: str, tp_sizes: list[int], args: list[str] | None = None,
           draft: bool = False) -> dict:
    config = AutoConfig.from_pretrained(model_dir)
    # A hybrid linear-attention model (Qwen3-Next, Qwen3.5): SGLang's radix cache would snapshot its recurrent states,
    # which it supports on GPU platforms only, and refuses to resolve the arguments here; nothing here generates.
    hybrid = "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or ())
    server_args = prepare_server_args(args or ["--model-path", _resolvable(model_dir), "--device", "cpu",
                                               "--skip-tokenizer-init"]
                                      + (["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"] if hybrid else []))
    server_args.resolve_once()
    publish(server_args, role="scheduler")  # last publish wins: each model its own server's arguments
    if draft:
        config = draft_config(server_args)
    elif hybrid:  # SGLang builds these from config classes of its own (Qwen3-Next's layers_block_type, ...)
        from sglang.srt.configs.model_config import ModelConfig

        config = ModelConfig.from_server_args(server_args).hf_config
    model_class, _ = ModelRegistry.resolve_model_cls(config.architectures)
    tensors = load_file(tensors_file)
    carried_tower = not any(".visual." in name or name.startswith("visual.") for name in tensors)
    vocab = config.get_text_config().vocab_size
    report = {}
    for size in tp_sizes:
        for rank in range(size):
            with get_parallel().override(**parallel(size, rank)):
                model = build(model_class, config)
                with torch.no_grad():
                    for param in model.parameters():
                        param.fill_(float("nan"))
                model.load_weights(iter(tensors.items()))
            unfilled, differ = [], []
            for name, param in model.named_parameters():
                data = param.data
                if name.startswith("visual.") and carried_tower:
                    continue  # a tower the bridge carries (Qwen3.5-MoE's): no sync sends it, the engines keep theirs
                if draft and ("embed_tokens" in name or "lm_head" in name):
                    continue  # the target's own: SGLang's EAGLE worker hands them over (set_embed_and_head)
                if draft:
                    name = checkpoint_name(name, config)
                if "embed_tokens" in name or "lm_head" in name:
                    # SGLang pads the vocabulary; only the rows of real tokens are loaded.
                    data = data[: max(0, vocab - rank * data.shape[0])]
                if torch.isnan(data).any():
                    unfilled.append(name)
                elif name in tensors and "embed_tokens" not in name and "lm_head" not in name:
                    whole = tensors[name]
                    if name.endswith("linear_attn.conv1d.weight") and size > 1:
                        # Gated DeltaNet's convolution: SGLang splits its q, k and v channels each over TP ranks.
                        text = config.get_text_config()
                        keys = text.linear_num_key_heads * text.linear_key_head_dim
                        whole = torch.cat([part.chunk(size)[rank] for part in whole.split(
                            [keys, keys, text.linear_num_value_heads * text.linear_value_head_dim])])
                    if whole.shape != param.shape:  # a TP slice along the dim whose size differs
                        dim = next(d for d, (a, b) in enumerate(zip(whole.shape, param.shape)) if a != b)
                        whole = whole.chunk(size, dim)[rank]
                    if not torch.equal(whole.to(param.dtype), param.data):
                        differ.append(name)
            report[f"tp{size}.rank{rank}"] = {"unfilled": unfilled, "differ": differ,
                                              "parameters": len(list(model.parameters()))}
    return report


if __name__ == "__main__":
    main()
