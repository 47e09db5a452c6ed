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
        expected = {k: v for k, v in original.items() if not weight_map.ignorable_hf_key(k)}
        # The plan is reused: every step's sync streams the same names. The second stream gathers TP shards
        # a few rows at a time (many chunks per piece, chunks ending mid-piece), the first in one chunk.
        streams = [dict(exporter.stream())]
        exporter.gather_chunk_bytes = 200
        streams.append(dict(exporter.stream()))
        report[f"{family}/{layout}"] = {
            "missing": sorted({k for streamed in streams for k in set(expected) - set(streamed)}),
            "extra": sorted({k for streamed in streams for k in set(streamed) - set(expected)}),
            "mismatched": sorted({k for streamed in streams for k in expected
                                  if k in streamed and not torch.equal(expected[k], streamed[k])}),
            "count": min(len(streamed) for streamed in streams),
        }
    return report
