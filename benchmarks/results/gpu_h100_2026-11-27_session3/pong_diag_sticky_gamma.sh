#!/bin/bash
# Issue 25, the same session's second device call (the machine still warm): is it the discount?
# Two runs side by side under MPS for 3.5 min, 8 workers x 16 envs each, sticky 0.25, lr 0.0001
# constant, gamma 0.99 against 0.998. (The call's last line, a tar of both run directories, was
# over the size that comes back; a third call copied the logs and run records.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log; nvidia-cuda-mps-control -d
for g in 0.99 0.998; do
  mkdir -p /tmp/d$g
  timeout -s INT -k 20 215 python3 main.py --env PongNoFrameskip-v4 --workers 8 --gpu-ids 0 --envs-per-worker 16 \
    --amsgrad --lr 0.0001 --repeat-action-probability 0.25 --gamma $g --seed 1 --test-niceness 0 \
    --save-model-dir /tmp/d$g/ --log-dir /tmp/d$g/ > /tmp/d$g/stdout.txt 2>&1 &
done
wait
echo quit | nvidia-cuda-mps-control
