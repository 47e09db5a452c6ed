"""Runs SGLang 0.5.23's own block-FP8 weight loading on CPU: argv[1] is a JSON job, {"tensors": a safetensors file
of HF-named weights as FP8 rollout's sync streams them (`weight` + `weight_scale_inv`), "quantization_config": what
the servers are launched with, "layer": {"hidden", "heads", "kv_heads", "head_dim", "intermediate"} of one Qwen3
decoder layer, "tp": TP sizes, "out": a safetensors file, "refused_layer": sizes SGLang should refuse}.

For each TP rank of each TP size it builds that layer's linears as SGLang does (its QKVParallelLinear,
MergedColumnParallelLinear and RowParallelLinear under its Fp8Config; the rank set through SGLang's own
get_parallel().override, which is how its linears learn their TP rank before process groups exist), loads the tensors
through Qwen3ForCausalLM.load_weights (SGLang's name mapping: q/k/v -> qkv_proj, gate/up -> gate_up_proj, the
weight_scale_inv alike, and each rank's slice of weights and scale blocks) and writes each linear's SGLang
dequantisation of what it holds (fp8_utils.block_quant_dequant) as "tp{size}.rank{rank}.{linear}". It prints the
ValueError SGLang raises while building "refused_layer".
"""
from __future__ import annotations

import json
import sys

import gpu_stubs

gpu_stubs.install()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: E402
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant  # noqa: E402
from sglang.srt.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402


class Layer(torch.nn.Module):
    """The linears of decoder layer 0 of a Qwen3 model as SGLang builds them for one TP rank."""

    def __init__(self, config: Fp8Config, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int):
        super().__init__()
        one = dict(quant_config=config, params_dtype=torch.bfloat16, bias=False)
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, **one)
        self.self_attn.o_proj = RowParallelLinear(heads * head_dim, hidden, **one)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, **one)
        self.mlp.down_proj = RowParallelLinear(intermediate, hidden, **one)


class Shell(torch.nn.Module):
    """What Qwen3ForCausalLM.load_weights reads of `self`: its parameters, config and pipeline group."""

    def __init__(self, layer: Layer):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])
        self.config = type("Config", (), {"tie_word_embeddings": False})()
        self.pp_group = type("Group", (), {"is_last_rank": True})()


def main() -> None:
    job = json.loads(sys.argv[1])
    config = Fp8Config.from_config(job["quantization_config"])
    tensors = load_file(job["tensors"])
    out = {}
    for size in job["tp"]:
        for rank in range(size):
            # SGLang's linears read their TP rank and size from this context when they are built.
            with get_parallel().override(tp_group=None, tp_size=size, tp_rank=rank):
                shell = Shell(Layer(config, **job["layer"]))
            Qwen3ForCausalLM.load_weights(shell, tensors.items())
            for name, module in shell.named_modules():
                if hasattr(module, "weight_scale_inv"):
                    out[f"tp{size}.rank{rank}.{name}"] = block_quant_dequant(
                        module.weight.data, module.weight_scale_inv.data, config.weight_block_size, torch.float32)
    save_file(out, job["out"])
    try:
        with get_parallel().override(tp_group=None, tp_size=1, tp_rank=0):
            Layer(config, **job["refused_layer"])
        refused = None
    except ValueError as err:
        refused = str(err)
    print(json.dumps({"refused": refused}))


if __name__ == "__main__":
    main()
