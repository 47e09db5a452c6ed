"""Regenerates the quickstart's shipped assets: the char tokenizer, a 128-token Qwen3 config and the echo task."""
import json
import random
import string
from pathlib import Path

from rlmegatron.data import build_char_tokenizer

HERE = Path(__file__).parent
ALPHABET = string.digits + string.ascii_lowercase


def echo_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        answer = rng.choice(ALPHABET)
        rows.append({
            "prompt": [{"role": "user", "content": f"echo:{answer}"}],
            "data_source": "echo",
            "reward_model": {"ground_truth": answer},
            "extra_info": {"index": index},
        })
    return rows


def main() -> None:
    tokenizer = build_char_tokenizer()
    # The prompt's text alone, no ChatML turn markers: the digit to echo is then the last prompt token, which
    # a randomly initialised 80k-parameter model learns to copy within minutes on two CPU cores.
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
    for name, count, seed in (("train", 2048, 0), ("val", 64, 1)):
        with open(HERE / f"{name}.jsonl", "w") as out:
            out.writelines(json.dumps(row) + "\n" for row in echo_rows(count, seed))


if __name__ == "__main__":
    main()
