"""Delta weight sync (rollout.weight_sync=delta): bytes per step against a full push, per encoding, and end to end.

    python benchmarks/delta_sync.py encodings [--lr 1e-6 1e-5] [--steps 10]
    python benchmarks/delta_sync.py train [--lr 1e-6 1e-5] [--steps 10]

`encodings`: a Qwen3 of 106M parameters (the quickstart's tokenizer, 9 layers of width 1024) trains with Adam at each
lr on next-token loss over random tokens, fp32 master weights; after each step its bf16 weights (what a bf16 engine
holds) go through rollout/delta.py's sender in each encoding, and the auto one through a receiver, which must hold
them bit for bit. Prints bytes per step per encoding, the share of elements that changed, and the seconds to encode
and apply.

`train`: `rlm train` of the quickstart task on the same 106M model, bf16, disaggregated (the local engine's server, so
the records cross HTTP as they do to SGLang), weight_sync full and delta with trainer.check_sync_every (default 1;
its full export and checksums count in timing_s/update_weights, so time the sync itself with 0), for
`--steps` steps at each lr; prints the weight_sync/* metrics and timing_s/update_weights of each step.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
WIDTH = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 9, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 512, "max_window_layers": 9}


def model_dir(root: Path) -> Path:
    """The quickstart model (its tokenizer) widened to 106M parameters."""
    target = root / "model_106m"
    shutil.copytree(REPO_ROOT / "configs" / "quickstart" / "model", target)
    config = json.loads((target / "config.json").read_text())
    config.update(WIDTH)  # the tokenizer's 128 tokens: no embedding row that training never touches
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def encodings(lrs: list[float], steps: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlmegatron.rollout.delta import DeltaReceiver, DeltaSender, bits

    with tempfile.TemporaryDirectory() as root:
        config = AutoConfig.from_pretrained(model_dir(Path(root)))
    torch.manual_seed(0)
    for lr in lrs:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        senders = {name: DeltaSender(encoding=name) for name in ("indices", "bitmask", "auto")}
        receiver = DeltaReceiver()

        def weights():
            return [(name, p.detach().to(torch.bfloat16)) for name, p in model.named_parameters()]

        for sender in senders.values():
            records, _ = sender.records(weights(), full=True)
            if sender is senders["auto"]:
                receiver.apply(records)
        full_bytes = sum(t.numel() * 2 for _, t in weights())
        print(f"lr {lr:g}: {params / 1e6:.1f}M parameters, a full bf16 push {full_bytes / 1e6:.1f} MB; "
              f"the last-sent copy {senders['auto'].copy_bytes / 1e6:.1f} MB on each side")
        for step in range(1, steps + 1):
            tokens = torch.randint(0, config.vocab_size, (2, 128))
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            now = weights()
            changed = sum(int((bits(t) != bits(senders["auto"].last[n])).sum()) for n, t in now)
            row = {}
            for name, sender in senders.items():
                started = time.perf_counter()
                records, counted = sender.records(now, full=False)
                encode_s = time.perf_counter() - started
                row[name] = counted.sent
                if name == "auto":
                    started = time.perf_counter()
                    receiver.apply(records)
                    apply_s = time.perf_counter() - started
                    exact = all(torch.equal(bits(receiver.held[n]), bits(t)) for n, t in now)
                    auto_encode_s = encode_s
            print(f"  step {step:2d}: {changed / params:7.3%} of elements changed; bytes sent "
                  + ", ".join(f"{name} {sent / 1e6:7.2f} MB ({sent / full_bytes:6.2%})" for name, sent in row.items())
                  + f"; auto encode {auto_encode_s:.2f} s, apply {apply_s:.2f} s; exact {exact}")


METRIC = re.compile(r"(weight_sync/\w+|timing_s/update_weights)\s+([-\d.e]+)")


def train(lrs: list[float], steps: int, check_every: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        model = model_dir(Path(root))
        for lr in lrs:
            for mode in ("full", "delta"):
                command = [sys.executable, "-m", "rlmegatron", "train", "configs/quickstart.yaml",
                           f"model.path={model}", "model.dtype=bf16", f"actor.optim.lr={lr}",
                           f"trainer.total_steps={steps}", f"trainer.run_dir={root}/{mode}_{lr:g}",
                           "trainer.val_before_train=false", "trainer.test_freq=-1", "~data.val_files",
                           "trainer.save_freq=-1", "trainer.log_freq=1", "tracking.backends=[console]",
                           "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
                           "placement.mode=disaggregate", "placement.rollout_nnodes=1",
                           "placement.rollout_gpus_per_node=1", "placement.gpus_per_node=1",
                           f"rollout.weight_sync={mode}", f"trainer.check_sync_every={check_every}"]
                started = time.perf_counter()
                run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
                if run.returncode:
                    sys.exit(run.stdout[-3000:] + run.stderr[-3000:])
                steps_seen: dict[str, list[float]] = {}
                for name, value in METRIC.findall(run.stdout):
                    steps_seen.setdefault(name, []).append(float(value))
                sync_s = steps_seen["timing_s/update_weights"]
                print(f"lr {lr:g} {mode:5s}: {time.perf_counter() - started:.0f} s; update_weights per step "
                      f"median {statistics.median(sync_s):.3f} s; sent_ratio per step "
                      f"{[round(r, 4) for r in steps_seen.get('weight_sync/sent_ratio', [])]}; bytes_sent "
                      f"{[int(b) for b in steps_seen.get('weight_sync/bytes_sent', [])]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=("encodings", "train"))
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--check-sync-every", type=int, default=1, help="train: trainer.check_sync_every")
    args = parser.parse_args()
    if args.part == "encodings":
        encodings(args.lr, args.steps)
    else:
        train(args.lr, args.steps, args.check_sync_every)


if __name__ == "__main__":
    main()
