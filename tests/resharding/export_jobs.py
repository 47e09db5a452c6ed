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
        # The first counts what this rank's pipeline broadcasts carry.
        broadcast, carried = torch.distributed.broadcast, []

        def counting(tensor, *args, **kwargs):
            carried.append(tensor.numel() * tensor.element_size())
            return broadcast(tensor, *args, **kwargs)

        torch.distributed.broadcast = counting
        try:
            streams = [dict(exporter.stream())]
        finally:
            torch.distributed.broadcast = broadcast
        exporter.gather_chunk_bytes = 200
        streams.append(dict(exporter.stream()))
        report[f"{family}/{layout}"] = {
            "missing": sorted({k for streamed in streams for k in set(expected) - set(streamed)}),
            "extra": sorted({k for streamed in streams for k in set(streamed) - set(expected)}),
            "mismatched": sorted({k for streamed in streams for k in expected
                                  if k in streamed and not torch.equal(expected[k], streamed[k])}),
            "count": min(len(streamed) for streamed in streams),
            "broadcast_bytes": sum(carried),
            "shard_bytes": _shard_bytes(exporter) if layout.pp > 1 else 0,
            "streamed_bytes": sum(t.numel() * t.element_size() for t in streams[0].values()),
        }
    return report


def _shard_bytes(exporter) -> int:
    """What the pipeline broadcasts of one stream should carry on a rank: every weight's shard once (an expert
    slot's once, the EP all-gather bringing the other ranks' experts)."""
    import re

    local_experts = exporter.num_experts // exporter.ep_size if exporter.num_experts else 0
    total = 0
    for entry in exporter._plan:
        expert = re.search(r"\.local_experts\.(\d+)\.", entry.name)
        if expert and exporter.ep_size > 1 and int(expert.group(1)) >= local_experts:
            continue
        numel = 1
        for size in entry.local_shape:
            numel *= size
        total += numel * torch.empty((), dtype=entry.dtype).element_size()
    return total
