"""LoRA on the Megatron actor, on CPU/gloo: at TP=2 (with and without sequence parallelism), PP=2, EP=2 and expert TP
the adapters train exactly as at TP=1 and merge into the same HF weights; only the adapters train; with the adapters
off the model is the base model, bit for bit."""
import pytest
import torch
from safetensors.torch import load_file

from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.lora_jobs import CONVERTED, RESHARDED, lora_job
from tests.models.tiny_hf import save_tiny_model

CASES = [
    ("qwen3", "TP1", L()),
    ("qwen3", "TP2", L(tp=2)),  # A's and the input's gradients summed over TP
    ("qwen3", "TP2-SP", L(tp=2, sequence_parallel=True)),  # the sequence gathered and split around the adapters
    ("qwen3", "PP2", L(pp=2)),  # frozen tied embeddings across stages
    ("qwen3_moe", "TP1", L()),
    ("qwen3_moe", "EP2", L(ep=2)),  # expert adapters reduced over the expert-DP group
    ("qwen3_moe", "TP2-SP", L(tp=2, sequence_parallel=True)),  # experts over ETP=2: the dispatcher does the comms
    ("qwen3_moe", "TP2-ETP1", L(tp=2, ep=2, etp=1, sequence_parallel=True)),
    ("gpt_oss", "TP1", L()),
    ("gpt_oss", "EP2", L(ep=2)),  # biased experts; sinks and the sliding window in attention
    ("deepseek_v32", "TP1", L()),
    ("deepseek_v32", "TP2-SP", L(tp=2, sequence_parallel=True)),  # MLA, the frozen indexer
    ("minimax_m2", "TP1", L()),
    ("minimax_m2", "TP2-SP", L(tp=2, sequence_parallel=True)),  # q/k norms over all heads
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora")
    for family in {family for family, _, _ in CASES}:
        save_tiny_model(family, str(workdir / family))
    reports = run_ranks(lora_job, 2, CASES, str(workdir), timeout_s=600)
    assert all(torch.equal(r[k]["trained_log_probs"], reports[0][k]["trained_log_probs"]) for r in reports
               for k in r), "ranks disagree"
    return {**reports[0], "workdir": workdir, "base": {family: load_file(str(workdir / family / "model.safetensors"))
                                                       for family in {family for family, _, _ in CASES}}}


@pytest.mark.parametrize("family,label", [(f, label) for f, label, _ in CASES if label != "TP1"])
def test_lora_trains_and_merges_at_every_layout_as_at_tp1(report, family, label):
    baseline, result = report[f"{family}/TP1"], report[f"{family}/{label}"]
    moved = (baseline["trained_log_probs"] - baseline["log_probs"]).abs().max()
    # A thousand times the tolerance below at least (gpt-oss's tiny model moves least: 0.036).
    assert moved > 1e-2, "the adapters must change the model for the comparison to mean anything"
    assert (result["trained_log_probs"] - baseline["trained_log_probs"]).abs().max() < 1e-5
    assert result["grad_norms"] == pytest.approx(baseline["grad_norms"], rel=1e-5)
    merged, expected = result["merged"], baseline["merged"]
    assert set(merged) == set(expected)
    update = max(float((expected[n] - base).abs().max()) for n, base in report["base"][family].items() if n in expected)
    assert update > 1e-3, "the merged weights must differ from the base ones for the comparison to mean anything"
    assert max(float((merged[n] - expected[n]).abs().max()) for n in expected) < 1e-5 * update


def test_the_adapters_start_as_the_base_model_and_switch_off_to_it(report):
    for family in ("qwen3", "qwen3_moe"):
        baseline = report[f"{family}/TP1"]
        assert torch.equal(baseline["log_probs"], baseline["plain_log_probs"])  # B starts at zero
        assert torch.equal(baseline["adapters_off"], baseline["plain_log_probs"])  # after training, off again
        for label in [label for f, label, _ in CASES if f == family]:
            off = report[f"{family}/{label}"]["adapters_off"]
            assert (off - baseline["plain_log_probs"]).abs().max() < 1e-5, label


@pytest.mark.parametrize("family,label", [(f, label) for f, label, _ in CASES])
def test_only_the_adapters_get_gradients_and_optimizer_state(report, family, label):
    result = report[f"{family}/{label}"]
    assert result["trainable"] == ["lora_A", "lora_B"]
    assert result["base_changed"] == []
    assert 0 < result["adapter_numel"] < 0.15 * result["base_numel"]
    if label != "EP2":  # there the expert adapters' optimizer shards over a smaller group than the dense ones'
        assert result["optimizer_numel"] == result["adapter_numel"]


@pytest.mark.parametrize("label", ["TP1", "TP2", "TP2-SP"])
def test_the_peft_adapter_applied_to_the_base_model_gives_the_merged_weights(report, label):
    """What peft computes from the PEFT-format adapter over the HF base model (W + alpha/r * B @ A per projection)
    equals the weights the engines get merged, at every TP size."""
    from tests.models.lora_jobs import LORA

    result, base = report[f"qwen3/{label}"], report["base"]["qwen3"]
    adapter, merged = result["adapter"], result["merged"]
    modules = {name.split(".lora_")[0] for name in adapter}
    assert {module.rpartition(".")[2] for module in modules} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"}
    for module in modules:
        hf_name = module.removeprefix("base_model.model.") + ".weight"
        peft = base[hf_name] + LORA.scale * adapter[f"{module}.lora_B.weight"] @ adapter[f"{module}.lora_A.weight"]
        assert (peft - merged[hf_name]).abs().max() < 1e-5, module
    assert max(float(t.abs().max()) for n, t in adapter.items() if "lora_B" in n) > 1e-3  # trained


@pytest.mark.parametrize("family,label", [(f, label) for f, label, _ in CASES if label in RESHARDED])
def test_adapters_saved_at_one_layout_load_at_tp1_with_the_same_merged_weights(report, family, label):
    """A distributed checkpoint of the adapters reshards: fc1's B by its gate and up halves, experts by their ids."""
    result = report[f"{family}/{label}"]
    assert max(float((result["resharded"][n] - result["merged"][n]).abs().max()) for n in result["merged"]) == 0.0


# ---- `rlm convert lora-to-hf`: a run's adapter-only checkpoint as a PEFT adapter and as merged HF weights ----------
@pytest.fixture(scope="module")
def converted(report):
    """The qwen3 actors trained at TP1 and TP2, saved as a run's checkpoints, each converted at the other TP size (the
    checkpoint reshards, and both exporter paths run): TP1's by lora_job on its ranks, TP2's by the command."""
    from rlmegatron.entry.convert_command import main

    workdir = report["workdir"]
    run = workdir / "run-TP2"
    assert main(["lora-to-hf", "--checkpoint", str(run), "--tp", "1", "--device", "cpu",
                 "--adapter-out", f"{run}-peft", "--merged-out", f"{run}-merged"]) == 0
    return workdir


@pytest.mark.parametrize("label", CONVERTED)
def test_transformers_with_the_converted_peft_adapter_and_merged_weights_give_our_logits(report, converted, label):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    workdir, ours = converted, report[f"qwen3/{label}"]["logits"]
    adapter_effect = (ours["logits"] - ours["base_logits"]).abs().max()
    assert adapter_effect > 1e-2, "the adapters must move the logits far beyond the tolerance"
    base = AutoModelForCausalLM.from_pretrained(workdir / "qwen3", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(workdir / f"run-{label}-merged", dtype=torch.float32)
    with torch.no_grad():
        assert (base(ours["tokens"]).logits - ours["base_logits"]).abs().max() < 1e-4
        assert (merged(ours["tokens"]).logits - ours["logits"]).abs().max() < 1e-4
        peft = PeftModel.from_pretrained(base, workdir / f"run-{label}-peft").eval()
        assert (peft(ours["tokens"]).logits - ours["logits"]).abs().max() < 1e-4


def test_an_embedding_trained_whole_converts_into_the_merged_weights_and_a_peft_adapter(report):
    """actor.lora.modules_to_save=[embedding] at TP=2, converted at TP=1: with the adapters off the model is the base
    one, embedding included; the merged weights, and the PEFT adapter (the embedding as a module to save, tied to
    the output layer again) over the base model, carry the trained embedding and adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ours, workdir = report["qwen3/TP2-embedding"]["logits"], report["workdir"]
    assert (ours["logits"] - ours["base_logits"]).abs().max() > 1e-2
    base = AutoModelForCausalLM.from_pretrained(workdir / "qwen3", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(workdir / "run-TP2-embedding-merged", dtype=torch.float32)
    trained = (merged.get_input_embeddings().weight - base.get_input_embeddings().weight).abs().max()
    assert trained > 1e-3, "the embedding must have trained"
    with torch.no_grad():
        assert (base(ours["tokens"]).logits - ours["base_logits"]).abs().max() < 1e-4
        assert (merged(ours["tokens"]).logits - ours["logits"]).abs().max() < 1e-4
        peft = PeftModel.from_pretrained(base, workdir / "run-TP2-embedding-peft").eval()
        assert (peft(ours["tokens"]).logits - ours["logits"]).abs().max() < 1e-4


@pytest.mark.parametrize("family,label,layout", CASES, ids=[f"{f}-{label}" for f, label, _ in CASES])
def test_the_planner_counts_the_adapters_each_rank_holds(report, family, label, layout):
    """`rlm plan`'s LoRA count (planner.parameters.lora_parameters), against the factors rank 0 really holds."""
    from rlmegatron.models.families import architecture_of
    from rlmegatron.planner.parameters import lora_parameters
    from tests.models.lora_jobs import LORA
    from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS

    arch = architecture_of({"model_type": family, **COMMON, **FAMILY_CONFIGS[family]})
    layers = lora_parameters(arch, LORA.rank, LORA.target_modules)
    stage = layers[: len(layers) // layout.pp]  # rank 0: the first pipeline stage
    etp = layout.etp or layout.tp
    expected = sum(layer.dense_per_gpu(layout.tp) + layer.experts_per_gpu(layout.ep, etp) for layer in stage)
    assert report[f"{family}/{label}"]["adapter_numel"] == expected
