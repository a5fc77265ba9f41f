"""Where an agent loses points: the steps from the previous point to each point lost.

A mean score says how often an agent loses, not when. This plays greedy games as
`gym_eval.py` does (same flags, same wrappers, the argmax action) and, for every reward of
the game, notes how many agent steps passed since the previous one (the rally, in Pong). It
prints how the lost points (negative rewards) spread over those lengths and how many of them
fell in the commonest length, so a weakness tied to one moment of the game (in Pong: the
first return after a serve) shows as a spike:

    python benchmarks/points_lost.py --env PongNoFrameskip-v4 \
        --model trained_models/PongNoFrameskip-v4.dat --num-episodes 12 \
        --repeat-action-probability 0.25

With ``--out FILE`` the rallies of every game go to a JSON file as well.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import gymnasium as gym
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoint import checkpoint_path, load_weights  # noqa: E402
from cli import parse_eval_args  # noqa: E402
from environment import (  # noqa: E402
    env_config,
    make_env,
    read_config,
    register_games,
    was_real_done,
)
from model import build_model  # noqa: E402
from player_util import force_real_reset  # noqa: E402
from utils import UsageError  # noqa: E402


def rallies(rewards: list[float]) -> list[tuple[float, int]]:
    """Each non-zero reward with the steps since the previous one (or the game's start).

    Args:
        rewards: the game's reward at every agent step, in order.

    Returns:
        ``(reward, steps)`` pairs; ``steps`` counts the rewarded step itself.
    """
    out, last = [], 0
    for step, reward in enumerate(rewards, 1):
        if reward:
            out.append((reward, step - last))
            last = step
    return out


@torch.no_grad()
def play(model: torch.nn.Module, env: gym.Env, seed: int) -> list[float]:
    """One greedy game from a real reset; returns the reward of every agent step.

    Lost lives go on with the same game, the LSTM state afresh, as `GreedyPlayer` plays.
    """
    force_real_reset(env)
    obs, _ = env.reset(seed=seed)
    hx, cx = model.initial_state(1, "cpu")
    rewards: list[float] = []
    while True:
        state = torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)
        _, logits, hx, cx = model(state, hx, cx)
        obs, reward, terminated, truncated, _ = env.step(int(logits.argmax(1)))
        rewards.append(float(reward))
        if terminated or truncated:
            if was_real_done(env):
                return rewards
            obs, _ = env.reset()
            hx, cx = model.initial_state(1, "cpu")


def main(argv: list[str] | None = None) -> int:
    """Play the games and print where the points were lost; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--out", default="", help="write every game's rallies here (JSON)")
    mine, rest = extra.parse_known_args(argv)
    torch.set_num_threads(1)
    try:
        args = parse_eval_args(rest)
        register_games()
        conf = env_config(read_config(args.env_config), args.env)
        env = make_env(
            args.env,
            conf,
            args.max_episode_length,
            args.skip_rate,
            repeat_action_probability=args.repeat_action_probability,
        )
        model = build_model(env.observation_space, env.action_space, args.hidden_size)
        load_weights(model, args.model or checkpoint_path(args.load_model_dir, args.env))
    except UsageError as error:
        print(f"points_lost.py: error: {error}", file=sys.stderr)
        return 2
    model.eval()
    games, lost = [], collections.Counter()
    for game in range(args.num_episodes):
        game_rallies = rallies(play(model, env, args.seed + game))
        games.append(game_rallies)
        for reward, steps in game_rallies:
            if reward < 0:
                lost[steps] += 1
        print(f"game {game + 1}: {sum(r for r, _ in game_rallies):+g}", flush=True)
    total = sum(lost.values())
    scores = [sum(r for r, _ in g) for g in games]
    print(f"{len(games)} games, mean {sum(scores) / len(scores):.2f}, {total} points lost")
    if total:
        length, count = lost.most_common(1)[0]
        print(f"commonest length of a lost point: {length} steps, {count} of {total}")
        print("lost points by steps since the previous point:", dict(sorted(lost.items())))
    if mine.out:
        Path(mine.out).write_text(json.dumps({"games": games}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
