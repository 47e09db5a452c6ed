"""`rlm plan`: report, JSON, and layouts it rejects with SpecProblem lines and exit code 2."""
import json

from rlmegatron.entry.cli import main

RECIPE = "configs/gsm8k_qwen3_1p7b_grpo.yaml"


def test_plan_prints_components_and_exits_0(capsys):
    assert main(["plan", RECIPE]) == 0
    out = capsys.readouterr().out
    for part in ("parameters", "gradients", "optimizer state", "activations", "KV cache", "weight sync"):
        assert part in out


def test_plan_json_carries_the_actor_components(capsys):
    assert main(["plan", RECIPE, "--json", "--link-gbps", "100"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["actor"]) >= {"parameters", "gradients", "optimizer_state", "activations", "total"}
    assert plan["sync"]["link_gbps"] == 100


def test_too_small_gpu_is_rejected_naming_the_layout(capsys):
    assert main(["plan", RECIPE, "--gpu-mem-gb", "24"]) == 2
    err = capsys.readouterr().err
    assert f"{RECIPE}: actor.megatron={{TP: 1, PP: 1, CP: 1, EP: 1, ETP: 1}}: needs an estimated" in err
    assert "more than the 24 GB GPU (--gpu-mem-gb)" in err


def test_engine_weights_that_fill_the_reservation_are_rejected(capsys):
    assert main(["plan", "configs/qwen3_30b_a3b_grpo.yaml", "rollout.tensor_parallel_size=1",
                 "rollout.expert_parallel_size=1", "rollout.mem_fraction_static=0.5"]) == 2
    assert "rollout.tensor_parallel_size=1: leaves no KV cache" in capsys.readouterr().err


def test_engine_spanning_part_of_a_node_is_rejected(capsys):
    # 4 nodes × 6 GPUs: an engine of 8 GPUs would take one node and a third of another.
    args = ["plan", RECIPE, "rollout.tensor_parallel_size=8", "placement.gpus_per_node=6", "placement.nnodes=4",
            "data.train_batch_size=960", "actor.ppo_mini_batch_size=96", "actor.ppo_micro_batch_size_per_gpu=4"]
    assert main(args) == 2
    assert "rollout.tensor_parallel_size=8: is larger than a node's 6 GPUs" in capsys.readouterr().err


def test_layout_that_does_not_divide_is_rejected_by_the_spec_checks(capsys):
    assert main(["plan", RECIPE, "actor.megatron.tensor_model_parallel_size=3"]) == 2
    assert "does not divide" in capsys.readouterr().err
