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
    # curves.png at the end of a run and `rlm report`; mlflow already requires it, so it adds nothing to the install.
    "matplotlib>=3.5",
    "transformers>=4.51",
    "safetensors>=0.4",
    "psutil>=5.9",  # megatron.core.dist_checkpointing needs it
    "pyarrow>=14",  # parquet datasets
    "pillow>=9",  # the images of vision-language datasets (data/images.py); matplotlib already requires it
    "packaging>=23",  # the SGLang server's version, checked against SGLANG_RANGE
]

# The SGLang versions whose protocol the client speaks (rlmegatron.rollout.sglang.client.SUPPORTED_SGLANG says the same).
SGLANG_RANGE = "sglang>=0.5.10,<=0.5.23"
# SGLang's own server code runs in the tests (tests/rollout/sglang_cpu) at this version. Its wheel pins CUDA torch and
# GPU kernels, so launch/install.sh installs it with --no-deps; these are what its HTTP app and weight-update path
# import beyond rlmegatron's own dependencies (GPU-only imports are stood in for: tests/rollout/sglang_cpu/gpu_stubs.py).
SGLANG_FOR_TESTS = "sglang==0.5.23"
SGLANG_APP_DEPS = ["fastapi", "uvicorn", "orjson", "pybase64", "msgspec", "pyzmq", "uvloop", "dill", "sentencepiece",
                   "openai==2.8.0", "partial_json_parser", "setproctitle", "einops", "python-multipart"]

WANDB = ["wandb>=0.19"]
TENSORBOARD = ["tensorboard>=2.14"]  # read by torch's SummaryWriter, which writes the event files

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
        "gpu": ["transformer-engine[pytorch]>=2.4", SGLANG_RANGE, "sglang-router>=0.1"],
        # The tracking backends beyond MLflow and the console (tracking.backends).
        "wandb": WANDB,
        "tensorboard": TENSORBOARD,
        # peft: the LoRA export parity tests; pytest-xdist: the suite's two workers (README's test command)
        # sglang-router: its launcher's own argument parser checks the flags rlm train starts a router with
        # mkdocs: tests/test_docs.py builds docs/ strictly (every internal link checked)
        # wandb>=0.31: the tests read its offline runs back with its transaction-log inspector (wandb leet inspect)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "peft>=0.21", "pytest-xdist>=3.8", "sglang-router==0.3.2", "mkdocs>=1.6",
                 *SGLANG_APP_DEPS, "wandb>=0.31", *TENSORBOARD],
    },
    entry_points={"console_scripts": ["rlm=rlmegatron.entry.cli:main"]},
)
