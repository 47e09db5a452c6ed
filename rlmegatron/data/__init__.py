"""Prompt datasets: typed records, verl-format reading, resumable batching, and dataset preparation."""
from rlmegatron.data.dataset import DatasetError, PromptDataset, RLDataset, build_dataset, templated_prompt_ids
from rlmegatron.plugins import PluginError, load_plugin
from rlmegatron.data.records import Sample
from rlmegatron.data.sampler import PromptDataLoader, ResumableBatchSampler, SamplerState
from rlmegatron.data.tokenizer import build_char_tokenizer

__all__ = [
    "DatasetError",
    "PluginError",
    "PromptDataLoader",
    "PromptDataset",
    "RLDataset",
    "ResumableBatchSampler",
    "Sample",
    "SamplerState",
    "build_char_tokenizer",
    "build_dataset",
    "load_plugin",
    "templated_prompt_ids",
]
