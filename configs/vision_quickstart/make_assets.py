"""Regenerates the vision quickstart's shipped assets: a tiny Qwen2.5-VL config (2 decoder layers of width 64, a
1-block vision tower), the char tokenizer with the vision tokens, the image processor, and the task: name the colour
of a solid-colour 8x8 image. Every prompt is the bare image, `<image>`; only the image tells the answer, one
of r, g, b, y. Each image's shade is jittered, so the policy must read the pixels rather than learn a few images."""
import io
import random
from pathlib import Path

from rlmegatron.data.tokenizer import save_tiny_vision_processor

HERE = Path(__file__).parent
COLOURS = {"r": (210, 40, 40), "g": (40, 190, 50), "b": (40, 50, 210), "y": (220, 210, 50)}


def image_rows(count: int, seed: int) -> list[dict]:
    """verl's multimodal rows, each image a {bytes, path} record as HF datasets stores an Image feature."""
    from PIL import Image

    rng = random.Random(seed)
    rows = []
    for index in range(count):
        colour = rng.choice(sorted(COLOURS))
        shade = tuple(min(255, max(0, c + rng.randint(-30, 30))) for c in COLOURS[colour])
        png = io.BytesIO()
        Image.new("RGB", (8, 8), shade).save(png, format="PNG")
        rows.append({"prompt": [{"role": "user", "content": "<image>"}],
                     "images": [{"bytes": png.getvalue(), "path": None}],
                     "data_source": "colour", "reward_model": {"ground_truth": colour},
                     "extra_info": {"index": index}})
    return rows


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import Qwen2_5_VLConfig

    tokenizer = save_tiny_vision_processor(HERE / "model")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|image_pad|>", "<|vision_start|>",
                                                                     "<|vision_end|>")}
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         # 128: the tokenizer's 108 tokens rounded up to Megatron's padding multiple.
                         vocab_size=128, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                           window_size=8),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], video_token_id=tokenizer.unk_token_id,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None)
    config.save_pretrained(str(HERE / "model"))
    for split, count, seed in (("train", 256, 0), ("val", 32, 1)):
        pq.write_table(pa.Table.from_pylist(image_rows(count, seed)), HERE / f"{split}.parquet")


if __name__ == "__main__":
    main()
