#!/usr/bin/env bash
# The GPU checks of a session that is lent the device (H200), as one call (not run by CI).
#
# Here, once: `make gpu-wheels` (pydantic's wheels for the device's Python 3.12 into .whl/, git-ignored
# through .git/info/exclude; the device image has torch, Triton, numba, numpy, xxhash, transformers).
# Then: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600). It takes about
# 5 minutes there (about 7 with the machine's start) and leaves in $OUT:
#   build.txt                    setup.py build_ext --inplace: hooks._observer with its CUDA path (stats_cuda.cu)
#   gpu_check.md + reports.json  benchmarks/gpu_check.py: every target vs the CPU fp32 reference, no-sync
#                                summary capture, on-device statistics against the CPU kernel
#   pytest.txt                   tests/test_observer_cuda.py (the observer's CUDA rows and records against the
#                                dispatch mode's, no sync), test_hooks_gpu.py, test_hooks_replay.py,
#                                test_hooks_cudagraphs.py on CUDA
#   capture-MODEL.txt            benchmarks/capture.py --device cuda (summary/full x aten/module) with a
#                                cProfile of summary captures, for llama-small and llama-mid (issue 34: summary
#                                under the observer <= 2x / 1.2x; aten full, side-stream copies, <= plain + 1.3x
#                                the raw write)
# and prints the tables; paste them into the closing note.
set -u
OUT=${OUT:-/tmp/opband-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "no wheels in .whl/: run 'make gpu-wheels' here and carry .whl"; exit 3; }
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# the compiled observer with its CUDA path (setup.py finds nvcc and the CUDA torch here; sm_90: H100/H200)
TORCH_CUDA_ARCH_LIST=9.0 timeout 170 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1
echo "build rc=$? $(grep -cE 'error' "$OUT/build.txt") error lines"
python3 -c "from hooks import observer; m = observer._observer; print('observer:', 'built, CUDA' if m is not None and m.CUDA else 'no CUDA path', observer._MISSING)"

timeout 120 python3 benchmarks/gpu_check.py --out /tmp/opband-gpu-check > "$OUT/gpu_check.md" 2>&1
echo "gpu_check rc=$?"
cp /tmp/opband-gpu-check/reports.json "$OUT/" 2>/dev/null
grep -E "^\| [a-z0-9+-]+ on cuda|statistics on|summary capture|took" "$OUT/gpu_check.md"

timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_observer_cuda.py tests/test_hooks_gpu.py \
  tests/test_hooks_replay.py tests/test_hooks_cudagraphs.py \
  > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"
grep -E "^E |passed|failed" "$OUT/pytest.txt" | head -20

for model in llama-small llama-mid; do
  timeout 90 python3 benchmarks/capture.py --device cuda --model "$model" --runs 5 --levels aten,module --profile 2 \
    > "$OUT/capture-$model.txt" 2>&1
  echo "capture $model rc=$?"
  grep -v "^of every" "$OUT/capture-$model.txt" | head -13
done
