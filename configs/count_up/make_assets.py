"""Regenerates the count-up task's shipped assets: the quickstart's char tokenizer, a tiny DeepSeek-V3 config with one
multi-token-prediction (MTP) layer, and the task: the prompt `count:3` asks for the 8 digits that follow 3, counting
up, `45678901` (after 9 comes 0). Each answer token is the successor of the one before, the quickstart's mapping
8 times over, so a policy that learns it makes the token two places ahead predictable too: what the MTP layer drafts
in speculative rollout (benchmarks/mtp_speculative.py)."""
import json
import random
import string
from pathlib import Path

from rlmegatron.data import build_char_tokenizer, write_jsonl

HERE = Path(__file__).parent
DIGITS = string.digits
LENGTH = 8


def count_up(digit: str) -> str:
    start = DIGITS.index(digit)
    return "".join(DIGITS[(start + k) % len(DIGITS)] for k in range(1, LENGTH + 1))


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        digit = rng.choice(DIGITS)
        out.append({"prompt": [{"role": "user", "content": f"count:{digit}"}], "data_source": "count_up",
                    "reward_model": {"ground_truth": count_up(digit)}, "extra_info": {"index": index}})
    return out


def main() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the bare prompt
    tokenizer.save_pretrained(str(HERE / "model"))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
        # Layer 0 dense, layer 1 and the MTP layer MoE: 4 routed experts (top-2) and a shared one.
        "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": "float32",
        # 128 = the char tokenizer's vocab rounded up to Megatron's padding multiple, so nothing is padded.
        "vocab_size": 128, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    (HERE / "model" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, count, seed in (("train", 2048, 0), ("val", 64, 1)):
        write_jsonl(HERE / f"{name}.jsonl", rows(count, seed))


if __name__ == "__main__":
    main()
