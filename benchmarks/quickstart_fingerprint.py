"""A fingerprint of the quickstart's first steps, to show a refactor changed nothing it runs: `rlm train
configs/quickstart.yaml` for N steps, then one sha256 over every step's logged metrics (timings left out), the exported
HF weights and the checkpoint's model weights, each tensor by name.

    python benchmarks/quickstart_fingerprint.py [--steps 20] [--run-dir /tmp/qs_fingerprint]

Two checkouts that print the same line trained the same tokens to the same weights, bit for bit. The optimizer's part
of the checkpoint is left out: Megatron's distributed optimizer saves its buffers' padding between parameters
uninitialised, so those bytes differ between two runs of the same code.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _update(digest, name: str, tensor: torch.Tensor) -> None:
    digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def fingerprint(run_dir: Path, log: str, steps: int) -> dict[str, str]:
    parts = {}
    metrics = [re.sub(r"\s*timing_s/\S+ \S+", "", line) for line in log.splitlines() if line.startswith("step ")]
    parts["metrics"] = hashlib.sha256("\n".join(metrics).encode()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted((run_dir / "hf_policy").glob("*.safetensors")):
        for name, tensor in sorted(load_file(file).items()):
            _update(digest, name, tensor)
    parts["hf_export"] = digest.hexdigest()
    actor = run_dir / "checkpoints" / f"step_{steps}" / "actor"
    FileSystemReader(str(actor)).read_metadata()  # a checkpoint that is not there fails here, by name
    flat = run_dir / "actor.pt"
    dcp_to_torch_save(str(actor), str(flat))
    digest = hashlib.sha256()
    for name, value in sorted(torch.load(flat, weights_only=False).items()):
        if torch.is_tensor(value) and not name.startswith("optimizer"):
            _update(digest, name, value)
    parts["checkpoint_model"] = digest.hexdigest()
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/qs_fingerprint"))
    args = parser.parse_args()
    shutil.rmtree(args.run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "rlmegatron", "train", "configs/quickstart.yaml", f"trainer.total_steps={args.steps}",
               f"trainer.save_freq={args.steps}", "trainer.test_freq=10", f"trainer.run_dir={args.run_dir}",
               "tracking.backends=[console]"]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"rlm train failed ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    parts = fingerprint(args.run_dir, run.stdout, args.steps)
    for name, value in parts.items():
        print(f"{name:17} {value}")
    print(f"{'fingerprint':17} {hashlib.sha256(''.join(parts.values()).encode()).hexdigest()}")


if __name__ == "__main__":
    main()
