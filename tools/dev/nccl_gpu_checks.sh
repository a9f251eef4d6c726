#!/usr/bin/env bash
# The NCCL backend's GPU checks as one prepared run, for a machine with
# GPUs (the device machine): the C++ GPU tests, the Python CUDA-tensor
# test, and the bus-bandwidth benchmark against torch.distributed NCCL.
# Without a GPU every part skips or says "no GPU".
#
#   tools/dev/nccl_gpu_checks.sh [build-dir]      # default: build
#
# Exits non-zero if a test fails; the benchmark writes
# benchmarks/results/nccl_busbw.json and regenerates benchmarks/RESULTS.md.
set -euo pipefail
BUILD=${1:-build}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
nvidia-smi -L || echo "nvidia-smi: no GPU listed"
cmake --build "$BUILD" --target nccl_gpu_test nccl_library_test nccl_watchdog_test _strata
status=0
ctest --test-dir "$BUILD" -R 'NcclGpu|NcclApiLoad|NcclRoot|py_nccl$' --output-on-failure \
  --timeout 300 || status=1
PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" \
  timeout 900 "$PYTHON" benchmarks/run_nccl_busbw.py --build "$BUILD" || status=1
exit $status
