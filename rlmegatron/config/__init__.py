"""The job spec: pydantic sections, YAML loading, dotted overrides and cross-field checks (no torch here)."""
from rlmegatron.config.checks import check_spec
from rlmegatron.config.errors import SpecError, SpecProblem
from rlmegatron.config.loader import dump_spec, load_spec, spec_from_raw
from rlmegatron.config.spec import JobSpec
# The model's architecture, as its family reads config.json: the spec checks read it so.
from rlmegatron.models.families import ArchitectureError, ModelArchitecture, read_architecture

__all__ = [
    "ArchitectureError",
    "JobSpec",
    "ModelArchitecture",
    "SpecError",
    "SpecProblem",
    "check_spec",
    "dump_spec",
    "load_spec",
    "read_architecture",
    "spec_from_raw",
]
