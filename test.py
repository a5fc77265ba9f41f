"""The evaluation process: greedy games with the latest weights, log, TensorBoard, checkpoints."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from checkpoint import RunPaths, cpu_state_dict, save_atomic, untrained
from cli import TrainConfig, as_dict
from environment import (
    EnvSpec,
    frames_per_step,
    load_normalizer_state,
    make_env,
    normalizer_state,
)
from model import build_model
from player_util import STOPPED, GreedyPlayer
from utils import (
    FIRST_START,
    ProcessContext,
    ProcessStart,
    child_process,
    format_elapsed,
    setup_logger,
    worker_device,
)


@dataclass(frozen=True)
class TestStart:
    """What the test process starts from: the run's settings and where the run stands."""

    config: TrainConfig
    spec: EnvSpec
    paths: RunPaths
    run_dir: str  # the run's TensorBoard folder: its name in the log
    rewards: tuple[float, ...] = ()  # the run's test rewards so far
    normalizer: dict | None = None
    dat_score: float | None = None  # the score of the weights in <env>.dat (None: not known)
    steps_at_start: int = 0  # the launcher's count: the workers step while this one starts
    start: ProcessStart = FIRST_START


def run_test(begin: TestStart, shared_model: nn.Module, ctx: ProcessContext) -> None:
    """Play greedy games with the latest shared weights until stopped; log, save, report each."""
    config, paths, start = begin.config, begin.paths, begin.start
    device = worker_device(config.test_gpu)
    log = setup_logger(f"a3g.test.{config.env}", paths.log)
    block = {
        **as_dict(config), "tensorboard_dir": begin.run_dir, "steps_at_start": begin.steps_at_start
    }  # fmt: skip
    for key, value in sorted(block.items()):
        log.info(f"{key}: {value}")

    torch_seed, game_seed = (config.seed,) * 2 if start.first else start.seeds(config.seed, None, 2)
    torch.manual_seed(torch_seed)
    env = make_env(begin.spec)
    model = build_model(env.observation_space, env.action_space, config.hidden_size).to(device)
    if config.fast_path and model.channels_last_suits(device):  # greedy play is fp32
        # The workers' acting layout: faster on the CPU, so test games score newer weights.
        model.use_channels_last()
    model.eval()
    player = GreedyPlayer(model, env, device)
    load_normalizer_state(env, begin.normalizer)

    frames_per = frames_per_step(config.env, config.frame_skip)
    games = len(begin.rewards)
    reward_total = float(sum(begin.rewards))
    bar = -math.inf if begin.dat_score is None else begin.dat_score  # what --save-max must match
    seed: int | None = game_seed
    while not ctx.stopping():
        model.load_state_dict(shared_model.state_dict())
        taken = ctx.total_steps(), time.time() - ctx.start_time  # how far the run was then
        game = player.play_game(seed, config.stall_steps, should_stop=ctx.stopping)
        seed = None
        if game.ending == STOPPED:
            break
        games += 1
        reward_total += game.reward
        steps = ctx.total_steps()
        elapsed = time.time() - ctx.start_time
        frames = int(steps * frames_per)
        log.info(
            f"Time {format_elapsed(elapsed)}, episode reward {game.reward}, "
            f"episode length {game.length}, reward mean {reward_total / games:.4f}, "
            f"total steps {steps}, total frames {frames}, "
            f"frames/s {frames / max(elapsed, 1e-9):.0f}{game.note()}"
        )
        saved = False
        if not untrained(config.load, taken[0]) and (not config.save_max or game.reward >= bar):
            try:
                save_atomic(cpu_state_dict(model), paths.model)
            except OSError as err:
                log.error(f"could not save {paths.model} ({err}); the previous file is kept")
            else:
                saved, bar = True, game.reward
        ctx.report(
            "test",
            {
                "reward": game.reward,
                "length": game.length,
                "ending": game.ending,
                "steps": steps,
                "frames": frames,
                "saved": saved,
                "weights_taken_at": {"steps": taken[0], "seconds": round(taken[1], 1)},
                "normalizer": normalizer_state(env),
            },
        )

        if ctx.wait(config.test_interval):
            break
    env.close()


def test(begin: TestStart, shared_model: nn.Module, ctx: ProcessContext) -> None:
    """Process entry point of the evaluation process (see `run_test`)."""
    with child_process("Test Agent", ctx):
        # Lower priority: the test process takes what the busy workers leave, not a fair share.
        os.nice(begin.config.test_niceness)
        run_test(begin, shared_model, ctx)
