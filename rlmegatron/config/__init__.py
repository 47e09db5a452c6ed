"""The job spec: pydantic sections, YAML loading, dotted overrides and the checks of the spec alone (no torch here);
rlmegatron/prelaunch/spec_pipeline.py runs them as stages and is the one place a spec is rejected."""
from rlmegatron.config.checks import check_spec
from rlmegatron.config.errors import SpecError, SpecProblem
from rlmegatron.config.loader import dump_spec
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
    "read_architecture",
]
