#!/usr/bin/env bash
# One-call GPU harness: the Megatron actor's MFU, the colocated CUDA-IPC weight sync, local-engine generation and a
# short GRPO run, on one GPU, in one command of at most 10 minutes. Writes results.json and results.md.
#
#   bash benchmarks/gpu/run.sh [RESULTS_DIR] [--device cuda|cpu] [harness options]   # RESULTS_DIR defaults to $OUT
#   bash benchmarks/gpu/run.sh /tmp/rehearsal --device cpu                             # the CPU rehearsal (tiny sizes)
#   bash benchmarks/gpu/run.sh "$OUT" --parts async    # sync / one_step_off / async on one GPU: a command of its own
#
# The device image has torch, transformers, pyyaml, safetensors, psutil and pyarrow, but not megatron-core or
# pydantic: when they are missing, they are installed from the wheels in $RLM_WHEELS (default
# benchmarks/gpu/wheels), fetched beforehand on a machine with PyPI by benchmarks/gpu/fetch_wheels.sh and carried
# along. Nothing here needs Ray, SGLang, MLflow or Transformer Engine. Options: python -m benchmarks.gpu.harness -h.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${RLM_WHEELS:-$ROOT/benchmarks/gpu/wheels}"
SITE="${RLM_SITE:-${TMPDIR:-/tmp}/rlm-gpu-site}"

# find_spec, not import: importing megatron.core takes seconds.
have_deps() {
    "$PYTHON" -c "import importlib.util as u, sys
sys.exit(not (u.find_spec('megatron.core') and u.find_spec('pydantic')))" 2>/dev/null
}
if ! have_deps; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "run.sh: megatron-core or pydantic is not installed, and $WHEELS holds no wheels;" \
             "run benchmarks/gpu/fetch_wheels.sh on a machine with PyPI and carry that directory" >&2
        exit 2
    fi
    # Into a directory of their own (the device tool's recipe): the image's environment is left as it is.
    echo "installing $(cd "$WHEELS" && echo *.whl) into $SITE" >&2
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    have_deps || { echo "run.sh: megatron-core or pydantic still missing after installing $WHEELS" >&2; exit 2; }
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m benchmarks.gpu.harness "$@"
