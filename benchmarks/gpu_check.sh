#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (the `device` tool), which has
# python3 with torch, torchvision, cloudpickle, pandas, fsspec and pytest, and no network:
# lockstep is used from src/ as it is. Runs the GPU tests (with 2 GPUs also FSDP and the hang
# detector's NCCLHangError naming the NCCL collective), then seed 000's ResNet18 images/s
# (lockstep vs plain PyTorch). Meant to finish in under 8 minutes. Results go to $OUT when set.
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
tests_status=${PIPESTATUS[0]}
timeout 240 python3 benchmarks/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
bench_status=${PIPESTATUS[0]}
echo "gpu tests exit $tests_status, gpu bench exit $bench_status"
exit $(( tests_status || bench_status ))
