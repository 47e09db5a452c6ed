"""Rank-side body of the export-stream tests: import HF weights at a layout, stream them back out."""
from __future__ import annotations

import os

import torch

from rlmegatron.runtime import ParallelLayout


def export_job(cases: list[tuple[str, ParallelLayout]], workdir: str) -> dict:
    """Per (family, layout): the streamed HF tensors on this rank, compared bitwise with the source checkpoint."""
    from safetensors.torch import load_file

    from rlmegatron.models.convert import import_hf
    from rlmegatron.resharding import HFWeightExporter

    report = {}
    for family, layout in cases:
        hf_dir = os.path.join(workdir, family)
        original = {}
        for name in os.listdir(hf_dir):
            if name.endswith(".safetensors"):
                original.update(load_file(os.path.join(hf_dir, name)))
        _, weight_map, chunks = import_hf(hf_dir, layout)
        exporter = HFWeightExporter(chunks, weight_map)
        streamed = {}
        for step in range(2):  # the plan is reused: every step's sync streams the same names
            streamed = dict(exporter.stream())
        expected = {k: v for k, v in original.items() if not weight_map.ignorable_hf_key(k)}
        report[f"{family}/{layout}"] = {
            "missing": sorted(set(expected) - set(streamed)),
            "extra": sorted(set(streamed) - set(expected)),
            "mismatched": sorted(k for k in expected if k in streamed and not torch.equal(expected[k], streamed[k])),
            "count": len(streamed),
        }
    return report
