"""The one-call GPU harness (benchmarks/gpu/run.sh) rehearsed on CPU: every part end to end at tiny sizes (the
`async` part too, which the GPU's default set leaves out), with Ray, MLflow and SGLang unimportable as on the device
image; and its micro-batch search and peak table in-process."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu import actor as harness_actor

REPO = Path(__file__).resolve().parents[2]
ABSENT_ON_DEVICE = ("ray", "mlflow", "sglang")

# configs/models/tiny-qwen3 by hand: hidden 64, 4 layers, 4 heads / 2 KV heads of 16, MLP 128, vocab 256, tied.
LAYER_MATRICES = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down
MATMUL_PARAMETERS = 4 * LAYER_MATRICES + 256 * 64  # + the (tied) output projection
NORM_ELEMENTS = 4 * (64 + 64 + 16 + 16) + 64  # input/post-attention norms, q/k norms, final norm
SEQ = 16 + 16  # the CPU defaults' prompt + response


def flops_per_sequence(seq: int) -> int:
    return 6 * MATMUL_PARAMETERS * seq + 12 * 4 * (4 * 16) * seq**2


def rehearse(tmp_path, *parts: str) -> tuple[dict, Path]:
    """run.sh --device cpu --parts PARTS with Ray, MLflow and SGLang unimportable: its report and results directory."""
    stubs = tmp_path / "absent"
    stubs.mkdir()
    for name in ABSENT_ON_DEVICE:
        (stubs / f"{name}.py").write_text(f"raise ImportError('{name} is not on the device image')\n")
    out = tmp_path / "results"
    path = [str(stubs), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run(["bash", "benchmarks/gpu/run.sh", str(out), "--device", "cpu", "--parts", *parts], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert sorted(report["status"]) == sorted(parts)
    assert all(status["returncode"] == 0 for status in report["status"].values()), report["status"]
    return report, out


def test_cpu_rehearsal_runs_every_default_part(tmp_path):
    report, out = rehearse(tmp_path, "actor", "grpo")
    actor, grpo = report["parts"]["actor"], report["parts"]["grpo"]
    assert actor["forbidden_modules_imported"] == grpo["forbidden_modules_imported"] == []

    # MFU: the search doubled up to the cap in both layouts; FLOPs are the formula's; no peak, so no MFU on CPU.
    mfu = actor["mfu"]
    assert mfu["matmul_parameters"] == MATMUL_PARAMETERS and mfu["peak_tflops"] is None
    for found in mfu["modes"].values():
        assert [t["micro_batch"] for t in found["trials"]] == [1, 2]
        assert found["largest"]["micro_batch"] == 2 and found["search_stopped"] == "reached --max-micro-batch"
        for trial in found["trials"]:
            assert trial["flops_per_update"] == trial["rows_per_update"] * flops_per_sequence(SEQ)
            assert trial["fwd_bwd_tflops"] > 0 and "fwd_bwd_mfu" not in trial
    assert set(mfu["modes"]) == {"packed", "padded"}

    # Sync: every weight crossed in several buckets, arrived byte for byte, and sits in the receiver's model.
    sync = actor["sync"]
    assert sync["tensors"] == 4 * 11 + 2 and sync["elements"] == MATMUL_PARAMETERS + NORM_ELEMENTS
    assert sync["buckets"] >= sync["bytes"] / sync["bucket_bytes"] > 2
    assert sync["arrived_bitwise"] and sync["receiver_equal_after"], sync
    assert sync["receiver_differed_before"] >= 4 * 7 + 1  # every matrix: the two inits differ
    assert sync["gb_per_s"]["sync"] > 0 and sync["gb_per_s"]["device_copy"] > 0

    generate = actor["generate"]
    for mode in ("sampled", "greedy"):
        assert generate[mode]["generated_tokens"] == 4 * 8  # no EOS: every prompt runs to its new tokens

    assert grpo["steps"] == 2 and len(grpo["reward_curve"]) == 2 and grpo["step_s_median"] > 0
    assert "placement.device=cpu" in grpo["overrides"] and "tracking.backends=[console]" in grpo["overrides"]

    # What the device tool brings back from $OUT: at most 8 files (the runs' directories are temporary ones); all
    # three parts at once write these 6 and the async part's JSON and log.
    assert sorted(p.name for p in out.rglob("*")) == ["actor.json", "actor.log", "grpo.json", "grpo.log",
                                                      "results.json", "results.md"]
    table = (out / "results.md").read_text()
    assert "| actor fwd+bwd MFU, packed, micro-batch 2 x 32 tokens" in table
    assert "arrived bitwise: True, receiver holds them: True" in table
    assert "| GRPO, quickstart, 2 steps, one rank |" in table


def test_cpu_rehearsal_runs_the_async_part(tmp_path):
    report, out = rehearse(tmp_path, "async")
    # sync, one_step_off and async, disaggregated, 2 steps each, each in a fresh process without Ray. All three
    # train their first step on the same prompts and seeds, generated by the initial weights; sync trains only samples
    # of the current weights, one_step_off its second step on samples one version old, async within max_staleness 2.
    modes = report["parts"]["async"]
    assert (modes["device"], modes["steps"], modes["ray"]) == ("cpu", 2, False)
    assert [row["mode"] for row in modes["modes"]] == ["sync", "async", "one_step_off"]
    for row in modes["modes"]:
        assert row["steps"] == 2 and len(row["reward_curve"]) == 2 and row["step_s_median"] > 0, row
        assert 0 < row["trainer_busy"] <= 1 and 0 < row["engine_busy"] <= 1 and row["startup_s"] > 0, row
    # Not bitwise the same reward: the engine's server batches whatever requests have arrived (as SGLang does), and a
    # row's logits move in their last bits with the batch it shares, enough to flip a near-tie draw now and then
    # (CI once saw 0 and 1 correct of the 128 samples). Two of 128 samples bound it.
    first = [row["reward_curve"][0] for row in modes["modes"]]
    assert max(first) - min(first) <= 2 / 128, first
    staleness = {row["mode"]: row["staleness_max"] for row in modes["modes"]}
    assert (staleness["sync"], staleness["one_step_off"]) == (0, 1) and staleness["async"] <= 2

    assert sorted(p.name for p in out.rglob("*")) == ["async.json", "async.log", "results.json", "results.md"]
    table = (out / "results.md").read_text()
    assert "| one_step_off, quickstart, disaggregated on one cpu (trainer rank and local engine in two processes, no " \
           "Ray), 2 steps |" in table
    assert "CPU (" in table  # the machine is described though the actor part, which describes it, did not run


class _FakeOptimizer:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1
        return True, 1.0, None

    def zero_grad(self):
        pass


class _OutOfMemoryFrom:
    """An actor whose update runs out of CUDA memory from micro-batch `limit` on."""

    def __init__(self, limit: int):
        from rlmegatron.rank.roles import ActorSettings

        self.limit = limit
        self.settings = ActorSettings()
        self.optimizer = _FakeOptimizer()
        config = SimpleNamespace(num_attention_heads=4, kv_channels=16, num_layers=4, hidden_size=64)
        weights = [("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(MATMUL_PARAMETERS - 256 * 64, 1)),
                   ("embedding.word_embeddings.weight", torch.zeros(256, 64)),
                   ("decoder.final_layernorm.weight", torch.zeros(64))]
        self.chunks = [SimpleNamespace(module=SimpleNamespace(config=config, named_parameters=lambda: iter(weights)),
                                       zero_grad_buffer=lambda: None)]
        self.sizes = []

    def update(self, batch):
        self.sizes.append(self.settings.micro_batch_size)
        if self.settings.micro_batch_size >= self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        assert len(batch) == self.settings.ppo_mini_batch_size == 2 * self.settings.micro_batch_size
        self.optimizer.step()


def test_micro_batch_search_keeps_the_last_size_that_fit():
    actor = _OutOfMemoryFrom(limit=8)
    args = SimpleNamespace(mfu_modes=["padded"], max_micro_batch=1024, accumulation=2, prompt_len=4, response_len=4,
                           repeats=1, device="cpu")
    found = harness_actor.mfu_benchmark(actor, SimpleNamespace(vocab_size=256), args, peak=2.0, peak_source="test",
                                        deadline=float("inf"))["modes"]["padded"]
    assert [t["micro_batch"] for t in found["trials"]] == [1, 2, 4, 8] and found["trials"][-1]["oom"]
    assert found["search_stopped"] == "out of memory" and found["largest"]["micro_batch"] == 4
    assert actor.sizes == [1, 1, 2, 2, 4, 4, 8]  # warm-up + one timed update per size; the OOM ends the search
    largest = found["largest"]
    assert largest["flops_per_update"] == 8 * flops_per_sequence(8)
    assert largest["fwd_bwd_mfu"] == largest["fwd_bwd_tflops"] / 2.0
    assert "step" not in vars(actor.optimizer)  # the timing wrapper is gone


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA L4", None)])
def test_bf16_peak_follows_the_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: name)
    assert harness_actor.peak_tflops("cuda", "bf16", None)[0] == peak
    assert harness_actor.peak_tflops("cuda", "fp32", None)[0] is None  # a bf16 peak is no fp32 one
    assert harness_actor.peak_tflops("cuda", "fp32", 123.0) == (123.0, "--peak-tflops")
    assert harness_actor.peak_tflops("cpu", "bf16", None)[0] is None
