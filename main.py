"""A3G launcher: parse the configuration once, build and share the model, start the processes."""

from __future__ import annotations

import argparse
import math
import sys

from utils import UsageError

DEFAULT_ENV = "PongNoFrameskip-v4"


def build_parser() -> argparse.ArgumentParser:
    """The training command line: the original A3G's flags (same names and defaults) and ours."""
    p = argparse.ArgumentParser(
        description="A3G: train an A3C-LSTM agent with Hogwild workers on CPUs and GPUs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--lr", "-l", type=float, default=0.0001, help="learning rate")
    p.add_argument("--entropy-coef", "-ec", type=float, default=0.01, help="entropy bonus weight")
    p.add_argument(
        "--value-coef",
        "-vc",
        type=float,
        default=0.5,
        help="value loss weight (0.5 reproduces the original)",
    )
    p.add_argument("--gamma", "-g", type=float, default=0.99, help="discount factor")
    p.add_argument("--tau", "-t", type=float, default=1.00, help="GAE lambda")
    p.add_argument(
        "--seed", "-s", type=int, default=1, help="random seed; worker RANK uses seed + RANK"
    )
    p.add_argument("--workers", "-w", type=int, default=32, help="training processes")
    p.add_argument(
        "--num-steps", "-ns", type=int, default=20, help="forward steps per update (n-step)"
    )
    p.add_argument(
        "--max-episode-length",
        "-mel",
        type=int,
        default=10000,
        help="agent steps before an episode is cut",
    )
    p.add_argument("--env", "-ev", default=DEFAULT_ENV, help="gymnasium environment id")
    p.add_argument(
        "--shared-optimizer",
        "-so",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="optimizer statistics shared by all workers (--no-shared-optimizer: one per worker)",
    )
    p.add_argument(
        "--load", "-ld", action="store_true", help="start from <load-model-dir><env>.dat"
    )
    p.add_argument(
        "--save-max",
        "-sm",
        action="store_true",
        help="save only when a test score matches or beats the best so far",
    )
    p.add_argument(
        "--optimizer", "-o", default="Adam", choices=["Adam", "RMSprop"], help="optimizer"
    )
    p.add_argument(
        "--load-model-dir", "-lmd", default="trained_models/", help="folder --load reads from"
    )
    p.add_argument(
        "--save-model-dir",
        "-smd",
        default="trained_models/",
        help="folder the test process saves <env>.dat to",
    )
    p.add_argument("--log-dir", "-lg", default="logs/", help="folder of <env>_log")
    p.add_argument(
        "--gpu-ids",
        "-gp",
        type=int,
        nargs="+",
        default=[-1],
        help="GPU ids to spread workers over; -1 = CPU only",
    )
    p.add_argument("--amsgrad", "-a", action="store_true", help="AMSGrad variant of Adam")
    p.add_argument("--skip-rate", type=int, default=4, help="frame skip (NoFrameskip ids)")
    p.add_argument("--hidden-size", "-hs", type=int, default=512, help="LSTM hidden size")
    p.add_argument("--tensorboard-logger", "-tl", action="store_true", help="log to TensorBoard")
    p.add_argument(
        "--env-config", "-evc", default="config.json", help="per-game crop settings (JSON)"
    )
    p.add_argument(
        "--distributed-step-size",
        "-dss",
        type=int,
        nargs="+",
        default=[],
        help="n-step sizes dealt round-robin to workers (overrides --num-steps)",
    )
    p.add_argument(
        "--vector-obs-norm",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="standardise vector observations (CartPole-like envs) with running statistics",
    )
    return p


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Reject values that cannot work, naming the value and the fix.

    Raises:
        UsageError: on the first bad value.
    """
    positive_ints = {
        "--workers": args.workers,
        "--num-steps": args.num_steps,
        "--max-episode-length": args.max_episode_length,
        "--skip-rate": args.skip_rate,
        "--hidden-size": args.hidden_size,
    }
    for flag, value in positive_ints.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    for size in args.distributed_step_size:
        if size < 1:
            raise UsageError(f"--distributed-step-size values must be at least 1, got {size}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    for flag, value in (("--gamma", args.gamma), ("--tau", args.tau)):
        if not 0 < value <= 1:
            raise UsageError(f"{flag} must be in (0, 1], got {value}")
    for flag, value in (("--entropy-coef", args.entropy_coef), ("--value-coef", args.value_coef)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} must be a non-negative number, got {value}")
    if -1 in args.gpu_ids and len(args.gpu_ids) > 1:
        raise UsageError(
            f"--gpu-ids mixes -1 (CPU) with GPU ids {args.gpu_ids}; give only GPU ids, or -1"
        )
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line."""
    return validate_args(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code."""
    try:
        parse_args(argv)
    except UsageError as err:
        print(f"main.py: error: {err}", file=sys.stderr)
        return 2
    print("main.py: training is not implemented yet (see README)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
