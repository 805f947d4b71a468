#!/usr/bin/env bash
# The GPU checks of a session that is lent the device (H200), as one call (not run by CI).
#
# Here, once: `make gpu-wheels` (pydantic's wheels for the device's Python 3.12 into .whl/, git-ignored
# through .git/info/exclude; the device image has torch, Triton, numba, numpy, xxhash, transformers).
# Then: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=420). It takes about
# 3 minutes there (about 5 with the machine's start) and leaves in $OUT:
#   gpu_check.md + reports.json  benchmarks/gpu_check.py: every target vs the CPU fp32 reference, no-sync
#                                summary capture, on-device statistics against the CPU kernel
#   pytest.txt                   tests/test_hooks_gpu.py, test_hooks_replay.py, test_hooks_cudagraphs.py on CUDA
#   capture-MODEL.txt            benchmarks/capture.py --device cuda (summary/full x aten/module) with a
#                                cProfile of summary captures, for llama-small and llama-mid
# and prints the tables; paste them into the closing note.
set -u
OUT=${OUT:-/tmp/opband-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "no wheels in .whl/: run 'make gpu-wheels' here and carry .whl"; exit 3; }
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

timeout 150 python3 benchmarks/gpu_check.py --out /tmp/opband-gpu-check > "$OUT/gpu_check.md" 2>&1
echo "gpu_check rc=$?"
cp /tmp/opband-gpu-check/reports.json "$OUT/" 2>/dev/null
grep -E "^\| [a-z0-9+-]+ on cuda|statistics on|summary capture|took" "$OUT/gpu_check.md"

timeout 120 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_hooks_gpu.py tests/test_hooks_replay.py tests/test_hooks_cudagraphs.py \
  > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"
grep -E "^E |passed|failed" "$OUT/pytest.txt" | head -20

for model in llama-small llama-mid; do
  timeout 100 python3 benchmarks/capture.py --device cuda --model "$model" --runs 5 --levels aten,module --profile 2 \
    > "$OUT/capture-$model.txt" 2>&1
  echo "capture $model rc=$?"
  grep -v "^of every" "$OUT/capture-$model.txt" | head -13
done
