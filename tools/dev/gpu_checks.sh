#!/usr/bin/env bash
# Every GPU check and benchmark as one prepared run, for a machine with GPUs
# (the device machine): the C++ GPU tests (NCCL backend, the tensor-parallel
# kernels' CUDA path), the Python CUDA-tensor tests, the NCCL bus-bandwidth
# benchmark against torch.distributed NCCL and the tensor-parallel GPU
# benchmark against torch.matmul. Without a GPU every part skips or says
# "no GPU".
#
#   tools/dev/gpu_checks.sh [build-dir]      # default: build
#
# Exits non-zero if a test or a benchmark fails; the benchmarks write
# benchmarks/results/{nccl_busbw,tp_gpu}.json and regenerate
# benchmarks/RESULTS.md.
set -euo pipefail
BUILD=${1:-build}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
nvidia-smi -L || echo "nvidia-smi: no GPU listed"
cmake --build "$BUILD" --target nccl_gpu_test nccl_library_test nccl_watchdog_test \
  tp_linear_cuda_test tp_gpu_bench _strata
status=0
ctest --test-dir "$BUILD" -R 'NcclGpu|NcclApiLoad|NcclRoot|LinearCudaTest|py_nccl$|py_checkpoint$|py_data_parallel_cuda$' \
  --output-on-failure --timeout 300 || status=1
export PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
timeout 900 "$PYTHON" benchmarks/run_nccl_busbw.py --build "$BUILD" || status=1
timeout 900 "$PYTHON" benchmarks/run_tp_gpu.py --build "$BUILD" || status=1
exit $status
