#!/usr/bin/env bash
# The project's prepared GPU check: the tests marked `gpu`, in one call on a machine with
# CUDA (it uses that machine's own python3 and CUDA build of torch; nothing is downloaded).
# CPU-only work (planner benchmarks, the rest of the suite) does not belong here.
# Writes logs under ${OUT:-out/gpu}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
# Install without dependencies or build isolation: the image already has torch.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
export PYTHONUNBUFFERED=1
# cuBLAS is deterministic only with a fixed workspace (the compile tests compare bit for bit).
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
files=(tests/runtime/test_gpu_runtime.py tests/runtime/test_gpu_ops.py tests/offload_compile/test_compile_gpu.py tests/eager/test_gpu_session.py tests/runtime/pipeline/test_swap_session_gpu.py)
# The meter's CUDA test lives beside hypothesis-based tests; include it where hypothesis is.
python3 -c "import hypothesis" 2>/dev/null && files+=(tests/runtime/test_memory_meter.py)
python3 -m pytest -q -p no:cacheprovider -m gpu "${files[@]}" 2>&1 | tee "$out/gpu_tests.log"
