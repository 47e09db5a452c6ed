"""`rlm train` on the quickstart task for the MoE families added for issue 44, each a tiny random model of its family
(the quickstart's tokenizer, `model.path` a directory holding only its config.json and tokenizer): 20 steps at
EP=2 with routing replay (r3) and the on-policy check, which holds only if the engine computes what the actor does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.driver.test_moe_fit import RUN, STEPS, train

QUICKSTART_MOE = Path(__file__).resolve().parents[2] / "configs" / "quickstart" / "moe_model"
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
             vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=4,
             bos_token_id=None, tie_word_embeddings=False, initializer_range=0.02)
FAMILY_CONFIGS = {
    "minimax_m2": dict(architectures=["MiniMaxM2ForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
                       intermediate_size=32, rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True,
                       use_qk_norm=True, rope_theta=10000.0),
}


def tiny_model(directory: Path, model_type: str) -> Path:
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QUICKSTART_MOE / name, directory / name)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, **SIZES,
                                                       **FAMILY_CONFIGS[model_type]}))
    return directory


@pytest.mark.parametrize("model_type", FAMILY_CONFIGS)
def test_a_tiny_model_of_the_family_trains_twenty_steps_at_ep2_on_policy(tmp_path, model_type):
    model = tiny_model(tmp_path / model_type, model_type)
    run = train(tmp_path, "run", f"model.path={model}", *RUN, "actor.megatron.expert_model_parallel_size=2",
                "actor.moe.routing_replay=r3", "trainer.on_policy_check=1e-5", "trainer.log_freq=1")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"trained steps 1-{STEPS} ({STEPS} steps)" in run.stdout
