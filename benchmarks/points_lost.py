r"""Where an agent loses points: the steps from the previous point to each point lost.

A mean score says how often an agent loses, not when. This plays the games `gym_eval.py`
plays in one process (the same flags, seeds, wrappers and greedy player) and, for every
reward of a game, notes how many agent steps passed since the previous one (the rally, in
Pong). It prints how the lost points (negative rewards) spread over those lengths and how
many fell at the commonest length, so a weakness tied to one moment of the game (in Pong:
the first return of a serve) shows as a spike:

    python benchmarks/points_lost.py --env PongNoFrameskip-v4 \
        --model trained_models/PongNoFrameskip-v4.dat --num-episodes 12 \
        --repeat-action-probability 0.25

``--out FILE`` also writes every game's rallies as JSON. The games are played in one process,
without a window or video: ``--processes``, ``--render``, ``--new-gym-eval`` and ``--demo``
are refused.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from pathlib import Path
from typing import Any, SupportsFloat

import gymnasium as gym

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_training import check_output_file  # noqa: E402

from checkpoint import checkpoint_path, write_json_atomic  # noqa: E402
from cli import EvalConfig, parse_eval_args  # noqa: E402
from environment import register_games  # noqa: E402
from gym_eval import INTERRUPTED_EXIT, play_games  # noqa: E402
from player_util import GameResult  # noqa: E402
from utils import UsageError, say_error  # noqa: E402


class RewardLog(gym.Wrapper):
    """Keeps the reward of every step, across the lost-life resets of a game."""

    def __init__(self, env: gym.Env):
        """Wrap `env`; `rewards` starts empty."""
        super().__init__(env)
        self.rewards: list[float] = []

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """`env.step`, noting the reward."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.rewards.append(float(reward))
        return obs, reward, terminated, truncated, info


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


def refuse_unsupported(args: EvalConfig, script: str) -> None:
    """Raise `UsageError` for the gym_eval.py flags `script` (one process, no window) lacks."""
    if args.processes != 1:
        raise UsageError(f"--processes {args.processes}: {script} plays in one process")
    for name in ("render", "new_gym_eval", "demo"):
        if getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: {script} shows and records nothing; drop {flag}")


def parse_watch_args(argv: list[str], script: str) -> tuple[EvalConfig, Path | None]:
    """gym_eval.py's flags and ``--out FILE`` for `script`, which watches games in one process.

    Returns:
        The evaluation's flags and the ``--out`` path (None without it).

    Raises:
        UsageError: a bad flag, one `script` does not do, or an ``--out`` it cannot write.
    """
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--out", default="")
    mine, rest = extra.parse_known_args(argv)
    args = parse_eval_args(rest)
    refuse_unsupported(args, script)
    check_output_file("--out", mine.out)
    return args, Path(mine.out) if mine.out else None


def main(argv: list[str] | None = None) -> int:
    """Play the games and print where the points were lost; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        args, out = parse_watch_args(argv, "points_lost.py")
    except UsageError as error:
        say_error("points_lost.py", error)
        return 2
    register_games()
    watched: list[RewardLog] = []
    games, lost = [], collections.Counter()

    def watch(env: gym.Env) -> gym.Env:
        watched.append(RewardLog(env))
        return watched[-1]

    def report(game: int, result: GameResult) -> None:
        game_rallies = rallies(watched[0].rewards)
        watched[0].rewards = []
        games.append(game_rallies)
        lost.update(steps for reward, steps in game_rallies if reward < 0)
        print(f"game {game}: {result.reward:+g} ({result.ending})", flush=True)

    model = Path(args.model) if args.model else checkpoint_path(args.load_model_dir, args.env)
    try:  # gym_eval.py's games: its seeds, wrappers, model set-up and player
        play_games(
            args, model, range(1, args.num_episodes + 1), args.seed, report,
            logging.getLogger("a3g.points_lost").info, wrap_env=watch,
        )  # fmt: skip
    except UsageError as error:
        say_error("points_lost.py", error)
        return 2
    except KeyboardInterrupt:
        print("points_lost.py: interrupted; nothing written", file=sys.stderr)
        return INTERRUPTED_EXIT
    total = sum(lost.values())
    scores = [sum(r for r, _ in g) for g in games]
    print(f"{len(games)} games, mean {sum(scores) / len(scores):.2f}, {total} points lost")
    if total:
        length, count = lost.most_common(1)[0]
        print(f"commonest length of a lost point: {length} steps, {count} of {total}")
        print("lost points by steps since the previous point:", dict(sorted(lost.items())))
    if out is not None:
        write_json_atomic({"games": games}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
