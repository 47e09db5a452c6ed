"""Regenerates the tool_lookup task's shipped assets: a 23-token tokenizer whose tool calls are single tokens, a tiny
Qwen3 config and the task. The prompt is a key (`b`); each row has its own table of four keys to random digits, which
only the `lookup` tool can read (tools.py), so the answer, table[key], cannot be guessed better than 1 in 10 without
the call. The chat template is the messages' text alone (as the quickstart's): the tool's answer is the last token
the model sees before its own answer. Run: python configs/tool_lookup/make_assets.py"""
import json
import random
from pathlib import Path

from rlmegatron.data import write_jsonl

HERE = Path(__file__).parent
KEYS = "abcd"
DIGITS = "0123456789"
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
# One token per whole Hermes call, so a tiny random model can find the call (1 token in 26) before it learns it.
CALLS = [f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>' for key in KEYS]
CHARS = [*DIGITS, *KEYS, "\n", " "]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CALLS, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(token, normalized=False) for token in CALLS])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        table = {key: rng.choice(DIGITS) for key in KEYS}
        key = rng.choice(KEYS)
        out.append({"prompt": [{"role": "user", "content": key}], "data_source": "tool_lookup",
                    "reward_model": {"ground_truth": table[key]},
                    "extra_info": {"index": index, "key": key, "table": table}})
    return out


def main() -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(HERE / "model"))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 2, "torch_dtype": "float32", "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
    }
    (HERE / "model" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, count, seed in (("train", 2048, 0), ("val", 64, 1)):
        write_jsonl(HERE / f"{name}.jsonl", rows(count, seed))
    stops = [tokenizer.convert_tokens_to_ids(t) for t in [*CALLS, *DIGITS, "<|im_end|>"]]
    print("rollout.stop_token_ids:", stops)


if __name__ == "__main__":
    main()
