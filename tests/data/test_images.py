"""verl's multimodal rows (an `images` column of bytes, paths or {bytes, path} records, `<image>` in the prompt)
through the model's image processor: the prompt's placeholder runs match the processor's grids, and a bad image
is one line naming the row and the fix."""
from __future__ import annotations

import json

import pytest

from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
from rlmegatron.data import build_dataset
from rlmegatron.data.images import ImageError
from rlmegatron.errors import UserError
from tests.config.specs import minimal_spec
from tests.data.vision_assets import make_vl_model_dir, png


def _data_config(**changes):
    return spec_from_raw(minimal_spec(), [f"data.{k}={v}" for k, v in changes.items()]).data


def _rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _row(content, images, answer="r"):
    return {"prompt": [{"role": "user", "content": content}], "images": images,
            "reward_model": {"ground_truth": answer}}


@pytest.fixture()
def model_dir(tmp_path):
    directory = tmp_path / "model"
    return directory, make_vl_model_dir(directory)


def test_images_as_paths_and_records_become_one_placeholder_token_per_merged_patch(tmp_path, model_dir):
    directory, tokenizer = model_dir
    (tmp_path / "red.png").write_bytes(png("r", (16, 8)))  # 4x2 patches: 2 merged tokens
    data = _rows(tmp_path / "train.jsonl", [_row("<image>colour:", ["red.png"]),
                                           _row("a<image>b<image>", [{"path": str(tmp_path / "red.png")},
                                                                     {"bytes": None, "path": "red.png"}])])
    dataset = build_dataset([data], tokenizer, _data_config(max_prompt_length=64), str(directory))
    pad, start = tokenizer.convert_tokens_to_ids("<|image_pad|>"), tokenizer.convert_tokens_to_ids("<|vision_start|>")
    first, second = dataset[0], dataset[1]
    assert first.images.grids == ((1, 2, 4),) and first.prompt_ids.count(pad) == 2
    assert first.prompt_ids[0] == start and tokenizer.decode(first.prompt_ids[4:]) == "colour:"
    assert second.images.grids == ((1, 2, 4),) * 2 and second.prompt_ids.count(pad) == 4
    assert first.images.data[0] == (tmp_path / "red.png").read_bytes()
    assert first.prompt == [{"role": "user", "content": "<image>colour:"}]  # the row's prompt, as verl keeps it


def test_a_row_without_images_stays_text_only(tmp_path, model_dir):
    directory, tokenizer = model_dir
    data = _rows(tmp_path / "train.jsonl", [{"prompt": [{"role": "user", "content": "hi"}],
                                            "reward_model": {"ground_truth": "x"}}])
    (sample,) = build_dataset([data], tokenizer, _data_config(), str(directory)).samples
    assert sample.images is None and tokenizer.decode(sample.prompt_ids) == "hi"


BAD = [
    ("missing file", [_row("<image>", ["nowhere.png"])], "image 0 (", "fix the path"),
    ("undecodable bytes", "garbage", "image 0 cannot be decoded", "replace it with a PNG or JPEG"),
    ("too many pixels", "huge", "image 0 is 100x100 = 10000 pixels, over data.max_image_pixels=5000",
     "raise data.max_image_pixels"),
    ("marks and images disagree", [_row("<image><image>", ["a.png"])], "2 <image> marks but 'images' holds 1",
     "put one <image>"),
]


@pytest.mark.parametrize("case, rows, says, fix", BAD, ids=[case for case, *_ in BAD])
def test_a_bad_image_is_one_line_naming_the_row_and_the_fix(tmp_path, model_dir, case, rows, says, fix):
    directory, tokenizer = model_dir
    (tmp_path / "a.png").write_bytes(png("g"))
    if rows == "garbage":
        (tmp_path / "bad.png").write_bytes(b"not an image at all")
        rows = [_row("<image>", ["a.png"]), _row("<image>", ["bad.png"])]
    elif rows == "huge":
        (tmp_path / "big.png").write_bytes(png("b", (100, 100)))
        rows = [_row("<image>", ["a.png"]), _row("<image>", ["big.png"])]
    data = _rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(ImageError) as refused:
        build_dataset([data], tokenizer, _data_config(max_image_pixels=5000), str(directory))
    message = str(refused.value)
    line = 2 if case in ("undecodable bytes", "too many pixels") else 1
    assert message.startswith(f"{data}:{line}: ") and says in message and fix in message and "\n" not in message
    assert isinstance(refused.value, UserError)  # the CLI prints it as one line and exits 2


def test_images_need_a_model_with_an_image_processor(tmp_path, model_dir):
    _, tokenizer = model_dir
    (tmp_path / "a.png").write_bytes(png("g"))
    data = _rows(tmp_path / "train.jsonl", [_row("<image>", ["a.png"])])
    with pytest.raises(ImageError, match=r"train.jsonl:1: .*no image processor .*train a vision-language model"):
        build_dataset([data], tokenizer, _data_config(), str(tmp_path / "text-only"))


def test_images_for_a_model_whose_tower_is_carried_not_bridged_are_one_line(tmp_path, model_dir):
    """Qwen3.5-MoE ships an image processor, but its vision tower is carried, never run: its rows may not have images."""
    from tests.models.tiny_hf import FAMILY_CONFIGS

    directory, tokenizer = model_dir
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", **FAMILY_CONFIGS["qwen3_5_moe"]}))
    (tmp_path / "a.png").write_bytes(png("g"))
    data = _rows(tmp_path / "train.jsonl", [_row("<image>", ["a.png"])])
    with pytest.raises(ImageError, match=r"train.jsonl:1: .*image encoder \(qwen3_5_moe\) is not bridged: it trains on "
                                         r"text; drop the images"):
        build_dataset([data], tokenizer, _data_config(), str(directory))


def test_data_image_key_names_the_images_column(tmp_path, model_dir):
    directory, tokenizer = model_dir
    (tmp_path / "a.png").write_bytes(png("g"))
    row = {"prompt": [{"role": "user", "content": "<image>"}], "pictures": ["a.png"],
           "reward_model": {"ground_truth": "g"}}
    data = _rows(tmp_path / "train.jsonl", [row])
    (sample,) = build_dataset([data], tokenizer, _data_config(image_key="pictures"), str(directory)).samples
    assert sample.images.grids == ((1, 2, 2),)
    with pytest.raises(ImageError, match="1 <image> marks but 'images' holds 0"):
        build_dataset([data], tokenizer, _data_config(), str(directory))
