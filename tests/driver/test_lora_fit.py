"""`rlm train` with LoRA and adapter sync, colocated on two rank processes with the loopback SGLang server: the base
weights travel once, then each step's adapters load as a LoRA adapter the next rollout samples with, replacing the
one before; the engines keep their weights while asleep. The run's HF export is the merged policy, which the last
adapter over the base model gives."""
import json
from pathlib import Path

import torch

from tests.driver.test_train import REPO_ROOT, train, with_fake_sglang

QUICKSTART_MODEL = REPO_ROOT / "configs" / "quickstart" / "model"


def save_base_model(directory: Path) -> Path:
    """The quickstart's model with random weights saved, so the base the adapters go on is known."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QUICKSTART_MODEL)).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QUICKSTART_MODEL / name, directory / name)
    return directory


def test_adapter_sync_loads_each_steps_adapter_and_samples_with_it(tmp_path):
    from safetensors.torch import load_file

    base_dir = save_base_model(tmp_path / "base")
    sglang, env = with_fake_sglang(tmp_path, "lora")
    result = train(tmp_path, "lora", "launched", f"model.path={base_dir}", "model.random_init=false",
                   "trainer.total_steps=3", "trainer.test_freq=-1", "data.val_files=[]",
          "trainer.save_freq=3", "tracking.backends=[console]", f"trainer.run_dir={tmp_path / 'run'}",
          "actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.weight_sync=adapter", "actor.optim.lr=5e-2",
          *sglang, env=env)
    calls = [json.loads(line) for line in (tmp_path / "lora.calls").read_text().splitlines()]
    servers = sorted({c["pid"] for c in calls})
    assert len(servers) == 2  # one engine per rank
    for pid in servers:
        mine = [c for c in calls if c["pid"] == pid]
        pushes = [c for c in mine if c["path"] == "/update_weights_from_tensor"]
        assert pushes and all(c is not mine[-1] for c in pushes)
        first_load = next(i for i, c in enumerate(mine) if c["path"] == "/load_lora_adapter")
        assert all(c["path"] != "/update_weights_from_tensor" for c in mine[first_load:])  # the base only at init
        events = [(c["path"], c.get("lora_name") or c.get("lora_path")) for c in mine
                  if c["path"] in ("/load_lora_adapter", "/unload_lora_adapter")]
        assert events == [("/load_lora_adapter", "step_1"), ("/load_lora_adapter", "step_2"),
                          ("/unload_lora_adapter", "step_1"), ("/load_lora_adapter", "step_3"),
                          ("/unload_lora_adapter", "step_2")]
        sampled = [c["lora_path"] for c in mine if c["path"] == "/generate"]
        assert sampled[0] is None and set(sampled) == {None, "step_1", "step_2"}  # step 1 samples the base
        released = [c["tags"] for c in mine if c["path"] == "/release_memory_occupation"]
        assert released and all("weights" not in tags for tags in released)
    # The checkpoint holds what `rlm convert lora-to-hf` needs to rebuild the adapted model (tests/models/test_lora.py).
    from rlmegatron.rank.checkpoint_state import AdapterMeta
    from rlmegatron.models.lora import LoRASettings

    meta = AdapterMeta.load(tmp_path / "run" / "checkpoints" / "step_3" / "actor")
    assert meta == AdapterMeta(LoRASettings(rank=4, alpha=8.0), str(base_dir), "fp32", random_init=False,
                               padded_vocab_size=128)  # the quickstart's 128 tokens, at TP=1
    # The last adapter, over the base weights, is the merged policy the run exported.
    adapter_dir = tmp_path / "run" / "lora_adapters" / "step_3"
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert not (tmp_path / "run" / "lora_adapters" / "step_1").exists()  # loaded and replaced: removed
    exported = {k: v for shard in Path(result["exported_hf"]).glob("*.safetensors")
                for k, v in load_file(shard).items()}
    base = load_file(str(base_dir / "model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    modules = {name.split(".lora_")[0] for name in adapter}
    assert len(modules) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    for module in modules:
        name = module.removeprefix("base_model.model.") + ".weight"
        delta = scale * adapter[f"{module}.lora_B.weight"] @ adapter[f"{module}.lora_A.weight"]
        assert float(delta.abs().max()) > 1e-5, f"{module}: the adapters must have trained"
        assert (base[name] + delta - exported[name]).abs().max() < 1e-5, name
