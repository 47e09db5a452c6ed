"""Parameter counts from the shipped config.json files against the totals the model publishers state."""
import math

import pytest
import torch

from rlmegatron.config import read_architecture
from rlmegatron.planner.parameters import count_parameters
from tests.config.specs import MODELS_DIR


@pytest.mark.parametrize(
    "model, total, active",
    [
        # Qwen3 model cards: 1.7B parameters, 1.4B of them outside the (tied) embedding.
        ("qwen3-1.7b", 1.72e9, 1.72e9),
        # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated.
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        # DeepSeek-V3 technical report: 671B total, 37B activated (the 14B MTP module excluded).
        ("deepseek-v3", 671e9, 37e9),
        # Qwen2.5 model card: 0.49B (q/k/v biases, tied embeddings).
        ("qwen2.5-0.5b", 0.49e9, 0.49e9),
        # The step-time model's published runs (benchmarks/step_time_calibration.py): Llama 3.1 8B (8.03B), Qwen3-32B
        # (32.8B), Qwen3-235B-A22B (235B total, 22B activated).
        ("llama-3.1-8b", 8.03e9, 8.03e9),
        ("qwen3-32b", 32.8e9, 32.8e9),
        ("qwen3-235b-a22b", 235e9, 22e9),
        # DeepSeek-V3.2: DeepSeek-V3's 671B plus its lightning indexer (0.85B, which every token runs: counted active,
        # 37.55B + 0.85B; DeepSeek's "37B activated" is V3's figure).
        ("deepseek-v3.2", 671e9, 38.4e9),
    ],
)
def test_counts_match_published_totals_within_2_percent(model, total, active):
    params = count_parameters(read_architecture(MODELS_DIR / model))
    assert params.total == pytest.approx(total, rel=0.02)
    assert params.active == pytest.approx(active, rel=0.02)


def _kimi_k2_release_tensors() -> dict[str, tuple[int, ...]]:
    """Every tensor of Moonshot's Kimi-K2 language model as its checkpoint names it, from the config's sizes: layer 0
    a dense MLP (first_k_dense_replace=1), layers 1-60 MoE (384 routed experts of 2048, one shared, a router and its
    score-correction bias), MLA attention, no MTP layer (num_nextn_predict_layers=0), untied head."""
    h, heads, experts, expert_ffn, vocab = 7168, 64, 384, 2048, 163840
    tensors = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for layer in range(61):
        p = f"model.layers.{layer}."
        tensors.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.q_a_proj.weight": (1536, h), p + "self_attn.q_a_layernorm.weight": (1536,),
                        p + "self_attn.q_b_proj.weight": (heads * (128 + 64), 1536),
                        p + "self_attn.kv_a_proj_with_mqa.weight": (512 + 64, h),
                        p + "self_attn.kv_a_layernorm.weight": (512,),
                        p + "self_attn.kv_b_proj.weight": (heads * (128 + 128), 512),
                        p + "self_attn.o_proj.weight": (h, heads * 128)})
        mlps = {"mlp.": 18432} if layer == 0 else {
            **{f"mlp.experts.{e}.": expert_ffn for e in range(experts)}, "mlp.shared_experts.": expert_ffn}
        for mlp, ffn in mlps.items():
            tensors.update({p + mlp + "gate_proj.weight": (ffn, h), p + mlp + "up_proj.weight": (ffn, h),
                            p + mlp + "down_proj.weight": (h, ffn)})
        if layer:
            tensors.update({p + "mlp.gate.weight": (experts, h), p + "mlp.gate.e_score_correction_bias": (experts,)})
    return tensors


def test_kimi_k2p5_count_reproduces_the_released_checkpoints_census():
    # Three totals are published for this language model: the model card's "1T", the Kimi-K2 report's "1.04T", and
    # the Hugging Face page's "1.03T params", which is the released checkpoint's own census: Kimi-K2-Instruct's
    # model.safetensors.index.json has total_size 1,029,173,256,720 bytes over 139,644 tensors (fetched 2026-08-07,
    # index sha256 5f26b4ba...). The count is checked against that census, tensor for tensor: the release is
    # DeepSeek-V3's block FP8 (1-byte e4m3 weights with float32 128x128 scales, in exactly the tensors
    # models/fp8.py quantises), bf16 elsewhere, the routers' score-correction biases float32.
    # The report's 1.04T is the same arithmetic with layer 0 an MoE layer too (1042.97B); the config makes it dense.
    from rlmegatron.models.fp8 import DEFAULT as block_fp8

    params = count_parameters(read_architecture(MODELS_DIR / "kimi-k2.5"))
    tensors = _kimi_k2_release_tensors()
    assert params.total == sum(math.prod(shape) for shape in tensors.values()) == 1_026_408_232_448
    size = 0
    for name, shape in tensors.items():
        if block_fp8.quantises(name):
            size += math.prod(shape) + 4 * math.prod(block_fp8.scale_shape(shape))
        else:
            size += math.prod(shape) * (4 if name.endswith("e_score_correction_bias") else 2)
    # 6,832 bytes short of the index (7e-9 of it): 61 tensors too few, one of 112 bytes per layer that the index
    # lists and that is not a weight of the config (the index alone does not name it; nothing loads it).
    assert size == 1_029_173_256_720 - 6_832
    assert len(tensors) + sum(block_fp8.quantises(name) for name in tensors) == 139_644 - 61
    assert params.total == pytest.approx(1.03e12, rel=0.005)  # the checkpoint's published 1.03T
    dense_layer, moe_layer = params.layers[0], params.layers[1]
    assert params.total - dense_layer.total + moe_layer.total == pytest.approx(1.04e12, rel=0.003)  # the report's
    assert params.active == pytest.approx(32.6e9, rel=0.01)


def test_gpt_oss_120b_counts_openais_116p83b_and_5p13b_active_with_the_head_but_not_the_embedding():
    # OpenAI's model card: 116.83B total, 5.13B active, the active count taking the unembedding but not the
    # embedding; the biases, the sinks and the router biases are all in the total.
    params = count_parameters(read_architecture(MODELS_DIR / "gpt-oss-120b"))
    assert params.total == pytest.approx(116.83e9, rel=0.001)
    assert params.active - params.embedding == pytest.approx(5.13e9, rel=0.005)


def test_minimax_m2_counts_its_published_230b_and_10b_active_without_embedding_and_head():
    # MiniMax's model card: 230B total, 10B activated (embedding and head left out of the latter); its query/key norms
    # span all heads (48 x 128 and 8 x 128 per layer).
    params = count_parameters(read_architecture(MODELS_DIR / "minimax-m2"))
    assert params.total == pytest.approx(230e9, rel=0.01)
    assert params.active - params.embedding - params.output_layer == pytest.approx(10e9, rel=0.03)


def test_qwen3_5_397b_counts_the_published_397b_and_17b_active_with_gated_deltanet_layers():
    # Qwen's model card: 397B total, 17B activated. Counted: the language model, 396.35B (its 45 Gated DeltaNet
    # layers by their own projections, the 15 attention layers with q_proj's output gate); the card's total also has
    # the 0.41B vision tower, which is carried, not trained, and not counted.
    params = count_parameters(read_architecture(MODELS_DIR / "qwen3.5-397b-a17b"))
    assert params.total == pytest.approx(397e9, rel=0.01)
    assert params.active == pytest.approx(17e9, rel=0.03)


def test_qwen3_next_80b_counts_the_published_80b_and_3b_activated_without_embedding_and_head():
    # Qwen's model card: 80B total, 3B activated. Counted 79.67B and 3.25B active besides the embedding and head
    # (the card's "A3B" rounds it); 36 Gated DeltaNet layers of 16 key / 32 value heads, 12 gated attention layers.
    params = count_parameters(read_architecture(MODELS_DIR / "qwen3-next-80b-a3b"))
    assert params.total == pytest.approx(80e9, rel=0.01)
    assert params.active - params.embedding - params.output_layer == pytest.approx(3e9, rel=0.1)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_a_hybrid_family_counts_every_weight_transformers_builds(family):
    """The count of a tiny Qwen3-Next / Qwen3.5-MoE (Gated DeltaNet, gated attention, a shared expert)
    equals the parameters of transformers' model of it, its vision tower left out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlmegatron.models.families import architecture_of
    from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS, NESTED

    config = {"model_type": family, **({} if family in NESTED else COMMON), **FAMILY_CONFIGS[family]}
    auto = AutoModelForImageTextToText if family in NESTED else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(AutoConfig.for_model(**config))
    built = sum(p.numel() for name, p in model.named_parameters() if "visual" not in name)
    assert count_parameters(architecture_of(config)).total == built


def test_qwen3_1p7b_checkpoint_holds_2p03b_because_it_saves_the_tied_head():
    # The hub lists 2.03B for Qwen3-1.7B: its safetensors store lm_head next to the tied embedding.
    arch = read_architecture(MODELS_DIR / "qwen3-1.7b")
    params = count_parameters(arch)
    assert params.in_checkpoint(arch.tie_word_embeddings) == pytest.approx(2.03e9, rel=0.02)
    non_embedding = params.total - params.embedding - params.final_norm
    assert non_embedding == pytest.approx(1.4e9, rel=0.02)


def test_deepseek_first_three_layers_are_dense_and_experts_dominate():
    params = count_parameters(read_architecture(MODELS_DIR / "deepseek-v3"))
    assert [layer.routed_experts == 0 for layer in params.layers[:4]] == [True, True, True, False]
    assert params.routed_experts / params.total > 0.97


def test_tiny_moe_count_by_hand():
    # hidden 64, 4 heads × 16 (2 KV heads), q/k norms, 8 experts of width 32, vocab 256 untied.
    params = count_parameters(read_architecture(MODELS_DIR / "tiny-qwen3-moe"))
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16
    layer = attention + 8 * 64 + 2 * 64 + 8 * 3 * 64 * 32
    assert params.total == 4 * layer + 2 * 256 * 64 + 64


def test_qwen2p5_vl_7b_counts_its_published_8p29b_with_the_vision_tower():
    # Qwen2.5-VL-7B-Instruct's hub page: 8.29B parameters; its ViT (32 blocks of 1280, merger to 3584) is 0.68B.
    params = count_parameters(read_architecture(MODELS_DIR / "qwen2.5-vl-7b"))
    assert params.total == pytest.approx(8.29e9, rel=0.005)
    assert params.vision == pytest.approx(0.676e9, rel=0.01)


def test_qwen3_vl_8b_counts_the_tower_transformers_builds_with_its_deepstack_mergers():
    # Qwen3-VL-8B-Instruct: 8.77B parameters; its tower (27 blocks of 1152, a learned position grid, the merger and
    # 3 DeepStack mergers to 4096) is the one transformers builds from its vision_config, to the parameter.
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    params = count_parameters(read_architecture(MODELS_DIR / "qwen3-vl-8b"))
    with torch.device("meta"):
        tower = Qwen3VLVisionModel._from_config(AutoConfig.from_pretrained(MODELS_DIR / "qwen3-vl-8b").vision_config)
    assert params.vision == sum(p.numel() for p in tower.parameters()) == 576_388_336
    assert params.total == pytest.approx(8.77e9, rel=0.005)
