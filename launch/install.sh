#!/usr/bin/env bash
# Creates ./.venv and installs rlmegatron into it.
#   bash launch/install.sh --cpu   CPU machines: torch is pinned to the CPU wheel, so pip never pulls CUDA packages
#   bash launch/install.sh --gpu   GPU machines: torch from the default index plus the `gpu` extra (TE, SGLang)
# Set PYTHON to choose the interpreter (default python3; Python 3.11 gets megatron-core 0.16, 3.12 gets 0.19).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
mode="${1:-}"
case "$mode" in
  --cpu|--gpu) ;;
  *) echo "usage: bash launch/install.sh --cpu|--gpu" >&2; exit 2 ;;
esac

"${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
if [ "$mode" = --cpu ]; then
  # The +cpu local version fails loudly rather than silently resolving to a CUDA build.
  "${pip[@]}" install -q --retries 1 --timeout 20 \
    --extra-index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu"
  # setuptools' note that an editable install can be shadowed by a directory of the package's name is about other
  # layouts than this one.
  PYTHONWARNINGS="ignore::UserWarning:setuptools.command.editable_wheel" "${pip[@]}" install -q -e ".[test]"
  # SGLang's own server code for the conformance tests, without its CUDA torch and GPU kernels (setup.py:
  # SGLANG_FOR_TESTS names the version; its app's light dependencies come with the test extra).
  "${pip[@]}" install -q --no-deps "$(sed -n 's/^SGLANG_FOR_TESTS = "\(.*\)"$/\1/p' setup.py)"
else
  "${pip[@]}" install -q "torch==${TORCH_VERSION}"
  "${pip[@]}" install -q -e ".[test,gpu]"
fi
# The import check quiets what a rank quiets (rlmegatron/runtime/notices.py): on CPU, Megatron-Core's notices that
# Transformer Engine and Apex, GPU libraries, are not installed.
.venv/bin/python -c "
from rlmegatron.runtime.notices import quiet_library_notices
quiet_library_notices('${mode#--}')
import torch, megatron.core, rlmegatron
print('rlmegatron', rlmegatron.__version__, '| torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
