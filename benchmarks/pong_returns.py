r"""How a Pong agent meets the ball: where on its paddle, and how stickiness moved it.

`points_lost.py` says when an agent loses points; this says how. It plays the games
`gym_eval.py` plays in one process (the same flags, seeds, wrappers and greedy player) and
notes every ball that reaches the agent's paddle: returned (where on the paddle it met the
ball: the ball's y minus the paddle's, from the console's RAM) or missed (by how much it
passed), split into the first ball after a point the agent won (the return of the serve)
and the rest, with how many frames of the 40 before it stickiness had changed the agent's
action and where the paddle was 32, 16, 8 and 4 frames before. So a weakness such as "it
meets the serve with the paddle's edge at the last moment, and a repeated action makes it
late" shows in numbers:

    python benchmarks/pong_returns.py --env PongNoFrameskip-v4 \
        --model trained_models/PongNoFrameskip-v4.dat --num-episodes 6 \
        --repeat-action-probability 0.25

Sticky actions are done here, not by ALE, so that each frame's chosen and played actions
are known: ALE's stickiness is off and each raw frame plays, with probability
``--repeat-action-probability``, the previous frame's action instead of the agent's (after a
reset, the previous action is NOOP), which is what ALE does, with this script's random
numbers (seeded with ``--seed``). Pong ids whose ALE plays every frame only (the
``NoFrameskip`` ones): the RAM addresses are Pong's (paddle y 51, ball x 49, ball y 54).
Each contact also carries the policy (the softmax over the six actions) of the decisions
behind the frames 64, 32, 16, 8, 4 and 0 before it, and the report gives, per kind of ball,
its mean entropy and the mean probability of moving the paddle up (RIGHT, RIGHTFIRE) and down
(LEFT, LEFTFIRE) there: where the agent is sure of its move and where it does not care.
``--sample-actions`` plays the action drawn from that softmax instead of its argmax (the
policy the workers train on, where gym_eval.py plays the greedy one), with draws seeded from
``--seed``.

``--out FILE`` also writes every contact as JSON, with each game's reward, the seed and the
model file's SHA-256. ``--processes``, ``--render``, ``--new-gym-eval`` and ``--demo`` are
refused.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from points_lost import parse_watch_args  # noqa: E402

from checkpoint import checkpoint_path, file_sha256, write_json_atomic  # noqa: E402
from environment import lookup_spec, register_games, sticky_probability  # noqa: E402
from gym_eval import INTERRUPTED_EXIT, play_games  # noqa: E402
from player_util import GameResult  # noqa: E402
from utils import UsageError  # noqa: E402

PADDLE_Y, BALL_X, BALL_Y = 51, 49, 54  # Pong's RAM: the agent's (right) paddle, the ball
PADDLE_COLUMN = 189  # ball x past this has passed the agent's paddle
TURN_ZONE = (170, 200)  # ball x where a turn back is the agent's return
STUCK_WINDOW = 40  # frames before a contact in which stickiness is counted
PATH_FRAMES = (32, 16, 8, 4, 0)  # frames before a contact at which the paddle's y is noted
POLICY_FRAMES = (64, 32, 16, 8, 4, 0)  # frames before a contact whose decision's policy is noted
UP, DOWN = (2, 4), (3, 5)  # Pong's RIGHT(FIRE) moves the agent's paddle up, LEFT(FIRE) down


@dataclasses.dataclass(frozen=True)
class Frame:
    """One raw frame: the agent's action, the one played, the reward and the RAM positions."""

    chosen: int
    played: int
    reward: float
    paddle_y: int
    ball_x: int
    ball_y: int
    policy: tuple[float, ...] = ()  # the softmax of the decision that chose `chosen`


@dataclasses.dataclass(frozen=True)
class Contact:
    """A ball that reached the agent's paddle."""

    returned: bool
    serve: bool  # the first ball to reach the agent after a point it won
    offset: int  # ball y - paddle y where the ball met (or passed) the paddle's column
    stuck: int  # frames in the STUCK_WINDOW before it where stickiness changed the action
    frame: int  # the frame's index in the game
    paddle_path: tuple[int, ...]  # the paddle's y PATH_FRAMES before it
    policy_path: tuple[tuple[float, ...], ...] = ()  # the policy POLICY_FRAMES before it


def contacts(frames: list[Frame]) -> list[Contact]:
    """Every ball that reached the agent's paddle in one game, in order.

    A return is a frame where the ball's x, rising, turns back inside TURN_ZONE; a miss is a
    point lost, measured at the last frame before the ball passed PADDLE_COLUMN.
    """
    found: list[Contact] = []
    last_point, returned_since = 0, 0

    def stuck_before(i: int) -> int:
        window = frames[max(0, i - STUCK_WINDOW) : i]
        return sum(f.chosen != f.played for f in window)

    def path(i: int) -> tuple[int, ...]:
        return tuple(frames[max(0, i - k)].paddle_y for k in PATH_FRAMES)

    def policies(i: int) -> tuple[tuple[float, ...], ...]:
        return tuple(frames[max(0, i - k)].policy for k in POLICY_FRAMES)

    for i, frame in enumerate(frames):
        serve = last_point > 0 and returned_since == 0
        if i >= 2 and frames[i - 2].ball_x < frames[i - 1].ball_x > frame.ball_x:
            turn = frames[i - 1]
            if TURN_ZONE[0] <= turn.ball_x <= TURN_ZONE[1]:
                offset = turn.ball_y - turn.paddle_y
                found.append(
                    Contact(True, serve, offset, stuck_before(i - 1), i - 1, path(i - 1),
                            policies(i - 1))
                )  # fmt: skip
                returned_since += 1
        if frame.reward < 0:
            j = i
            while j > 0 and frames[j].ball_x > PADDLE_COLUMN:
                j -= 1
            offset = frames[j].ball_y - frames[j].paddle_y
            found.append(Contact(False, serve, offset, stuck_before(j), j, path(j), policies(j)))
        if frame.reward:
            last_point, returned_since = int(np.sign(frame.reward)), 0
    return found


class PolicyRecorder:
    """Notes the policy of each decision the network makes; may play a sampled action instead.

    Hooked on the network's forward (`attach`), so the greedy player plays on unchanged: with
    `sample`, the logits it takes the argmax of are replaced by ones whose argmax is the
    action drawn from the softmax.
    """

    def __init__(self, sample: bool, seed: int):
        """Play drawn actions when `sample`, drawn from a generator seeded with `seed`."""
        self.sample = sample
        self.generator = torch.Generator().manual_seed(seed)
        self.latest: tuple[float, ...] = ()

    def attach(self, model: torch.nn.Module) -> None:
        """Hook `model`'s forward (one env's step: value, logits, hx, cx)."""
        model.register_forward_hook(self.seen)

    def seen(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        """The forward hook: note the softmax; return the output to play (None: unchanged)."""
        value, logits, hx, cx = output
        probs = torch.softmax(logits.detach().float().cpu(), dim=1)[0]
        self.latest = tuple(probs.tolist())
        if not self.sample:
            return None
        action = int(torch.multinomial(probs, 1, generator=self.generator))
        drawn = torch.full_like(logits, float("-inf"))
        drawn[0, action] = 0.0
        return value, drawn, hx, cx


class StickyRecorder:
    """Plays each raw frame with stickiness done here and records it (see the module doc)."""

    def __init__(self, probability: float, seed: int, policy: PolicyRecorder | None = None):
        """Stickiness `probability` per frame, drawn from a generator seeded with `seed`.

        Each frame notes `policy`'s latest decision (none without it).
        """
        self.probability = probability
        self.rng = np.random.default_rng(seed)
        self.policy = policy
        self.frames: list[Frame] = []
        self.previous = 0

    def attach(self, env: gym.Env) -> gym.Env:
        """Route the ALE env under `env`'s wrappers through this recorder; returns `env`."""
        atari = env.unwrapped
        step, reset = atari.step, atari.reset

        def sticky_step(action: Any) -> Any:
            chosen = int(action)
            played = self.previous if self.rng.random() < self.probability else chosen
            self.previous = played
            result = step(played)
            ram = atari.ale.getRAM()
            self.frames.append(
                Frame(chosen, played, float(result[1]), int(ram[PADDLE_Y]), int(ram[BALL_X]),
                      int(ram[BALL_Y]), self.policy.latest if self.policy is not None else ())
            )  # fmt: skip
            return result

        def sticky_reset(**kwargs: Any) -> Any:
            self.previous = 0
            if self.policy is not None:
                self.policy.latest = ()  # the no-op starts' frames belong to no decision
            return reset(**kwargs)

        atari.step, atari.reset = sticky_step, sticky_reset
        return env


def check_env(env_id: str) -> None:
    """Raise `UsageError` unless `env_id` is a Pong id whose ALE plays single frames."""
    spec = lookup_spec(env_id)
    if spec.kwargs.get("game") != "pong" or spec.kwargs.get("frameskip", 1) != 1:
        raise UsageError(
            f"--env {env_id}: pong_returns.py reads Pong's RAM frame by frame; use "
            "PongNoFrameskip-v4"
        )


def summary(found: list[Contact]) -> list[str]:
    """The report's lines: per kind of ball, returns and misses with offsets and stickiness."""
    lines = []
    for serve, name in ((True, "serve (first ball after a point won)"), (False, "other balls")):
        for returned in (True, False):
            picked = [c for c in found if c.serve == serve and c.returned == returned]
            if not picked:
                continue
            stuck = sum(c.stuck for c in picked) / len(picked)
            offsets = dict(sorted(collections.Counter(c.offset for c in picked).items()))
            path = [round(sum(c.paddle_path[k] for c in picked) / len(picked)) for k in range(5)]
            lines.append(
                f"{name}, {'returned' if returned else 'missed'}: {len(picked)}; frames changed "
                f"by stickiness in the {STUCK_WINDOW} before, mean {stuck:.2f}; "
                f"ball y - paddle y: {offsets}; paddle y {PATH_FRAMES} frames before, "
                f"mean: {path}"
            )
            policy = policy_means(picked)
            if policy:
                lines.append(f"  policy {POLICY_FRAMES} frames before, mean: {policy}")
    return lines


def policy_means(picked: list[Contact]) -> str:
    """The mean entropy (nats), P(up) and P(down) of `picked`'s policies at each POLICY_FRAMES.

    Over the contacts with a policy noted at each of them (not one in a game's no-op start),
    saying how many where some lack one; empty where none has.
    """
    full = [c for c in picked if len(c.policy_path) == len(POLICY_FRAMES) and all(c.policy_path)]
    if not full:
        return ""
    probs = np.array([c.policy_path for c in full])  # contacts x POLICY_FRAMES x actions
    entropy = -(probs * np.log(np.clip(probs, 1e-12, None))).sum(-1).mean(0)
    up, down = probs[..., list(UP)].sum(-1).mean(0), probs[..., list(DOWN)].sum(-1).mean(0)
    means = "; ".join(
        f"H {h:.2f} up {u:.2f} down {d:.2f}" for h, u, d in zip(entropy, up, down, strict=True)
    )
    return means if len(full) == len(picked) else f"{means} ({len(full)} of {len(picked)})"


def as_row(contact: Contact) -> dict[str, Any]:
    """`contact` as a JSON row, its probabilities to 4 decimals."""
    row = dataclasses.asdict(contact)
    row["policy_path"] = [[round(p, 4) for p in policy] for policy in contact.policy_path]
    return row


def main(argv: list[str] | None = None) -> int:
    """Play the games and print how the balls were met; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--sample-actions", action="store_true")
    mine, rest = own.parse_known_args(argv)
    sample = mine.sample_actions
    try:
        args, out = parse_watch_args(rest, "pong_returns.py")
        check_env(args.env)
    except UsageError as error:
        print(f"pong_returns.py: error: {error}", file=sys.stderr)
        return 2
    register_games()
    probability = sticky_probability(args.env, args.repeat_action_probability)
    policy = PolicyRecorder(sample, args.seed)
    recorder = StickyRecorder(probability, args.seed, policy)
    games: list[list[Contact]] = []
    rewards: list[float] = []

    def report(game: int, result: GameResult) -> None:
        games.append(contacts(recorder.frames))
        rewards.append(result.reward)
        recorder.frames = []
        print(f"game {game}: {result.reward:+g} ({result.ending})", flush=True)

    model = Path(args.model) if args.model else checkpoint_path(args.load_model_dir, args.env)
    ale_off = dataclasses.replace(args, repeat_action_probability=0.0)
    try:  # gym_eval.py's games: its seeds, wrappers, model set-up and player
        play_games(
            ale_off, model, range(1, args.num_episodes + 1), args.seed, report,
            logging.getLogger("a3g.pong_returns").info, wrap_env=recorder.attach,
            watch_model=policy.attach,
        )  # fmt: skip
    except UsageError as error:
        print(f"pong_returns.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pong_returns.py: interrupted; nothing written", file=sys.stderr)
        return INTERRUPTED_EXIT
    found = [c for game in games for c in game]
    actions = "sampled" if sample else "greedy"
    print(
        f"{len(games)} games, sticky actions {probability:g} (done here, not by ALE), "
        f"{actions} actions"
    )
    print("\n".join(summary(found)))
    if out is not None:
        rows = [[as_row(c) for c in game] for game in games]
        write_json_atomic(
            {
                "model": str(model), "model_sha256": file_sha256(model), "seed": args.seed,
                "sticky": probability, "actions": actions, "rewards": rewards, "games": rows,
            },
            out,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
