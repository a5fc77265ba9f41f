#!/bin/bash
# Issue 25: sticky Pong from frame 0 with --gamma 0.998 at lr 0.0001 on one GPU (16 workers x 16 envs,
# fp32, under CUDA MPS), then 100 sticky games of the final weights (<env>.dat: no --save-max here).
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
R=/tmp/run; mkdir -p $R/models $R/logs
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv; nproc; lscpu | grep -E "Model name"; free -g | head -2;
  python3 -c "import torch,gymnasium,ale_py;print('torch',torch.__version__,'gymnasium',gymnasium.__version__,'ale_py',ale_py.__version__)"; } > $R/machine.txt 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log; mkdir -p /tmp/mps_pipe /tmp/mps_log
nvidia-cuda-mps-control -d >> $R/machine.txt 2>&1 && echo "MPS daemon started at $(el) s" >> $R/machine.txt
echo "training starts at $(el) s" >> $R/machine.txt
timeout -s INT -k 40 $(( 485 - $(el) )) python3 main.py --env PongNoFrameskip-v4 --workers 16 --gpu-ids 0 --envs-per-worker 16 \
  --amsgrad --lr 0.0001 --lr-schedule linear --max-steps 6250000 --repeat-action-probability 0.25 --gamma 0.998 \
  --seed 1 --test-niceness 0 --save-model-dir $R/models --log-dir $R/logs > $R/train_stdout.txt 2>&1
echo "training rc=$? ends at $(el) s" >> $R/machine.txt
echo quit | nvidia-cuda-mps-control >> $R/machine.txt 2>&1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
cp $R/models/PongNoFrameskip-v4.dat $OUT/ 2>/dev/null
tar czf $OUT/run.tgz -C $R machine.txt train_stdout.txt logs
timeout $(( 588 - $(el) )) python3 gym_eval.py --env PongNoFrameskip-v4 --model $R/models/PongNoFrameskip-v4.dat --num-episodes 100 \
  --processes 16 --repeat-action-probability 0.25 --log-dir $R/evals/ > $R/evals.txt 2>&1
echo "eval sticky rc=$? ends at $(el) s" >> $R/machine.txt
tar czf $OUT/run.tgz -C $R machine.txt train_stdout.txt evals.txt logs evals
