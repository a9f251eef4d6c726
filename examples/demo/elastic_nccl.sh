#!/usr/bin/env bash
# In-process recovery on NCCL (a GPU check: tools/dev/gpu_checks.py runs it
# as `elastic_nccl`). examples/elastic/train.py trains on CUDA tensors with
# the NCCL backend under torchrun (dp x tp2 on --np ranks), one rank is
# SIGKILLed from outside at a random moment by the test's driver, and the
# survivors abort their communicators, shrink the root (revoke + shrink, or
# NCCL_SHRINK_ABORT, or a fresh initialisation: by the NCCL version), rebuild
# the World and finish; the final parameters are compared with a reference
# trained in one process. It is tests/python/test_elastic_faults.py with
# STRATA_ELASTIC_NP and STRATA_ELASTIC_DEVICE=cuda.
#
#   examples/demo/elastic_nccl.sh [--np 4] [--python python3]
#
# Several ranks on one GPU need NCCL >= 2.30 with
# NCCL_MULTI_RANK_GPU_ENABLE=1 (the GPU suite sets it; set here too when
# the ranks outnumber the GPUs). Exit 0 when the survivors recovered and
# ended equal to the reference.
set -euo pipefail
np=4
python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --np) np=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) echo "elastic_nccl.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "$0")/../.." && pwd)
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
  echo "elastic_nccl.sh: no CUDA device visible" >&2
  exit 1
fi
if [ "$np" -gt "$gpus" ]; then
  export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1}
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
fi
export STRATA_ELASTIC_LAUNCHER=torchrun STRATA_ELASTIC_CASE=kill-random
export STRATA_ELASTIC_NP=$np STRATA_ELASTIC_DEVICE=cuda
exec "$python" -m pytest -q -s -p no:cacheprovider "$root/tests/python/test_elastic_faults.py"
