#!/bin/bash
# Device check, 2026-11-29 (one call): the GPU tests (with the end-to-end run of
# `main.py --gpu-ids 0`, its --load and `gym_eval.py --gpu-id 0`), the rest of the suite but the
# cluster's (no Ray there) on a machine where CUDA is available, then 16 GPU workers (K=16,
# fp32) without and with CUDA's multi-process service (MPS), 75-s runs with 25 s of warm-up
# (their timed windows came to 35-40 s). Committed under other names: pytest_rest.txt as
# pytest_rest_n8.txt (its pytest-benchmark warnings dropped). The "== ..." markers appended to
# dmon.txt were overwritten by dmon's own writes (its file was opened with >, not >>).
t0=$(date +%s); mark() { echo "$1 at $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv; nproc
  lscpu | grep 'Model name'; grep -o 'avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u; free -g
  python3 -c "import torch, gymnasium, ale_py; print('torch', torch.__version__, 'gymnasium', gymnasium.__version__, 'ale_py', ale_py.__version__)"; } > $OUT/machine.txt 2>&1
mark "set up"
timeout 150 python3 -m pytest -m gpu -v -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1; mark "pytest -m gpu rc=$?"
timeout 170 python3 -m pytest -q -n 8 -p no:cacheprovider --ignore=tests/test_cluster.py -m "not gpu" > $OUT/pytest_rest.txt 2>&1; mark "pytest -n 8 (not gpu, no cluster) rc=$?"
nvidia-smi dmon -s u -d 1 > $OUT/dmon.txt 2>&1 &
bench() { echo "== $2 k$1 from $(( $(date +%s) - t0 )) s" >> $OUT/dmon.txt
  timeout 110 python3 benchmarks/bench_training.py --workers 16 --gpu-ids 0 --modes fast,k$1 --no-reference \
    --seconds 75 --warmup 25 --status-interval 5 --json $OUT/bench_$2_k$1.json >> $OUT/bench.txt 2>&1; mark "bench $2 k$1 rc=$?"; }
bench 16 plain
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log; mkdir -p /tmp/mps_pipe /tmp/mps_log
if nvidia-cuda-mps-control -d >> $OUT/machine.txt 2>&1; then
  sleep 1; mark "MPS daemon started"; bench 16 mps; echo quit | nvidia-cuda-mps-control
else
  mark "MPS daemon failed to start"
fi
kill %1 2>/dev/null; mark "done"
