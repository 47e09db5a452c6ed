"""The split of decoder layers over pipeline (and virtual pipeline) stages, as Megatron-Core builds it.

`pipeline_stage_layers` is the one place the split is computed: the spec checks, the planner and the weight map
(export, conversion) all call it, and the weight map checks that every model Megatron builds agrees with it.
Pure Python, so the spec checks can use it without importing torch.
"""
from __future__ import annotations

from typing import Optional

from rlmegatron.errors import one_of

# Megatron's fields for lighter end stages; a spec sets them under `megatron.extra`.
FIRST_STAGE = "num_layers_in_first_pipeline_stage"
LAST_STAGE = "num_layers_in_last_pipeline_stage"


class PipelineSplitError(ValueError):
    """A layer count that Megatron cannot split as asked. `field` is the spec field (relative to the megatron
    section) to change; `valid` lists values of it that would work with this model, ignoring the world size."""

    def __init__(self, field: str, template: str, valid: list[int]):
        self.field, self.template, self.valid = field, template, valid
        super().__init__(self.reason(valid))

    def reason(self, valid: list[int]) -> str:
        """The message, offering `valid` (e.g. the valid values that also fit the world size)."""
        return self.template.format(valid=one_of(valid) if valid else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_stage_sizes(num_layers: int, pp: int, first: Optional[int] = None,
                         last: Optional[int] = None) -> list[int]:
    """Decoder layers on each pipeline stage: `first`/`last` layers on the end stages when given
    (Megatron's num_layers_in_first/last_pipeline_stage), the rest split evenly over the others."""
    for name, value in ((FIRST_STAGE, first), (LAST_STAGE, last)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise PipelineSplitError(f"extra.{name}", "must be a whole number of layers >= 1", [])
        if value is not None and pp == 1:
            raise PipelineSplitError(f"extra.{name}", "sizes a pipeline stage, so it needs "
                                     "pipeline_model_parallel_size > 1; remove it or raise the pipeline size", [])
    if first is None and last is None:
        if num_layers % pp:
            reason = (f"does not divide the model's {num_layers} layers; use {{valid}}, or split unevenly with "
                      f"extra.{FIRST_STAGE} / {LAST_STAGE}")
            raise PipelineSplitError("pipeline_model_parallel_size", reason, _divisors(num_layers))
        return [num_layers // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_stages < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and middle_layers % middle_stages):
        reason = (f"leaves {middle_layers} layers for {middle_stages} middle stages after "
                  "extra.num_layers_in_first/last_pipeline_stage; they must split evenly")
        raise PipelineSplitError("pipeline_model_parallel_size", reason, [])
    middle = [middle_layers // middle_stages] * middle_stages if middle_stages else []
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def pipeline_stage_layers(num_layers: int, pp: int, vpp: Optional[int] = None, first: Optional[int] = None,
                          last: Optional[int] = None) -> list[list[range]]:
    """[pipeline rank][virtual stage] -> the global decoder layers that model chunk builds, as Megatron-Core does.

    Every virtual stage v holds the v-th slice of each pipeline stage's share, in pipeline-rank order, so
    with VPP a pipeline rank's layers are not contiguous.
    """
    sizes = pipeline_stage_sizes(num_layers, pp, first, last)
    chunks = vpp if vpp and pp > 1 else 1
    if any(size % chunks for size in sizes):
        reason = (f"does not divide the layers of each pipeline stage ({one_of(sorted(set(sizes)))}); use {{valid}}")
        common = [d for d in _divisors(min(sizes) or 1) if all(size % d == 0 for size in sizes)]
        raise PipelineSplitError("virtual_pipeline_model_parallel_size", reason, common)
    per_virtual_stage = num_layers // chunks
    stages = []
    for rank, size in enumerate(sizes):
        start = sum(sizes[:rank]) // chunks
        stages.append([range(v * per_virtual_stage + start, v * per_virtual_stage + start + size // chunks)
                       for v in range(chunks)])
    return stages
