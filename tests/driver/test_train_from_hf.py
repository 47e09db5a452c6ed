"""Training from an HF checkpoint (model.random_init=false) builds the model the checkpoint holds: a DeepSeek-V3
saved by transformers has no MTP tensors though its config.json declares one MTP layer, so it trains without MTP."""
import math
import shutil
from pathlib import Path

from safetensors import safe_open

from tests.driver.test_train import REPO_ROOT, train
from tests.models.tiny_hf import save_tiny_model


def test_a_deepseek_v3_saved_by_transformers_trains_without_mtp_and_says_so_once(tmp_path):
    tokenizer = REPO_ROOT / "configs" / "quickstart" / "model"
    hf = Path(save_tiny_model("deepseek_v3_no_mtp", str(tmp_path / "hf"), vocab_size=128, pad_token_id=0,
                              eos_token_id=4))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer / name, hf / name)
    result = train(tmp_path, "deepseek", "local", "trainer.total_steps=1", "placement.gpus_per_node=1",
                   f"model.path={hf}", "model.random_init=false", f"trainer.run_dir={tmp_path / 'run'}",
                   "trainer.save_freq=-1", "trainer.test_freq=-1", "data.val_files=[]",
                   "trainer.val_before_train=false", "tracking.backends=[console]")
    (step, grad_norm), = result["history"]["actor/grad_norm"]
    assert step == 1 and math.isfinite(grad_norm) and grad_norm > 0
    assert result["stderr"].count("holds no multi-token-prediction tensors") == 1, result["stderr"][-3000:]
    exported = Path(result["exported_hf"])
    keys = {key for shard in exported.glob("*.safetensors") for key in safe_open(shard, "pt").keys()}
    assert "model.layers.3.mlp.experts.0.down_proj.weight" in keys
    assert not any(key.startswith("model.layers.4.") for key in keys)  # the MTP layer's index
