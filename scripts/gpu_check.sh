#!/usr/bin/env bash
# One prepared run on a GPU machine: the CUDA tests, then benchmarks/gpu.py, everything under $OUT.
#
# The lent GPU machine has PyTorch (CUDA), Triton, transformers, numpy, msgpack, xxhash and httpx, no
# network, and no pytest. Before the run, on a machine with network, put the wheels the tests need in
# an ignored folder of the checkout and carry it (the device entry's `carry` argument):
#   pip download --dest .gpu-wheels --only-binary=:all: --python-version 3.12 pytest pytest-timeout pyzmq
# (pyzmq: the pipeline layouts' tests start worker processes; without it they skip).
# Then, on the device:  OUT=$OUT bash scripts/gpu_check.sh [tests|bench|all]
# One device call may run 600 s and a session has 15 minutes of device time in all (start-up
# included): "all" keeps within 560 s (tests 150 s, then the benchmark 400 s, each cut off at its
# limit with what it wrote kept: gpu.json is rewritten after every model shape), so a second call
# can rerun one part.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
if ! "$PY" -c "import pytest" 2>/dev/null; then
  if [ -d .gpu-wheels ]; then
    "$PY" -m pip install -q --no-index --find-links .gpu-wheels pytest pytest-timeout pyzmq
  else
    echo "no pytest and no .gpu-wheels folder: CUDA tests skipped (see this script's header)" | tee "$OUT/cuda-tests.txt"
  fi
fi
PART=${1:-all}
if [ "$PART" != bench ] && "$PY" -c "import pytest" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py tests/test_triton_attention.py tests/test_triton_invariant.py \
    --junitxml "$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.txt"
fi
if [ "$PART" != tests ]; then
  timeout 400 "$PY" benchmarks/gpu.py --out "$OUT" --steps 20 2>&1 | tee "$OUT/gpu.txt"
fi
