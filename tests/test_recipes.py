"""Every shipped recipe passes `rlm validate`, and `rlm plan` fits it on the hardware its header names."""
import re
from pathlib import Path

import pytest

from rlmegatron.entry.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# recipe -> GPU memory (GB) of the hardware its header comment names
RECIPES = {
    "gsm8k_qwen3_1p7b_grpo.yaml": 80,
    "gsm8k_qwen2p5_0p5b_grpo_24gb.yaml": 24,
    "gsm8k_qwen3_1p7b_ppo.yaml": 80,
    "gsm8k_tool_qwen3_1p7b_grpo.yaml": 80,
    "dapo_qwen3_1p7b.yaml": 80,
    "qwen3_30b_a3b_grpo.yaml": 80,
    "deepseek_v3_671b_grpo.yaml": 80,
    "geo3k_qwen2p5_vl_7b_grpo.yaml": 80,
    "gpt_oss_120b_grpo.yaml": 80,
    "kimi_k25_grpo.yaml": 80,
    "deepseek_v32_grpo.yaml": 80,
    "qwen3_5_moe_grpo.yaml": 80,
    "distill_qwen3_30b_a3b_from_235b.yaml": 80,
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


def test_deepseek_v3_recipe_builds_the_uneven_pipeline_that_its_checks_and_plan_use(monkeypatch):
    """61 layers over PP=16: the recipe's spec becomes an MLATransformerConfig whose stages Megatron fills as the
    split function, and with it the checks and the planner, say: one layer first, then four per stage."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlmegatron.config import read_architecture
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.role_settings import parallel_layout
    from rlmegatron.models.pipeline import pipeline_stage_layers
    from rlmegatron.models.hf_config import model_facts, read_hf_config, spec_config_options, transformer_config
    from rlmegatron.planner.memory import stage_layers

    monkeypatch.chdir(CONFIGS.parent)
    spec = load_spec(str(CONFIGS / "deepseek_v3_671b_grpo.yaml"))
    megatron = spec.actor.megatron
    layout = parallel_layout(megatron)
    facts = model_facts(read_hf_config(spec.model.hf_config), layout.tp)
    config = transformer_config(facts, layout, dtype=spec.model.dtype, options=spec_config_options(megatron),
                                perform_initialization=False)
    assert (config.num_layers, config.pipeline_model_parallel_size, config.num_layers_in_first_pipeline_stage) == (
        61, 16, 1)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 1)
    built = [list(range(get_transformer_layer_offset(config, None, rank),
                        get_transformer_layer_offset(config, None, rank) + get_num_layers_to_build(config, None, rank)))
             for rank in range(16)]
    assert [len(layers) for layers in built] == [1] + [4] * 15
    assert built == [list(chunk) for (chunk,) in pipeline_stage_layers(61, 16, first=1)]
    assert built == stage_layers(read_architecture(spec.model.hf_config).num_hidden_layers, megatron)


def test_the_quickstarts_header_states_the_time_the_readme_measured():
    readme = (CONFIGS.parent / "README.md").read_text()
    measured = float(re.search(r"([\d.]+) s for the whole command", readme)[1])
    stated = int(re.search(r"# about (\d+) s on 2 idle CPU cores", (CONFIGS / "quickstart.yaml").read_text())[1])
    assert stated == round(measured)


def test_the_vl_recipes_plan_counts_the_frozen_vision_tower_and_its_image_tokens(capsys, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)
    assert main(["plan", str(CONFIGS / "geo3k_qwen2p5_vl_7b_grpo.yaml"), "--gpu-mem-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "8.29B parameters" in out
    # 448 x 448 pixels are 16 x 16 merged 28-pixel patches.
    assert "vision tower: 0.68B parameters, whole on each first-stage rank, frozen" in out and "is 256 prompt tokens" in out
    # The sync moves the 7.62B language model in bf16 (15.2 GB), not the frozen tower; the engines hold all 8.29B.
    assert "weight sync: 15.2 GB in all" in out and "weights 8.3 GB" in out
