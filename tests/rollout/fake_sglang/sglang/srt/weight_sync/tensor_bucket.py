"""Stand-in for sglang's FlattenedTensorMetadata, the class the bucket payload names."""
from dataclasses import dataclass

import torch


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int
