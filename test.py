"""The evaluation process: greedy games with the latest weights, log, TensorBoard, checkpoints."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from environment import frames_per_step, load_normalizer_state, make_env, normalizer_state
from model import build_model
from player_util import Agent
from utils import (
    ProcessContext,
    checkpoint_path,
    child_process,
    format_elapsed,
    read_config,
    save_atomic,
    setup_logger,
    worker_device,
)


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the weights, as saved in ``.dat`` files."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def log_file(args: argparse.Namespace) -> Path:
    """``<log-dir><env>_log``."""
    return checkpoint_path(args.log_dir, args.env, "_log")


def run_test(
    args: argparse.Namespace,
    shared_model: nn.Module,
    ctx: ProcessContext,
    resume: dict | None = None,
) -> None:
    """Play greedy games with the latest shared weights until the launcher says stop.

    After each real game over: log the game (the original's line plus total steps, frames and
    frames/s), report it to the launcher (which writes TensorBoard), save
    ``<save-model-dir><env>.dat`` (every game, or only on a new best with ``--save-max``),
    then wait ``--test-interval`` seconds and reload the weights. A lost life continues the
    same game. A failed save is logged and the previous file stays; testing goes on.

    Args:
        args: the run's configuration.
        shared_model: the shared-memory model to evaluate.
        ctx: stop event and counters shared with the launcher.
        resume: a resumed run's ``games``, ``reward_total``, ``best`` and ``normalizer``.
    """
    resume = resume or {}
    device = worker_device(args.gpu_ids[-1])
    log = setup_logger(f"a3g.test.{args.env}", log_file(args))
    for key, value in sorted(vars(args).items()):
        log.info(f"{key}: {value}")

    torch.manual_seed(args.seed)
    env = make_env(args.env, read_config(args.env_config), args)
    model = build_model(env.observation_space, env.action_space, args).to(device)
    model.eval()
    agent = Agent(model, env, device, clip_rewards=False)
    model.load_state_dict(shared_model.state_dict())
    load_normalizer_state(env, resume.get("normalizer"))
    agent.reset(seed=args.seed)

    frames_per = frames_per_step(args.env, args)
    save_path = checkpoint_path(args.save_model_dir, args.env)
    games = int(resume.get("games", 0))
    reward_total = float(resume.get("reward_total", 0.0))
    best = float(resume.get("best", -math.inf))
    reward_sum, length = 0.0, 0
    while not ctx.stopping():
        agent.action_test()
        reward_sum += agent.raw_reward
        length += 1
        if not agent.done:
            continue
        if not agent.real_done:
            agent.reset()  # a lost life: same game, fresh LSTM state as in training
            continue

        games += 1
        reward_total += reward_sum
        steps = ctx.total_steps()
        elapsed = time.time() - ctx.start_time
        frames = steps * frames_per
        log.info(
            f"Time {format_elapsed(elapsed)}, episode reward {reward_sum}, "
            f"episode length {length}, reward mean {reward_total / games:.4f}, "
            f"total steps {steps}, total frames {frames}, "
            f"frames/s {frames / max(elapsed, 1e-9):.0f}"
        )
        best = max(best, reward_sum)
        ctx.report(
            "test",
            {
                "reward": reward_sum,
                "length": length,
                "steps": steps,
                "frames": frames,
                "normalizer": normalizer_state(env),
            },
        )
        if not args.save_max or reward_sum >= best:
            try:
                save_atomic(cpu_state_dict(model), save_path)
            except OSError as err:
                log.error(f"could not save {save_path} ({err}); the previous file is kept")
        reward_sum, length = 0.0, 0

        if ctx.wait(args.test_interval):
            break
        model.load_state_dict(shared_model.state_dict())
        agent.reset()
    env.close()


def test(
    args: argparse.Namespace,
    shared_model: nn.Module,
    ctx: ProcessContext,
    resume: dict | None = None,
) -> None:
    """Process entry point of the evaluation process (see `run_test`)."""
    with child_process("Test Agent", ctx):
        # Lower priority (--test-niceness, 10 by default): while the workers keep every core
        # busy, the test process takes what they leave instead of a fair share.
        os.nice(args.test_niceness)
        run_test(args, shared_model, ctx, resume)
