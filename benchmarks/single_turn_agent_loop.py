"""Issue 16's condition for one rollout path: a quickstart rollout through the single-turn path (`engine.generate`)
against the same requests through the agent loop with max_turns=1 and no tools, interleaved in one process.

    python benchmarks/single_turn_agent_loop.py [--config configs/quickstart.yaml] [--repeats 40] [dotted.overrides]

One rank's share of a step (train_batch_size / 2 prompts x rollout.n samples) on the quickstart's local engine (random
weights, the run's dtype), seeded as the trainer seeds them. Each repeat times both paths, in alternating order; the
report is the median of each and their ratio (the agent loop's time over the single-turn path's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the config, as `rlm train` takes them")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.colocated_engine import _local_engine
    from rlmegatron.driver.role_settings import rollout_settings
    from rlmegatron.driver.rollout_data import sampling_spec
    from rlmegatron.data.dataset import build_dataset
    from rlmegatron.rollout.agent_loop import AgentLoop, AgentSettings
    from rlmegatron.rollout.engine import GenerationRequest

    torch.set_num_threads(1)  # as a gloo rank on this machine runs
    spec = load_spec(args.config, args.overrides)
    settings = rollout_settings(spec)
    engine = _local_engine(settings, settings.model.hf_config())
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_path)
    dataset = build_dataset(spec.data.train_files, tokenizer, spec.data)
    prompts = [dataset[i] for i in range(spec.data.train_batch_size // 2)]
    requests = [GenerationRequest(tuple(p.prompt_ids), sampling_spec(spec.rollout, spec.rollout.max_new_tokens,
                                                                      spec.rollout.stop_token_ids, 1000 + i))
                for i, p in enumerate(prompts)]
    loop = AgentLoop(AgentSettings(max_turns=1, max_tool_response_length=1, tool_call_format="hermes", tools=(),
                                   tool_timeout_s=1.0, tokenizer_path=spec.model.tokenizer_path), tokenizer)
    paths = {"single_turn": lambda: engine.generate(requests), "agent_loop": lambda: loop.generate(engine, requests)}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, int] = {}
    for repeat in range(args.repeats + 2):
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for name in order:
            start = time.perf_counter()
            results = paths[name]()
            if repeat >= 2:  # two warm-up rounds
                seconds[name].append(time.perf_counter() - start)
            tokens[name] = sum(len(r.output_token_ids) for r in results)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(json.dumps({
        "config": args.config, "overrides": args.overrides, "samples": len(requests) * spec.rollout.n, "response_tokens": tokens,
        "repeats": args.repeats, "median_ms": {name: round(1000 * value, 3) for name, value in median.items()},
        "ratio_agent_loop_over_single_turn": round(median["agent_loop"] / median["single_turn"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
