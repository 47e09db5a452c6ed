"""`rlm plan`: its options, and printing the plan or the reasons the layout cannot run (exit 2)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from rlmegatron.config.loader import read_spec_file
from rlmegatron.models.families import read_architecture
from rlmegatron.config.spec import JobSpec
from rlmegatron.planner.plan import DEFAULT_GPU_MEM_GB, DEFAULT_LINK_GBPS, PlanSettings, build_plan, render_plan
from rlmegatron.planner.search import search

EXIT_OK = 0
EXIT_BAD_LAYOUT = 2  # the same code as a rejected spec: the user's to fix


def _positive(text: str) -> float:
    """A hardware figure: a number above 0 (the estimate divides by each)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number above 0")
    return value


def _gpus(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of GPUs above 0")
    return int(text)


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--gpu-mem-gb",
        type=_positive,
        default=DEFAULT_GPU_MEM_GB,
        help=f"memory of one GPU in GB (1e9 bytes); default {DEFAULT_GPU_MEM_GB:g} (H100)",
    )
    parser.add_argument(
        "--link-gbps",
        type=_positive,
        default=DEFAULT_LINK_GBPS,
        help=f"bandwidth into each rollout GPU for the weight sync, in Gb/s; default {DEFAULT_LINK_GBPS:g} "
        "(one NDR InfiniBand port; NVLink 4 within a node is ~3600)",
    )
    parser.add_argument("--gpu-tflops", type=_positive, default=PlanSettings.gpu_tflops,
                        help=f"dense BF16 peak of one GPU, for the step-time estimate; default "
                             f"{PlanSettings.gpu_tflops:g} (H100 SXM)")
    parser.add_argument("--hbm-gb-per-s", type=_positive, default=PlanSettings.hbm_gb_per_s,
                        help=f"memory bandwidth of one GPU in GB/s; default {PlanSettings.hbm_gb_per_s:g} (H100 SXM)")
    parser.add_argument("--nvlink-gb-per-s", type=_positive, default=PlanSettings.nvlink_gb_per_s,
                        help=f"NVLink bandwidth of one GPU per direction in GB/s; default "
                             f"{PlanSettings.nvlink_gb_per_s:g} (H100 SXM; GB200 900)")
    parser.add_argument("--nvlink-domain", type=_gpus, default=None, metavar="GPUS",
                        help="GPUs one NVLink fabric joins, when more than a node's (GB200 NVL72: 72): collectives "
                             "within it, and engines that span its nodes, are priced over NVLink; default: a node")
    parser.add_argument("--search", action="store_true",
                        help="rank the layouts the spec's cluster can run by predicted step time; fields set on the "
                             "command line stay fixed")
    parser.add_argument("--top", type=int, default=5, help="with --search: how many layouts to print (default 5)")
    parser.add_argument("--prompt-tokens", type=float,
                        help="mean prompt length for the step-time estimate (default: data.max_prompt_length)")
    parser.add_argument("--response-tokens", type=float,
                        help="mean response length for the step-time estimate (default: data.max_response_length, "
                             "every response running to the cap)")


def _run_search(spec: JobSpec, args: argparse.Namespace, settings: PlanSettings) -> int:
    located = spec.model.architecture_source()
    assert located is not None, "the cross-field stage rejects a spec without a readable architecture"
    started = time.perf_counter()
    result = search(read_spec_file(args.config), list(args.overrides), spec, read_architecture(located[1]),
                    settings, args.config, top=args.top)
    seconds = time.perf_counter() - started
    if args.json:
        json.dump({"candidates": [{"step_time_s": c.step_time.total, "phases_s": c.step_time.phases,
                                   "peak_gb": c.peak_gb, "overrides": list(c.overrides)} for c in result.candidates],
                   "trainer_layouts": result.trainer_layouts, "engine_layouts": result.engine_layouts,
                   "specs_checked": result.specs_checked, "specs_rejected": result.specs_rejected,
                   "search_s": seconds}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"searched in {seconds:.1f} s: {result.trainer_layouts} trainer layouts and {result.engine_layouts} "
              f"engine layouts fit the {settings.gpu_mem_gb:g} GB GPU; the fastest pairings, {result.specs_checked} "
              f"in all, were checked as specs ({result.specs_rejected} rejected)")
        print("step times are estimates of a model (planner/step_time.py), not measurements")
        for rank, candidate in enumerate(result.candidates, 1):
            phases = ", ".join(f"{name} {s:.1f}" for name, s in candidate.step_time.phases.items())
            print(f"#{rank} ~{candidate.step_time.total:.1f} s/step, peak {candidate.peak_gb:.1f} GB per GPU "
                  f"({phases})")
            print(f"   rlm train {args.config} {' '.join([*args.overrides, *candidate.overrides])}")
    if not result.candidates:
        print(f"{args.config}: no layout of this cluster fits: every one the search priced needs more memory than "
              f"the {settings.gpu_mem_gb:g} GB GPU or fails the spec's checks; add nodes or shorten the sequences",
              file=sys.stderr)
        return EXIT_BAD_LAYOUT
    return EXIT_OK


def run_plan(spec: JobSpec, args: argparse.Namespace) -> int:
    located = spec.model.architecture_source()
    assert located is not None, "the cross-field stage rejects a spec without a readable architecture"
    if args.nvlink_domain is not None and args.nvlink_domain < spec.placement.gpus_per_node:
        print(f"{args.config}: --nvlink-domain {args.nvlink_domain} is smaller than placement.gpus_per_node "
              f"({spec.placement.gpus_per_node}), whose GPUs NVLink already joins: give {spec.placement.gpus_per_node} "
              "or more, or leave it out", file=sys.stderr)
        return EXIT_BAD_LAYOUT
    settings = PlanSettings(gpu_mem_gb=args.gpu_mem_gb, link_gbps=args.link_gbps, gpu_tflops=args.gpu_tflops,
                            hbm_gb_per_s=args.hbm_gb_per_s, prompt_tokens=args.prompt_tokens,
                            response_tokens=args.response_tokens, nvlink_gb_per_s=args.nvlink_gb_per_s,
                            nvlink_domain=args.nvlink_domain)
    if args.search:
        return _run_search(spec, args, settings)
    plan = build_plan(spec, read_architecture(located[1]), settings, file=args.config)
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_plan(spec, plan))
    for problem in plan.problems:
        print(problem, file=sys.stderr)
    return EXIT_BAD_LAYOUT if plan.problems else EXIT_OK
