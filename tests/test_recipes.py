"""Every shipped recipe passes `rlm validate`, and `rlm plan` fits it on the hardware its header names."""
import re
from pathlib import Path

import pytest

from rlmegatron.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# recipe -> GPU memory (GB) of the hardware its header comment names
RECIPES = {
    "gsm8k_qwen3_1p7b_grpo.yaml": 80,
    "gsm8k_qwen2p5_0p5b_grpo_24gb.yaml": 24,
    "gsm8k_qwen3_1p7b_ppo.yaml": 80,
    "dapo_qwen3_1p7b.yaml": 80,
    "qwen3_30b_a3b_grpo.yaml": 80,
    "deepseek_v3_671b_grpo.yaml": 80,
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates(recipe, capsys):
    assert main(["validate", str(CONFIGS / recipe)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("recipe, gpu_mem_gb", RECIPES.items())
def test_recipe_fits_its_hardware(recipe, gpu_mem_gb, capsys):
    assert main(["plan", str(CONFIGS / recipe), "--gpu-mem-gb", str(gpu_mem_gb)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_header_names_hardware_memory_and_source(recipe):
    header = "".join(re.findall(r"^#.*\n", (CONFIGS / recipe).read_text(), flags=re.M))
    assert "Expected memory (rlm plan" in header
    assert "Checked against:" in header
    assert re.search(r"H100|24 GB", header)
