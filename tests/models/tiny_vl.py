"""A tiny random-weight Qwen2.5-VL or Qwen3-VL checkpoint saved with transformers' own save_pretrained, and
image+text inputs for it: prompts with a vision_start token, an image's placeholder run and text around it, as the
processor lays them out."""
from __future__ import annotations

import torch

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 190, 191, 192, 193
# 4 decoder layers, so that PP=2 puts 2 on each stage; a 4-pixel patch keeps the pixel rows short; one windowed
# and one full-attention vision block, as Qwen2.5-VL alternates them.
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=200,
            num_hidden_layers=4, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1], window_size=16)
TOP = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
           vision_end_token_id=VISION_END, tie_word_embeddings=False)
PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch: one row of pixel_values
# Qwen3-VL: the same sizes with Qwen3's explicit head size (its default is 128), interleaved M-RoPE; a 4 x 4 learned
# position grid (interpolated to each image's), and DeepStack mergers on tower blocks 0 and 2, whose features are
# added after decoder layers 0 and 1 (both on the first stage at PP=2).
QWEN3_TEXT = dict(TEXT, head_dim=16, rope_parameters={**TEXT["rope_parameters"], "mrope_interleaved": True})
QWEN3_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0, 2])
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def vl_config(model_type: str = "qwen2_5_vl", **text_changes):
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    if model_type == "qwen3_vl":
        return Qwen3VLConfig(text_config={**QWEN3_TEXT, **text_changes}, vision_config=QWEN3_VISION, **TOP)
    return Qwen2_5_VLConfig(text_config={**TEXT, **text_changes}, vision_config=VISION, **TOP)


def save_tiny_vl(directory: str, seed: int = 0, model_type: str = "qwen2_5_vl", **text_changes) -> str:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(vl_config(model_type, **text_changes)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms and biases: ones and zeros would hide a swapped mapping.
            if param.dim() == 1:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name or "ln_q" in name else 0.0))
    model.save_pretrained(directory)
    return directory


def image_prompts(seed: int = 0):
    """(input_ids [2, 14], pixel values per row, image_grid_thw per row): two prompts of one image each, 4 and 6
    merged tokens (grids 1x4x4 and 1x4x6 patches, the second not a whole number of attention windows)."""
    gen = torch.Generator().manual_seed(seed)
    rows, pixels, grids = [], [], []
    for before, (h, w), after in ((3, (4, 4), 5), (2, (4, 6), 4)):
        text = lambda n: torch.randint(0, IMAGE_TOKEN, (n,), generator=gen).tolist()
        tokens = h * w // 4
        rows.append(text(before) + [VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END] + text(after))
        pixels.append(torch.randn(h * w, PATCH_DIM, generator=gen))
        grids.append(torch.tensor([[1, h, w]]))
    return torch.tensor(rows), pixels, grids


def next_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq-1] log-probability of each next token, as the actor computes them."""
    return torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
