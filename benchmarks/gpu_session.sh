#!/usr/bin/env bash
# The prepared device run, one call of at most ~9 minutes (130 + 280 + 120 s; device tool: run with carry [".whl"],
# timeout_s 560):
#   bash benchmarks/gpu_wheels.sh                       # here, first: the wheels the device image lacks
#   run: bash benchmarks/gpu_session.sh                 # on the device; results under $OUT
# 1. benchmarks/gpu_triage.py: which fp32 tensor-core lowering runs (each in its own process);
# 2. benchmarks/gpu_check.py with the first that passed (GPU issue targets, tests/ops/test_triton.py inside);
# 3. the CUDA model tests (generation, hooks, padding, bench) under transformers from .whl.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" > "$OUT/triage.log" 2>&1
GPU_TRIAGE_TIMEOUT_S=110 timeout 130 python3 benchmarks/gpu_triage.py >> "$OUT/triage.log" 2>&1
choice=$(sed -n 's/^CHOICE=//p' "$OUT/triage.log")
export OAL_TRITON_FP32_DOT=${choice:-ieee}
echo "gpu_check and tests with OAL_TRITON_FP32_DOT=$OAL_TRITON_FP32_DOT" >> "$OUT/triage.log"
GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-230} timeout 280 python3 benchmarks/gpu_check.py > /dev/null 2>&1
echo "gpu_check exit $?" >> "$OUT/gpu_check.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 100 --tb=short \
  tests/conversion/test_generation_gpu.py tests/models/test_hooks_gpu.py tests/models/test_padding.py \
  tests/bench/test_bench_op.py -k "cuda or gpu" > "$OUT/gpu_tests.log" 2>&1
echo "tests exit $?" >> "$OUT/gpu_tests.log"
cat "$OUT/triage.log"
tail -20 "$OUT/gpu_check.log"
tail -15 "$OUT/gpu_tests.log"
