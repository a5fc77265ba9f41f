#!/bin/bash
# Issue 25 diagnosis: does the GPU path learn Pong from scratch at the CPU's known-good setting
# (A: 2 workers x 8 envs, lr 0.00045 linear), and does 12 workers x 16 envs at lr 0.0001 (B)?
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log; mkdir -p /tmp/mps_pipe /tmp/mps_log
nvidia-cuda-mps-control -d && echo "MPS on at $(( $(date +%s) - T0 )) s"
mkdir -p /tmp/A /tmp/B
timeout -s INT -k 30 225 python3 main.py --env PongNoFrameskip-v4 --workers 2 --gpu-ids 0 --envs-per-worker 8 --amsgrad \
  --lr 0.00045 --lr-schedule linear --max-steps 1500000 --seed 1 --test-niceness 0 --test-interval 0 \
  --save-model-dir /tmp/A --log-dir /tmp/A > /tmp/A/stdout.txt 2>&1 &
timeout -s INT -k 30 225 python3 main.py --env PongNoFrameskip-v4 --workers 12 --gpu-ids 0 --envs-per-worker 16 --amsgrad \
  --lr 0.0001 --seed 1 --test-niceness 0 --test-interval 0 \
  --save-model-dir /tmp/B --log-dir /tmp/B > /tmp/B/stdout.txt 2>&1 &
wait
echo "done at $(( $(date +%s) - T0 )) s"
echo quit | nvidia-cuda-mps-control
tar czf $OUT/diag.tgz -C /tmp A/stdout.txt B/stdout.txt A/PongNoFrameskip-v4_log B/PongNoFrameskip-v4_log A/PongNoFrameskip-v4_run.json B/PongNoFrameskip-v4_run.json
