"""The built-in dataset: verl's chat rows and plain prompt/answer rows, parquet and jsonl, chat templating, the
ground truth's key, overlong filtering, custom classes."""
import json
import logging
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlmegatron.config.spec import DataConfig
from rlmegatron.data import DatasetError, RLDataset, Sample, build_dataset


def verl_row(question, answer, index):
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index},
    }


ROWS = [verl_row("1+1?", "2", 0), verl_row("2+3?", "5", 1), verl_row("x" * 200, "0", 2)]


def data_config(files, **fields):
    return DataConfig(train_files=[str(f) for f in files], **fields)


@pytest.fixture
def jsonl_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.mark.parametrize("file_fixture", ["jsonl_file", "parquet_file"])
def test_rows_become_chat_templated_samples(file_fixture, request, tokenizer):
    file = request.getfixturevalue(file_fixture)
    dataset = RLDataset([str(file)], tokenizer, data_config([file]))
    assert len(dataset) == 3
    sample = dataset[1]
    assert isinstance(sample, Sample)
    assert sample.prompt == [{"role": "user", "content": "2+3?"}]
    assert sample.ground_truth == "5" and sample.data_source == "openai/gsm8k"
    assert sample.sample_id == "openai/gsm8k#1"
    expected = tokenizer.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(sample.prompt_ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")


def test_overlong_prompts_are_dropped_and_counted(jsonl_file, tokenizer, caplog):
    config = data_config([jsonl_file], max_prompt_length=64, filter_overlong_prompts=True)
    with caplog.at_level(logging.WARNING, logger="rlmegatron.data.dataset"):
        dataset = RLDataset([str(jsonl_file)], tokenizer, config)
    assert len(dataset) == 2 and dataset.num_filtered_overlong == 1
    assert [s.index for s in dataset.samples] == [0, 1]
    assert "dropped 1 of 3 prompts longer than data.max_prompt_length=64" in caplog.text
    assert f"{jsonl_file}:3" in caplog.text


def test_overlong_prompts_reject_the_dataset_unless_filtering(jsonl_file, tokenizer):
    with pytest.raises(DatasetError, match=r"train.jsonl:3 \(\d+ tokens\): 1 prompts exceed"):
        RLDataset([str(jsonl_file)], tokenizer, data_config([jsonl_file], max_prompt_length=64))


def test_the_prompt_is_read_from_data_prompt_key(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    rows = [{("question" if key == "prompt" else key): value for key, value in row.items()} for row in ROWS[:2]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = build_dataset([str(path)], tokenizer, data_config([path], prompt_key="question"))
    assert [sample.prompt for sample in dataset] == [row["question"] for row in rows]
    with pytest.raises(DatasetError, match="no 'prompt' key .*; set data.prompt_key"):
        build_dataset([str(path)], tokenizer, data_config([path]))


PLAIN_ROWS = [{"prompt": "copy: k=", "answer": "k"}, {"prompt": "copy: q=", "answer": "q"}]


def test_plain_prompts_are_tokenized_as_they_are_with_data_prompt_format_plain(tmp_path, tokenizer):
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PLAIN_ROWS))
    plain = build_dataset([str(path)], tokenizer, data_config([path], prompt_format="plain", answer_key="answer"))
    assert [s.prompt for s in plain] == ["copy: k=", "copy: q="]
    # The text's own characters, no chat turn around them (the char tokenizer adds no BOS).
    assert plain[0].prompt_ids == tokenizer("copy: k=", add_special_tokens=False)["input_ids"]
    assert len(plain[0].prompt_ids) == len("copy: k=")
    assert [s.ground_truth for s in plain] == ["k", "q"]
    # The same rows as chat (the default) are refused, naming the row and the option.
    with pytest.raises(DatasetError, match=r"plain.jsonl:1: 'prompt' must be a non-empty list of chat messages .*; a "
                                           r"plain text prompt needs data.prompt_format=plain$"):
        build_dataset([str(path)], tokenizer, data_config([path], answer_key="answer"))
    # And chat rows read as plain are refused too.
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DatasetError, match=r"chat.jsonl:1: 'prompt' must be a non-empty text with "
                                           r"data.prompt_format=plain, got list; chat messages need "
                                           r"data.prompt_format=chat$"):
        build_dataset([str(chat)], tokenizer, data_config([chat], prompt_format="plain"))


def test_the_ground_truth_is_read_from_data_answer_key(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    rows = [{**row, "label": {"value": row["reward_model"]["ground_truth"] + "!"}} for row in ROWS[:2]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [s.ground_truth for s in build_dataset([str(path)], tokenizer, data_config([path]))] == ["2", "5"]
    nested = build_dataset([str(path)], tokenizer, data_config([path], answer_key="label.value"))
    assert [s.ground_truth for s in nested] == ["2!", "5!"]
    with pytest.raises(DatasetError, match=r"train.jsonl:1: no ground truth at data.answer_key=label.answer \(label "
                                           r"has 'value'\); set data.answer_key to the dotted key that holds it$"):
        build_dataset([str(path)], tokenizer, data_config([path], answer_key="label.answer"))
    with pytest.raises(DatasetError, match=r"train.jsonl:1: no ground truth at data.answer_key=answer \(the row has "
                                           r"'data_source', 'prompt', 'reward_model', 'extra_info', 'label'\)"):
        build_dataset([str(path)], tokenizer, data_config([path], answer_key="answer"))


def test_malformed_lines_name_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        RLDataset([str(path)], tokenizer, data_config([path]))
    path.write_text(json.dumps({"question": "no messages"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: no 'prompt' key \(it has 'question'\); set data.prompt_key"):
        RLDataset([str(path)], tokenizer, data_config([path]))
    path.write_text(json.dumps({"prompt": "not a list of messages"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: 'prompt' must be a non-empty list of chat messages"):
        RLDataset([str(path)], tokenizer, data_config([path]))


def test_custom_dataset_class_is_loaded_from_file_and_gets_the_same_arguments(tmp_path, jsonl_file, tokenizer):
    plugin = tmp_path / "my_dataset.py"
    plugin.write_text(textwrap.dedent("""
        from rlmegatron.data import RLDataset

        class ReversedDataset(RLDataset):
            def __init__(self, files, tokenizer, config):
                super().__init__(files, tokenizer, config)
                self.samples.reverse()
    """))
    config = data_config([jsonl_file], dataset_class=f"{plugin}:ReversedDataset")
    dataset = build_dataset(config.train_files, tokenizer, config)
    assert type(dataset).__name__ == "ReversedDataset"
    assert [s.ground_truth for s in dataset.samples] == ["0", "5", "2"]


def _tokenizer_adding_bos(template: str):
    """The char tokenizer plus a BOS its post-processor puts before every text, as Llama-style tokenizers do."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from rlmegatron.data.tokenizer import build_char_tokenizer

    core = build_char_tokenizer().backend_tokenizer
    core.add_special_tokens(["<s>"])
    bos = core.token_to_id("<s>")
    core.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>",
                                        chat_template=template)
    assert tokenizer("a", add_special_tokens=True)["input_ids"][0] == bos
    return tokenizer, bos


@pytest.mark.parametrize("template, prompt", [
    ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", [{"role": "user", "content": "hi"}]),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", [{"role": "user", "content": "hi"}]),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "hi"),
], ids=["template-writes-bos", "template-without-bos", "plain-text"])
def test_a_tokenizer_that_adds_bos_gets_exactly_one(template, prompt):
    from rlmegatron.data import PromptEncoder

    tokenizer, bos = _tokenizer_adding_bos(template)
    ids = PromptEncoder(tokenizer, chat=isinstance(prompt, list))(prompt)
    assert ids == [bos, *tokenizer("hi", add_special_tokens=False)["input_ids"]]


def test_a_tokenizer_without_bos_gets_none(tokenizer):
    from rlmegatron.data import PromptEncoder

    ids = PromptEncoder(tokenizer)([{"role": "user", "content": "hi"}])
    assert ids == tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"]
