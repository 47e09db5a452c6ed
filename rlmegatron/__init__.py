"""rlmegatron: reinforcement-learning post-training of LLMs on Megatron-Core, with SGLang rollouts."""
from rlmegatron.models import megatron_fusers

__version__ = "0.1.0"

# Before anything of ours imports Megatron-Core: its fusers stay uncompiled on a CPU-only torch (megatron_fusers.py).
megatron_fusers.install()
