#!/usr/bin/env bash
# One prepared run on a GPU machine: the CUDA tests and benchmarks/gpu.py, everything under $OUT.
#
# The lent GPU machine has PyTorch (CUDA), Triton, transformers, numpy, msgpack, xxhash, httpx and
# pytest, no network, and not pyzmq (the pipelines' transport), fastapi, pydantic, uvicorn or gguf.
# Before the run, on a machine with network, put those wheels in an ignored folder of the checkout
# and carry it (the device entry's `carry` argument):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 --platform any -d .gpu-wheels \
#     pyzmq fastapi starlette pydantic pydantic-core uvicorn gguf annotated-types typing-inspection \
#     typing_extensions opentelemetry-api httptools uvloop py-spy
# Then, on the device:  OUT=$OUT bash scripts/gpu_check.sh [tests|bench|all]
# "all" runs the tests, then the benchmark alone (its timings taken beside the tests would share the
# GPU and the host with them; and lent machines differ, so compare figures within one run).
# Limits: TEST_LIMIT (default 180 s), BENCH_LIMIT (default 400 s); gpu.json is rewritten after every
# model shape, so a run cut off at its limit keeps what it measured. BENCH_ARGS adds benchmark options,
# e.g. BENCH_ARGS="--baseline .gpu-base" serves each backend with an older tree's kvflow too, alternating
# (mkdir .gpu-base && git archive <commit> | tar -x -C .gpu-base; ignored, carry it like .gpu-wheels);
# BENCH_ARGS="--profile-serving" samples each serving backend's processes with py-spy (from the wheels)
# and writes serve-<backend>.txt, each process's busiest frames (its timings then carry py-spy's cost).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ] && ! "$PY" -c "import zmq" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvflow-site .gpu-wheels/*.whl \
    || echo "installing .gpu-wheels failed" >&2
  export PYTHONPATH="/tmp/kvflow-site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/kvflow-site/bin:$PATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi; df -h /dev/shm; nproc  # (/dev/shm holds the pipelines' KV replicas: a small one sends them over TCP)
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/versions.txt" 2>&1
tail -1 "$OUT/versions.txt"
PART=${1:-all}
tests() {
  timeout "${TEST_LIMIT:-180}" "$PY" -m pytest -m cuda -q -rfEs --tb=short -p no:cacheprovider tests/test_cuda.py tests/test_triton_fused.py \
    tests/test_triton_fused_linear.py tests/test_triton_attention.py tests/test_triton_invariant.py \
    tests/test_decode_ahead_stage.py > "$OUT/cuda-tests.txt" 2>&1
  echo "cuda tests: exit $?; $(tail -1 "$OUT/cuda-tests.txt")"
}
bench() {
  # shellcheck disable=SC2086
  timeout "${BENCH_LIMIT:-400}" "$PY" benchmarks/gpu.py --out "$OUT" --steps 20 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu.txt"
}
case "$PART" in
  tests) tests ;;
  bench) bench ;;
  all) tests; bench ;;
  *) echo "usage: gpu_check.sh [tests|bench|all]" >&2; exit 2 ;;
esac
