"""Prompt datasets: typed records, verl-format reading, resumable batching, and dataset preparation."""
from rlmegatron.data.dataset import DatasetError, PromptDataset, PromptEncoder, RLDataset, build_dataset, write_jsonl
from rlmegatron.plugins import PluginError, load_plugin
from rlmegatron.data.records import Sample
from rlmegatron.data.sampler import PromptDataLoader, ResumableBatchSampler, SamplerState
from rlmegatron.data.tokenizer import build_char_tokenizer

__all__ = [
    "DatasetError",
    "PluginError",
    "PromptDataLoader",
    "PromptDataset",
    "PromptEncoder",
    "RLDataset",
    "ResumableBatchSampler",
    "Sample",
    "SamplerState",
    "build_char_tokenizer",
    "build_dataset",
    "load_plugin",
    "write_jsonl",
]
