"""MTP speculative rollout on CPU (issue 45 point 3): the acceptance rate of the local engine's drafts over a training
run with the MTP layer trained with the policy and with it left as initialised, and the engine's tokens per second
drafting against plain decoding at the same (greedy) outputs.

    python benchmarks/mtp_speculative.py [--steps 400] [--weight 0.1] [--deep-layers 8] [--repeats 30]
                                         [--out runs/mtp_speculative]

Each run is `rlm train configs/count_up.yaml` (a tiny random DeepSeek-V3 with one MTP layer learns to write the 8
digits after a given one; the local engine drafts 3 tokens per verification; 1 CPU rank) with actor.mtp.loss_weight
--weight and 0, the same seed. Per step it records rollout/spec_accept_rate, rollout/spec_accepted_tokens_mean,
critic/score/mean and actor/mtp_loss (runs/.../<run>/history.json); the tables give them per 50 steps.
Then each run's exported policy (hf_policy, the MTP layer with it) decodes the 64 validation prompts greedily (8
tokens each, one batch) in the local engine, plain and drafting k = 1, 2, 3 tokens; the outputs must be equal. The
table gives the main model's forwards per output token (plain decoding: one per token; drafting: the prefill and one
per verification, over the tokens), and the median tokens per second of --repeats timings on one thread, the engines
taking turns so that the machine's load falls on all of them alike, with the ratio to plain decoding. The MTP layer
is one decoder layer and the tiny model has two: a third run trains the same task on a model of --deep-layers decoder
layers (--weight), whose policy decodes in the same table, closer to a real model where the draft is a small part.
A run whose directory under --out holds its history.json and hf_policy is read back, not trained again.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACKED = ("rollout/spec_accept_rate", "rollout/spec_accepted_tokens_mean", "critic/score/mean", "actor/mtp_loss")


def train(run_dir: Path, steps: int, weight: float, layers: int = 0) -> tuple[dict, float | None]:
    """One `rlm train configs/count_up.yaml` in this process's job code (the rank is a process), on a copy of its model
    with `layers` decoder layers if given: (its metric history, seconds), or what an earlier one left in `run_dir`."""
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.prelaunch.spec_pipeline import SpecSource

    saved = run_dir / "history.json"
    if saved.is_file() and (run_dir / "hf_policy").is_dir():
        return json.loads(saved.read_text()), None
    overrides = [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", f"trainer.test_freq={steps}",
                 f"actor.mtp.loss_weight={weight}"]
    if layers:
        model = run_dir.parent / f"model_{layers}_layers"
        shutil.copytree(REPO_ROOT / "configs" / "count_up" / "model", model, dirs_exist_ok=True)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        overrides.append(f"model.path={model}")
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the run's own report; stdout keeps the tables
        history = run_training(check_training(SpecSource(str(REPO_ROOT / "configs" / "count_up.yaml"),
                                                         overrides))).history
    saved.write_text(json.dumps(history))
    return history, time.perf_counter() - started


def run_name(weight: float, layers: int) -> str:
    return f"weight_{weight}" + (f"_{layers}_layers" if layers else "")


def per_window(history: dict, name: str, window: int = 50) -> list[str]:
    values = [value for _, value in sorted(history.get(name, []))]
    return [f"{statistics.fmean(values[start:start + window]):.3f}" for start in range(0, len(values), window)]


def engine(policy: Path, num_draft_tokens: int):
    """The exported policy in a local engine; with drafting, its MTP layer loaded as a weight sync loads it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlmegatron.rollout.local import LocalEngine

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    local = LocalEngine(model, pad_token_id=model.config.pad_token_id or 0, max_batch_size=64,
                        num_draft_tokens=num_draft_tokens)
    if num_draft_tokens:
        index = json.loads((policy / "model.safetensors.index.json").read_text())["weight_map"]
        local.update_weights([item for shard in sorted(set(index.values()))
                              for item in load_file(policy / shard).items()], "exported")
    return local


def speeds(policy: Path, repeats: int) -> list[tuple[int, float, float, float]]:
    """(k, main-model forwards per token, median tokens/s, drafts accepted per verification) for plain decoding (k 0)
    and k = 1, 2, 3, greedy."""
    import torch
    from transformers import AutoTokenizer

    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    rows = [json.loads(line) for line in (REPO_ROOT / "configs" / "count_up" / "val.jsonl").open()]
    sampling = SamplingSpec(temperature=0.0, max_new_tokens=8)
    # As the run's data reads its prompts (data/dataset.py).
    requests = [GenerationRequest(tuple(tokenizer(tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]), sampling)
        for row in rows]
    engines = {k: engine(policy, k) for k in (0, 1, 2, 3)}
    results = {k: local.generate(requests) for k, local in engines.items()}  # also the warm-up
    seconds: dict[int, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for k, local in engines.items():
            started = time.perf_counter()
            local.generate(requests)
            seconds[k].append(time.perf_counter() - started)
    table = []
    for k, answers in results.items():
        assert [r.output_token_ids for r in answers] == [r.output_token_ids for r in results[0]], \
            f"k={k}: the greedy outputs differ from plain decoding's"
        tokens = sum(len(r.output_token_ids) for r in answers)
        verifications = sum(r.spec_verify_ct for r in answers)
        forwards = (len(answers) + verifications) / tokens if k else 1.0
        table.append((k, forwards, tokens / statistics.median(seconds[k]),
                      sum(r.spec_num_correct_drafts for r in answers) / verifications if verifications else 0.0))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--weight", type=float, default=0.1)
    parser.add_argument("--deep-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="runs/mtp_speculative")
    args = parser.parse_args()
    out = Path(args.out)
    runs = {f"loss_weight {args.weight}": (args.weight, 0), "loss_weight 0 (stale draft)": (0.0, 0)}
    if args.deep_layers:
        runs[f"loss_weight {args.weight}, {args.deep_layers} layers"] = (args.weight, args.deep_layers)
    histories, seconds = {}, {}
    for name, (weight, layers) in runs.items():
        histories[name], seconds[name] = train(out / run_name(weight, layers), args.steps, weight, layers)
    windows = len(per_window(next(iter(histories.values())), TRACKED[0]))
    print(f"Per 50 steps (mean), {args.steps} steps of configs/count_up.yaml, 3 drafts per verification:\n")
    print("| run | metric | " + " | ".join(f"{50 * w + 1}-{min(50 * (w + 1), args.steps)}" for w in range(windows))
          + " |")
    print("|---|---|" + "---:|" * windows)
    for name, history in histories.items():
        for metric in TRACKED:
            if metric in history:
                print(f"| {name} | {metric} | " + " | ".join(per_window(history, metric)) + " |")
    for name, history in histories.items():
        val = [value for _, value in sorted(history.get("val/count_up/score/mean", []))]
        took = "read back" if seconds[name] is None else f"{seconds[name]:.0f} s"
        print(f"\n{name}: validation score {' -> '.join(f'{v:.3f}' for v in val)}, {took}")
    print("\nLocal engine, greedy, 64 validation prompts x 8 tokens, one thread (outputs equal to plain decoding's):\n")
    print("| policy | drafts k | drafts accepted per verification | main forwards per token | tokens/s | vs plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (weight, layers) in runs.items():
        table = speeds(out / run_name(weight, layers) / "hf_policy", args.repeats)
        for k, forwards, rate, accepted in table:
            print(f"| {name} | {k or 'plain'} | {f'{accepted:.2f}' if k else '-'} | {forwards:.2f} | {rate:.0f} | "
                  f"{rate / table[0][2]:.2f}x |")


if __name__ == "__main__":
    main()
