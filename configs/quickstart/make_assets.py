"""Regenerates the quickstart's shipped assets: the char tokenizer, a 128-token Qwen3 config (and a Qwen3-MoE one) and
the task, "next digit": the prompt `next:3` asks for the digit after 3, `4` (after 9 comes 0)."""
import json
import random
import string
from pathlib import Path

from rlmegatron.data import build_char_tokenizer, write_jsonl

HERE = Path(__file__).parent
DIGITS = string.digits


def next_digit_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        digit = rng.choice(DIGITS)
        rows.append({
            "prompt": [{"role": "user", "content": f"next:{digit}"}],
            "data_source": "next_digit",
            "reward_model": {"ground_truth": DIGITS[(DIGITS.index(digit) + 1) % len(DIGITS)]},
            "extra_info": {"index": index},
        })
    return rows


def main() -> None:
    tokenizer = build_char_tokenizer()
    # The prompt's text alone, no ChatML turn markers: the digit is the last prompt token. With tied embeddings a
    # randomly initialised model decodes greedily by echoing it, so it scores 0 before training: the successor is a
    # mapping it has to learn, one digit at a time.
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(HERE / "model"))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 2, "torch_dtype": "float32",
        # 128 = the char tokenizer's vocab rounded up to Megatron's padding multiple, so nothing is padded.
        "vocab_size": 128, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    (HERE / "model" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # The same task for a mixture of experts: 3 Qwen3-MoE layers of 8 experts, 2 per token (the EP and routing replay
    # tests, and benchmarks/routing_replay.py).
    tokenizer.save_pretrained(str(HERE / "moe_model"))
    moe = {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 3,
           "max_window_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
           "router_aux_loss_coef": 0.0}
    (HERE / "moe_model" / "config.json").write_text(json.dumps(moe, indent=2) + "\n")
    for name, count, seed in (("train", 2048, 0), ("val", 64, 1)):
        write_jsonl(HERE / f"{name}.jsonl", next_digit_rows(count, seed))


if __name__ == "__main__":
    main()
