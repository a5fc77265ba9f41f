"""Where one training worker's time goes, per agent step, fast path against reference path.

Runs the real worker loop (`train.run_worker`: weight sync, n-step rollout on a real env,
loss, backward, gradient hand-off, optimizer step, report) in this one process on one
thread, timing each phase through its `PhaseClock` hook, for ``--seconds`` per path after
``--warmup-updates`` updates, alternating the two paths ``--rounds`` times so that a noisy
machine affects both alike.

    python benchmarks/bench_step.py --seconds 30 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch.multiprocessing as mp  # noqa: E402

from cli import parse_train_args  # noqa: E402
from environment import env_config, make_env, read_config  # noqa: E402
from model import build_model  # noqa: E402
from train import PhaseClock, make_optimizer, run_worker  # noqa: E402
from utils import ProcessContext  # noqa: E402

PHASES = ("sync", "act+env", "replay", "loss", "backward", "optimizer", "report")
"""The worker loop's laps (`train.run_worker`); "loss" includes the bootstrap value."""


def profile(env_id: str, fast: bool, seconds: float, warmup_updates: int) -> dict[str, float]:
    """Milliseconds per agent step in each phase of the real worker loop."""
    flags = ["--env", env_id, "--env-config", str(ROOT / "config.json")]
    config = parse_train_args([*flags, "--fast-path" if fast else "--no-fast-path"])
    env_conf = env_config(read_config(config.env_config), config.env)
    env = make_env(config.env, env_conf, config.max_episode_length, config.skip_rate)
    shared = build_model(env.observation_space, env.action_space, config.hidden_size)
    env.close()
    shared.share_memory()
    optimizer = make_optimizer(shared.parameters(), config.optimizer, config.lr, config.amsgrad)
    ctx = ProcessContext.create(mp.get_context("spawn"))
    clock = PhaseClock()
    updates = 0
    timed_from: tuple[float, int] | None = None  # (time, steps) when timing began

    def on_update(_terms: object) -> None:
        nonlocal updates, timed_from
        updates += 1
        if updates == warmup_updates:
            clock.reset()
            timed_from = (time.perf_counter(), ctx.total_steps())
        elif timed_from is not None and time.perf_counter() - timed_from[0] >= seconds:
            ctx.stop_event.set()

    run_worker(0, config, env_conf, shared, optimizer, ctx, on_update=on_update, clock=clock)
    assert timed_from is not None
    steps = ctx.total_steps() - timed_from[1]
    out = {phase: 1e3 * clock.totals[phase] / steps for phase in PHASES}
    out["total"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    """Alternate the two paths, print ms per step per phase."""
    p = argparse.ArgumentParser(description="Per-step phase timings of one worker.")
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--seconds", type=float, default=30, help="timed seconds per path and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-updates", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'path':10} " + " ".join(f"{ph:>9}" for ph in (*PHASES, "total")) + "  (ms/step)")
    for _ in range(args.rounds):
        for fast in (True, False):
            row = profile(args.env, fast, args.seconds, args.warmup_updates)
            name = "fast" if fast else "reference"
            print(f"{name:10} " + " ".join(f"{row[ph]:9.2f}" for ph in (*PHASES, "total")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
