#!/usr/bin/env bash
# Every GPU check of strata as one prepared run, for the device machine (one
# GPU or more): builds what the checks need (with CUDA and NCCL), then runs,
# each under its own time limit, the C++ and Python GPU tests with 1, 2, 4
# and 8 NCCL ranks (several ranks on one GPU where the NCCL in use allows
# it: >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1), the NCCL fault path with a
# rank SIGKILLed inside an allreduce, the tensor-parallel layers on CUDA
# against torch, the pipeline runner over NCCL, and the GPU benchmarks (NCCL
# busbw and TP kernels against torch, checkpoint staging against cudaMemcpy)
# and the CPU pipeline benchmark on the machine's quiet cores. One JSON
# result per check in benchmarks/results/gpu_checks.json, a one-screen
# summary at the end; the whole run fits in 8 minutes on one H200.
#
#   tools/dev/gpu_checks.sh [--build build] [--budget 480] [--only REGEX] [--out DIR]
#   tools/dev/gpu_checks.sh --dry-run      # build, list each check and why it skips here
#   tools/dev/gpu_checks.sh --pack         # here: fetch what a bare device machine lacks
#
# Without a GPU it is a dry run (exit 0 unless the build fails or a check
# names a program that does not exist): `make test` runs it so
# (gpu_checks_dry_run). The checks are a table in tools/dev/gpu_checks.py;
# docs/development.md says how to run this on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
# The old form, `gpu_checks.sh <build-dir>`, still works.
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then
  set -- --build "$@"
fi
exec "$PYTHON" tools/dev/gpu_checks.py "$@"
