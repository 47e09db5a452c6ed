"""Arguments and dispatch of `rlm convert {hf-to-mcore,mcore-to-hf,verify}`, under torchrun or with --nproc."""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_FAILED, EXIT_BEYOND_TOLERANCE = 0, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlm convert", description="Hugging Face <-> Megatron-Core checkpoints.")
    sub = parser.add_subparsers(dest="direction", required=True)

    def layout_args(p, with_ep=True):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--vpp", type=int, default=None)
        p.add_argument("--first-stage-layers", type=int, default=None,
                       help="decoder layers on the first pipeline stage when it differs from the rest")
        p.add_argument("--last-stage-layers", type=int, default=None,
                       help="decoder layers on the last pipeline stage when it differs from the rest")
        if with_ep:
            p.add_argument("--ep", type=int, default=1)
            p.add_argument("--etp", type=int, default=None)
        p.add_argument("--nproc", type=int, default=None,
                       help="ranks to spawn here (gloo on CPU, nccl on GPUs); default: torchrun's, else the "
                            "fewest that TPxPP and ETPxEPxPP both divide")
        p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")

    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron.core.dist_checkpointing")
    to_mcore.add_argument("--hf-path", required=True)
    to_mcore.add_argument("--out", required=True)
    to_mcore.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    layout_args(to_mcore)
    to_hf = sub.add_parser("mcore-to-hf", help="dist_checkpointing written by hf-to-mcore -> HF safetensors")
    to_hf.add_argument("--mcore-path", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--hf-config", default=None, help="directory whose config.json/tokenizer files to ship")
    layout_args(to_hf)  # each rank loads only its shard at this layout; the export stream gathers
    check = sub.add_parser("verify", help="max-abs and cosine logit diff, Megatron vs HF transformers")
    check.add_argument("--hf-path", required=True)
    check.add_argument("--mcore-path", required=True)
    check.add_argument("--tolerance", type=float, default=1e-3)
    layout_args(check)
    return parser


def _layout(args):
    from rlmegatron.runtime import ParallelLayout

    tp = getattr(args, "tp", 1)
    # MoE with TP>1 needs sequence parallelism in Megatron; it changes no dense weight or logit.
    return ParallelLayout(tp=tp, pp=getattr(args, "pp", 1), vpp=getattr(args, "vpp", None), ep=getattr(args, "ep", 1),
                          etp=getattr(args, "etp", None), sequence_parallel=tp > 1,
                          first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)


def default_nproc(layout) -> int:
    """The fewest ranks that hold the dense layers (TP x PP) and the experts (ETP x EP x PP) alike."""
    return layout.pp * math.lcm(layout.tp, (layout.etp or layout.tp) * layout.ep)


def _job(direction: str, args: dict):
    """What every rank runs; a module-level function so spawned ranks can import it."""
    from rlmegatron.models import convert

    ns = argparse.Namespace(**args)
    if direction == "hf-to-mcore":
        return convert.hf_to_mcore(ns.hf_path, ns.out, _layout(ns), ns.dtype)
    if direction == "mcore-to-hf":
        return convert.mcore_to_hf(ns.mcore_path, ns.out, ns.hf_config, _layout(ns))
    return convert.verify(ns.hf_path, ns.mcore_path, _layout(ns))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from rlmegatron.runtime import RankFailure, destroy_distributed, init_distributed, run_ranks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layout = _layout(args)
    try:
        if "RANK" in os.environ and args.nproc is None:  # under torchrun
            init_distributed(device)
            results = [_job(args.direction, vars(args))]
            destroy_distributed()
        else:
            nproc = args.nproc or default_nproc(layout)
            results = run_ranks(_job, nproc, args.direction, vars(args), device=device, timeout_s=24 * 3600)
    except (RankFailure, ValueError) as err:
        print(f"rlm convert {args.direction}: {err}", file=sys.stderr)
        return EXIT_FAILED
    if args.direction == "verify":
        diffs = [r for r in results if r]
        if not diffs:
            return EXIT_OK  # a non-reporting torchrun rank
        worst = max(diffs, key=lambda d: d["max_abs_diff"])
        print(f"logits max_abs_diff={worst['max_abs_diff']:.3e} cosine={worst['cosine']:.8f} (tolerance {args.tolerance:g})")
        return EXIT_OK if worst["max_abs_diff"] <= args.tolerance else EXIT_BEYOND_TOLERANCE
    print(f"rlm convert {args.direction}: wrote {args.out}")
    return EXIT_OK
