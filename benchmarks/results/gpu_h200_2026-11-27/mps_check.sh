#!/bin/bash
# Device check 3: 16 GPU workers (K=16, fp32) without and with CUDA's multi-process service (MPS).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv; nproc; command -v nvidia-cuda-mps-control; } > $OUT/mps.txt 2>&1
bench() { timeout 100 python3 benchmarks/bench_training.py --workers 16 --gpu-ids 0 --modes fast,k$1 --no-reference \
  --seconds 42 --warmup 20 --status-interval 6 --json $OUT/bench_$2_k$1.json >> $OUT/bench.txt 2>&1; echo "$2 k$1 rc=$? $(date -u)" >> $OUT/mps.txt; }
bench 16 plain
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log; mkdir -p /tmp/mps_pipe /tmp/mps_log
if nvidia-cuda-mps-control -d >> $OUT/mps.txt 2>&1; then
  sleep 1; echo "MPS daemon started" >> $OUT/mps.txt
  bench 16 mps
  bench 32 mps
  echo quit | nvidia-cuda-mps-control >> $OUT/mps.txt 2>&1
  cat /tmp/mps_log/control.log >> $OUT/mps.txt 2>&1
else
  echo "MPS daemon failed to start" >> $OUT/mps.txt
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
bench 32 plain
