"""Where one training worker's time goes, per agent step, fast path against reference path.

Runs the worker's loop (weight sync, n-step rollout on a real env, loss, backward, gradient
hand-off, optimizer step) in this one process on one thread, timing each phase, for
``--seconds`` per path after ``--warmup-updates`` updates, alternating the two paths
``--rounds`` times so that a noisy machine affects both alike.

    python benchmarks/bench_step.py --seconds 30 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from environment import make_env  # noqa: E402
from main import parse_args  # noqa: E402
from model import A3Clstm, build_model  # noqa: E402
from player_util import Agent  # noqa: E402
from train import a3c_loss, make_optimizer, sync_weights  # noqa: E402
from utils import ensure_shared_grads, read_config  # noqa: E402

PHASES = ("sync", "act+env", "replay", "bootstrap", "loss", "backward", "optimizer")


def profile(env_id: str, fast: bool, seconds: float, warmup_updates: int) -> dict[str, float]:
    """Milliseconds per agent step in each phase of the worker loop."""
    args = parse_args(["--env", env_id, "--env-config", str(ROOT / "config.json")])
    env = make_env(args.env, read_config(args.env_config), args)
    shared = build_model(env.observation_space, env.action_space, args)
    shared.share_memory()
    optimizer = make_optimizer(shared.parameters(), args)
    model = build_model(env.observation_space, env.action_space, args)
    if fast and isinstance(model, A3Clstm):
        model.use_channels_last()
    agent = Agent(model, env)
    agent.reset(seed=args.seed)
    totals: dict[str, float] = defaultdict(float)
    steps, updates = 0, 0
    clock = time.perf_counter
    end = None
    while end is None or clock() < end:
        if updates == warmup_updates:
            totals.clear()
            steps, end = 0, clock() + seconds
        t0 = clock()
        sync_weights(model, shared)
        if agent.done:
            agent.reset()
        else:
            agent.detach_lstm()
        t1 = clock()
        act = agent.action_explore if fast else agent.action_train
        for _ in range(args.num_steps):
            act()
            if agent.done:
                break
        t2 = clock()
        if fast:
            agent.replay_rollout()
        t3 = clock()
        bootstrap = agent.bootstrap_value()
        t4 = clock()
        terms = a3c_loss(
            agent.values, agent.log_probs, agent.rewards, agent.entropies, bootstrap, args
        )
        t5 = clock()
        model.zero_grad(set_to_none=True)
        terms.total.backward()
        t6 = clock()
        ensure_shared_grads(model, shared)
        optimizer.step()
        t7 = clock()
        for phase, (a, b) in zip(
            PHASES,
            [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t6, t7)],
            strict=True,
        ):
            totals[phase] += b - a
        steps += len(agent.rewards)
        updates += 1
        agent.clear_actions()
    env.close()
    out = {phase: 1e3 * totals[phase] / steps for phase in PHASES}
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
