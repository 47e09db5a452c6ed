#!/usr/bin/env bash
# Fetches, on a machine with PyPI, the wheels benchmarks/gpu/run.sh installs on the device (Python 3.12, x86-64,
# no registry there): megatron-core 0.19.x without its dependencies (torch, numpy and packaging are in the image;
# its extras are not needed) and pydantic with its own (pydantic-core, annotated-types, typing-inspection,
# typing-extensions), plus packaging, which megatron-core wants at >= 24.2.
#
#   bash benchmarks/gpu/fetch_wheels.sh [DIR]        # DIR defaults to benchmarks/gpu/wheels (git-ignored)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/benchmarks/gpu/wheels}"
PYTHON="${PYTHON:-python3}"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p "$DIR"
"$PYTHON" -m pip download --quiet "${TARGET[@]}" --no-deps -d "$DIR" "megatron-core==0.19.*"
"$PYTHON" -m pip download --quiet "${TARGET[@]}" -d "$DIR" pydantic "packaging>=24.2"
ls -l "$DIR"
