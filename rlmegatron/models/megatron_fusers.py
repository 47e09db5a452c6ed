"""Megatron-Core's fusers left uncompiled where torch has no GPU backend at all, from Megatron's first import on.

Megatron-Core decorates its fused kernels (bias-GeLU, SwiGLU, RoPE helpers, ...) with `megatron.core.jit.jit_fuser`,
which is `torch.compile` on a recent torch. Decorating at import already imports torch.compile's machinery
(torch._dynamo, torch._inductor): seconds of CPU in every process that imports Megatron, for kernels that a CPU-only
torch never compiles (runtime/cpu_compat.py turns the fuser off before any is called). Turning it off as
`megatron.core.jit` loads, before the fused modules decorate anything, leaves that machinery unimported.

`install()` (rlmegatron/__init__.py) adds an import hook that acts once, when `megatron.core.jit` is first imported, and
only if the torch then imported is a CPU-only build (neither CUDA nor ROCm): decided from the build, not by asking
for a device, so that a process that forks ranks (transport/fork_server.py) never touches a GPU driver. On a GPU build
Megatron-Core is left exactly as it ships.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Any

JIT_MODULE = "megatron.core.jit"


def install() -> None:
    """Add the hook, unless Megatron-Core's jit module is already imported (then its fusers are as they are)."""
    if JIT_MODULE not in sys.modules and not any(isinstance(f, _FusersOffOnCpuBuild) for f in sys.meta_path):
        sys.meta_path.insert(0, _FusersOffOnCpuBuild())


def cpu_only_torch() -> bool:
    """Whether the imported torch was built without any GPU backend."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


class _FusersOffOnCpuBuild(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as the other finders do, and runs Megatron's own `disable_jit_fuser()` right after
    the module's code when torch is CPU-only. Removes itself on that first import."""

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != JIT_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        # The finders after this one, as the import system would have asked them (not sys.modules).
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not cpu_only_torch():
            return spec
        spec.loader = _ThenFusersOff(spec.loader)
        return spec


class _ThenFusersOff(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if hasattr(module, "disable_jit_fuser"):
            module.disable_jit_fuser()
