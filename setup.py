"""rlmegatron: Megatron-Core-centric RL post-training for LLMs (dense and MoE)."""
from setuptools import find_packages, setup

# torch is pinned to a CPU wheel by the README/.ci install path on CPU machines;
# here it is only a range so GPU clusters can bring their own CUDA build.
CORE = [
    "torch>=2.6",
    "megatron-core>=0.16,<0.20",
    "ray[default]>=2.40",  # [default]: the dashboard that `ray job submit` (launch/submit.sh) talks to
    "pydantic>=2.5,<3",
    "pyyaml>=6",
    "mlflow>=2.15",
    "transformers>=4.51",
    "safetensors>=0.4",
    "psutil>=5.9",  # megatron.core.dist_checkpointing needs it
    "pyarrow>=14",  # parquet datasets
]

setup(
    name="rlmegatron",
    version="0.1.0",
    description="Reinforcement learning for LLMs on Megatron-Core with SGLang rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["rlmegatron", "rlmegatron.*"]),
    install_requires=CORE,
    extras_require={
        # NVIDIA Apex is an optional GPU build from source (see README); the PyPI
        # package named "apex" is unrelated and must never be listed here.
        "gpu": ["transformer-engine[pytorch]>=2.4", "sglang>=0.5", "sglang-router>=0.1"],
        # peft: the LoRA export parity tests; pytest-xdist: the suite's two workers (README's test command)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "peft>=0.21", "pytest-xdist>=3.8"],
    },
    entry_points={"console_scripts": ["rlm=rlmegatron.cli:main"]},
)
