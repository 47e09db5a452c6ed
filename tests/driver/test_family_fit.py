"""`rlm train` on the quickstart task for the MoE families added for issue 44, each a tiny random model of its family
(the quickstart's tokenizer, `model.path` a directory holding only its config.json and tokenizer): 20 steps at
EP=2 with routing replay (r3) and the on-policy check, which holds only if the engine computes what the actor does;
gpt-oss for 60 steps, in which it learns the task (validation from near 0 to 0.8 or more)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.driver.test_moe_fit import RUN, STEPS, train, validation_scores
from tests.models.tiny_hf import as_kimi_releases_it

QUICKSTART_MOE = Path(__file__).resolve().parents[2] / "configs" / "quickstart" / "moe_model"
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
             vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=4,
             bos_token_id=None, tie_word_embeddings=False, initializer_range=0.02)
DEEPSEEK_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1, num_nextn_predict_layers=0,
                    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
QWEN_HYBRID = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
FAMILY_CONFIGS = {
    "minimax_m2": dict(architectures=["MiniMaxM2ForCausalLM"], **SIZES, num_local_experts=8, num_experts_per_tok=2,
                       intermediate_size=32, rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True,
                       use_qk_norm=True, rope_theta=10000.0),
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], **SIZES, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0)),
    # Each query attends to the 8 keys its indexer picks (prompts and responses are longer than that).
    "deepseek_v32": {"architectures": ["DeepseekV32ForCausalLM"], **{k: v for k, v in SIZES.items() if k != "head_dim"},
                     **DEEPSEEK_MOE, "num_key_value_heads": 4, "index_topk": 8, "index_head_dim": 16,
                     "index_n_heads": 4},
    "glm_moe_dsa": {"architectures": ["GlmMoeDsaForCausalLM"], **{k: v for k, v in SIZES.items() if k != "head_dim"},
                    **DEEPSEEK_MOE, "num_key_value_heads": 4, "index_topk": 8, "index_head_dim": 16,
                    "index_n_heads": 4, "n_group": 1, "topk_group": 1},
    # The language model in text_config, a MoonViT tower beside it (carried, never trained).
    "kimi_k25": dict(architectures=["KimiK25ForConditionalGeneration"], tie_word_embeddings=False,
                     pad_token_id=0, eos_token_id=4, bos_token_id=None,
                     # MLA: no head_dim (transformers takes the rotary part's, qk_rope_head_dim)
                     text_config={"model_type": "kimi_k2", **{k: v for k, v in SIZES.items() if k != "head_dim"},
                                  **DEEPSEEK_MOE, "num_key_value_heads": 4},
                     vision_config=dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                        intermediate_size=48, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
                     projection_hidden_size=32),
    # Gated DeltaNet on layers 0 and 2, gated full attention on 1 and 3; a shared expert behind its gate.
    "qwen3_next": dict(architectures=["Qwen3NextForCausalLM"], **SIZES, **QWEN_HYBRID),
    # The same decoder in text_config, a vision tower beside it (carried, never trained).
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForConditionalGeneration"], tie_word_embeddings=False,
                        pad_token_id=0, eos_token_id=4, bos_token_id=None,
                        text_config={"model_type": "qwen3_5_moe_text", **SIZES, **QWEN_HYBRID},
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                           out_hidden_size=64, patch_size=4, num_position_embeddings=16)),
}


# Families that must learn the quickstart's task, not only train: validation from near 0 to 0.8 or more.
LEARNS = ("gpt_oss", "qwen3_5_moe")
LEARNING_STEPS = 60


def tiny_model(directory: Path, model_type: str) -> Path:
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QUICKSTART_MOE / name, directory / name)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, **FAMILY_CONFIGS[model_type]}))
    return directory


def with_weights(directory: Path) -> dict:
    """Random weights saved beside the config (as the family's checkpoints are named); the saved tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(directory)
    AutoModelForImageTextToText.from_config(config).save_pretrained(directory)
    if config.model_type == "kimi_k25":
        as_kimi_releases_it(str(directory))
    return load_file(directory / "model.safetensors")


@pytest.mark.parametrize("model_type", FAMILY_CONFIGS)
def test_a_tiny_model_of_the_family_trains_twenty_steps_at_ep2_on_policy(tmp_path, model_type):
    import torch
    from safetensors.torch import load_file

    from rlmegatron.models.families import FAMILIES

    model = tiny_model(tmp_path / model_type, model_type)
    family = FAMILIES[model_type]
    # A vision-language family whose tower the bridge carries as it is starts from a checkpoint: the policy it exports
    # must have the tower.
    saved = with_weights(model) if "vision_config" in FAMILY_CONFIGS[model_type] else {}
    steps = LEARNING_STEPS if model_type in LEARNS else STEPS
    run = train(tmp_path, "run", f"model.path={model}", *RUN, "actor.megatron.expert_model_parallel_size=2",
                "actor.moe.routing_replay=r3", "trainer.on_policy_check=1e-5", "trainer.log_freq=1",
                f"trainer.total_steps={steps}", f"trainer.test_freq={steps}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"trained steps 1-{steps} ({steps} steps)" in run.stdout
    if model_type in LEARNS:
        before, after = validation_scores(run.stdout)
        assert before < 0.2 and after >= 0.8, (before, after)
    if saved:
        exported = {}
        for shard in (tmp_path / "run" / "hf_policy").glob("*.safetensors"):
            exported.update(load_file(shard))
        carried = [key for key in saved if family.carries(key)]
        assert carried and all(torch.equal(exported[key], saved[key]) for key in carried)
        assert exported.keys() == saved.keys()
