#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA device, in at most 6 minutes: the gpu-marked tests (the
# flashinfer kernels where flashinfer is installed; the tiny DeepSeek model's chunked prefill,
# paged absorbed decode and greedy engine run on CUDA against transformers; with two devices,
# tensor parallelism over NCCL against one device), then the step-time
# bench on the device. Wheels: bench/gpu_wheelhouse.sh, built where pip reaches PyPI.
#
#   bench/gpu_check.sh [WHEEL_DIR]    (default .whl)    log and bench output under ${OUT:-/tmp}
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-.whl}
out=${OUT:-/tmp}
if [ -d "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/unit/kernels tests/unit/worker/test_deepseek_worker.py tests/unit/worker/test_tensor_parallel.py 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 90 python3 bench/models.py --device cuda --size small 2>&1 | tee "$out/bench_models_cuda.txt" || status=1
exit $status
