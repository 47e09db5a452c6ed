"""rlmegatron/models/megatron_fusers.py: on a CPU-only torch, Megatron-Core's fusers are off from its first import on, so its
import leaves torch.compile's machinery unimported; on a GPU build of torch, Megatron-Core's jit is as it ships."""
import importlib.util
import json
import subprocess
import sys

import torch

from rlmegatron.models import megatron_fusers
from rlmegatron.models.megatron_fusers import JIT_MODULE, _FusersOffOnCpuBuild, _ThenFusersOff


def test_importing_megatron_after_rlmegatron_on_a_cpu_torch_leaves_dynamo_and_inductor_unimported():
    assert megatron_fusers.cpu_only_torch()  # this machine's torch, as the suite installs it
    script = ("import json, sys; import rlmegatron; import megatron.core.models.gpt; from megatron.core import jit; "
              "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'inductor': 'torch._inductor' in sys.modules,"
              " 'fuser_off': jit.jit_fuser is jit.noop_decorator}))")
    # A new interpreter: in this one Megatron-Core is imported already.
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"dynamo": False, "inductor": False, "fuser_off": True}


def jit_spec():
    """The spec the hook gives for Megatron-Core's jit module, found afresh (it is imported in this process)."""
    import megatron.core

    return _FusersOffOnCpuBuild().find_spec(JIT_MODULE, megatron.core.__path__)


def test_a_gpu_build_gets_megatrons_jit_module_as_it_ships(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    spec = jit_spec()
    assert spec is not None and not isinstance(spec.loader, _ThenFusersOff)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.jit_fuser is torch.compile


def test_a_cpu_build_gets_it_with_the_fuser_off_and_the_hook_acts_once():
    spec = jit_spec()
    assert isinstance(spec.loader, _ThenFusersOff)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.jit_fuser is module.noop_decorator
    assert _FusersOffOnCpuBuild().find_spec("megatron.core.utils") is None  # any other module: the usual finders
    # Megatron-Core's jit is imported in this process: installing again adds nothing.
    before = list(sys.meta_path)
    megatron_fusers.install()
    assert sys.meta_path == before
