"""The one place SGLang's GPU-only imports are stood in for, so its HTTP app and weight-update code import on a CPU.

`sglang` imports these at module level although the code paths the conformance tests run never call them:
- `triton`, `tvm_ffi`: GPU kernel compilers (SGLang's kernels are declared with `@triton.jit` at import time);
- `torchvision`: pinned to a torch build of its own; only SGLang's multimodal processors use it;
- `compressed_tensors`, `gguf`: quantised checkpoint formats; `xgrammar`: constrained decoding; `soundfile`: audio;
- `IPython`: a debugging aid.

Each stand-in module hands out placeholder classes for any attribute: callable as decorators (they return what they
decorate), subscriptable, usable in isinstance checks and as pydantic field types. Anything that would reach a GPU
driver (`triton.runtime.driver`) raises, which SGLang reads as "no GPU" and falls back to its CPU paths.

torch and transformers look for triton and torchvision themselves; their checks run (and settle on "absent") before
the stand-ins are installed, so only SGLang sees them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("triton", "tvm_ffi", "torchvision", "compressed_tensors", "gguf", "xgrammar", "soundfile", "IPython", "vllm")


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "driver":
            raise RuntimeError("no GPU driver on this machine")
        return _placeholder(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _placeholder(f"{cls.__name__}()")

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _any_schema(cls, source, handler):
    from pydantic_core import core_schema

    return core_schema.any_schema()


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {"__get_pydantic_core_schema__": classmethod(_any_schema)})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "driver":
            raise RuntimeError("no GPU driver on this machine")
        return _placeholder(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    # torch (inductor, flop counter) and transformers decide once whether triton and torchvision exist: let them
    # decide before the stand-ins are there.
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401
    import transformers.utils.import_utils  # noqa: F401

    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
