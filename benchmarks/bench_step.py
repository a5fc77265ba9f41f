"""Where one training worker's time goes, per agent step, in each training mode.

Runs the real worker loop (`train.run_worker`: weight sync, n-step rollout on real envs,
loss, backward, gradient hand-off, optimizer step, report) in this one process on one
thread, timing each phase through its `PhaseClock` hook, for ``--seconds`` per mode after
``--warmup-updates`` updates, alternating the modes ``--rounds`` times so that a noisy
machine affects all alike. A mode is ``fast`` or ``reference`` (``--no-fast-path``), then
optionally ``,kN`` (``--envs-per-worker N``) and ``,bf16`` (``--precision bf16``). It also
times the env alone (random actions, the full wrapper stack), the floor of "act+env".

    python benchmarks/bench_step.py --seconds 30 --rounds 2
    python benchmarks/bench_step.py --modes fast fast,k16 fast,k16,bf16 reference
    python benchmarks/bench_step.py --gpu-ids 0 --modes fast,k1 fast,k16 fast,k16,bf16
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch.multiprocessing as mp  # noqa: E402

from cli import parse_train_args  # noqa: E402
from environment import EnvSpec, make_env  # noqa: E402
from model import build_model  # noqa: E402
from shared_optim import make_optimizer  # noqa: E402
from train import run_worker  # noqa: E402
from utils import ProcessContext, UsageError  # noqa: E402
from validate import check_gpus, check_precision  # noqa: E402

PHASES = ("sync", "act+env", "replay", "loss", "backward", "optimizer", "report")
"""The worker loop's laps (`train.run_worker`); "replay" builds the `Rollout`, bootstrap too."""


class PhaseClock:
    """A timing hook for the worker loop: seconds spent in each phase (for benchmarks).

    The loop calls `lap` at the end of each phase.
    """

    def __init__(self) -> None:
        """No time recorded yet."""
        self.totals: dict[str, float] = defaultdict(float)
        self._last: float | None = None

    def lap(self, phase: str) -> None:
        """Add the time since the previous lap to `phase` (the first lap only starts the clock)."""
        now = time.perf_counter()
        if self._last is not None:
            self.totals[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        """Forget what was recorded (after a warm-up)."""
        self.totals.clear()


def mode_flags(mode: str) -> list[str]:
    """``fast,k16,bf16`` -> the main.py flags of that mode.

    Raises:
        ValueError: an unknown part.
    """
    path, *options = mode.split(",")
    if path not in ("fast", "reference"):
        raise ValueError(f"mode {mode!r} must start with fast or reference")
    flags = ["--fast-path" if path == "fast" else "--no-fast-path"]
    for option in options:
        if option == "bf16":
            flags += ["--precision", "bf16"]
        elif option.startswith("k") and option[1:].isdigit():
            flags += ["--envs-per-worker", option[1:]]
        else:
            raise ValueError(f"unknown part {option!r} in mode {mode!r}; use kN or bf16")
    return flags


def at_least(parser: argparse.ArgumentParser, minimum: float, **flags: float) -> None:
    """Refuse (``parser.error``) a flag below `minimum`: ``at_least(p, 1, workers=0)``."""
    for name, value in flags.items():
        if not value >= minimum:  # NaN too
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be at least {minimum:g}, got {value:g}")


def positive(parser: argparse.ArgumentParser, **flags: float) -> None:
    """Refuse (``parser.error``) a flag that is not above 0: ``positive(p, seconds=0)``."""
    for name, value in flags.items():
        if not value > 0:  # NaN too
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")


def main_py_refusal(flags: Sequence[str]) -> str | None:
    """Why main.py would refuse `flags` at start-up, in its own words, or None if it would not.

    The checks main.py makes before it starts anything: the command line (an unknown flag, a
    bad value) and the hardware (a GPU id this machine lacks, ``--precision bf16`` where the
    CPU or GPU has no bfloat16 kernels). The benchmarks check every configuration with this
    before the first timed run, so that a typo in the last one does not surface after the
    others have run for many minutes, and `profile`, which calls the worker loop directly, does
    not time bf16 on a CPU that would emulate it in slow scalar code.
    """
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            config = parse_train_args(list(flags), prog="main.py")
        check_gpus(config.gpu_ids)
        check_precision(config.precision, config.gpu_ids)
    except UsageError as err:
        return str(err)
    except SystemExit as stop:  # argparse's errors: "main.py: error: <message>; see main.py --help"
        message = messages.getvalue().strip().removeprefix("main.py: error: ")
        return message or f"main.py would exit (code {stop.code}) before training, e.g. for --help"
    return None


def env_alone(env_id: str, steps: int = 2000) -> float:
    """Milliseconds per agent step of the env with its wrappers, random actions."""
    config = parse_train_args(["--env", env_id, "--env-config", str(ROOT / "config.json")])
    env = make_env(EnvSpec.of(config))
    env.reset(seed=0)
    env.action_space.seed(0)
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    elapsed = time.perf_counter() - start
    env.close()
    return 1e3 * elapsed / steps


def profile(
    env_id: str,
    mode: str,
    seconds: float,
    warmup_updates: int,
    ops: int = 0,
    gpu_ids: Sequence[int] = (-1,),
) -> dict[str, float]:
    """Milliseconds per agent step in each phase of the real worker loop.

    With a GPU id in `gpu_ids`, the worker's model runs there (as ``main.py --gpu-ids``).

    With `ops`, also runs PyTorch's profiler over the timed part and prints the `ops` operators
    with the most self CPU time, in ms per agent step (the profiler adds its own overhead to
    every operator, so the phases' totals are the figures to quote; this says what is inside).
    """
    flags = ["--env", env_id, "--env-config", str(ROOT / "config.json")]
    config = parse_train_args([*flags, *mode_flags(mode), "--gpu-ids", *map(str, gpu_ids)])
    spec = EnvSpec.of(config)
    env = make_env(spec)
    shared = build_model(env.observation_space, env.action_space, config.hidden_size)
    env.close()
    shared.share_memory()
    optimizer = make_optimizer(shared.parameters(), config.optimizer, config.lr, config.amsgrad)
    ctx = ProcessContext.create(mp.get_context("spawn"))
    clock = PhaseClock()
    profiler = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if ops else None
    )
    updates = 0
    timed_from: tuple[float, int] | None = None  # (time, steps) when timing began

    def on_update(_terms: object) -> None:
        nonlocal updates, timed_from
        updates += 1
        if updates == warmup_updates:
            clock.reset()
            if profiler is not None:
                profiler.start()
            timed_from = (time.perf_counter(), ctx.total_steps())
        elif timed_from is not None and time.perf_counter() - timed_from[0] >= seconds:
            ctx.request_stop()

    run_worker(0, config, spec, shared, optimizer, ctx, on_update=on_update, lap=clock.lap)
    assert timed_from is not None
    steps = ctx.total_steps() - timed_from[1]
    if profiler is not None:
        profiler.stop()
        rows = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        print(f"{mode}: operators by self CPU time, ms per agent step (profiler on)")
        for event in rows[:ops]:
            per_step = event.self_cpu_time_total / 1e3 / steps
            print(f"  {event.key[:48]:48} {per_step:7.3f}  ({event.count / steps:.1f} calls/step)")
    out = {phase: 1e3 * clock.totals[phase] / steps for phase in PHASES}
    out["total"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    """Alternate the modes, print ms per step per phase."""
    p = argparse.ArgumentParser(description="Per-step phase timings of one worker.")
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--modes", nargs="+", default=["fast", "reference"])
    p.add_argument("--seconds", type=float, default=30, help="timed seconds per mode and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-updates", type=int, default=30)
    p.add_argument(
        "--ops", type=int, default=0, help="profile the first mode's N costliest operators"
    )
    p.add_argument(
        "--gpu-ids", type=int, nargs="+", default=[-1], help="as main.py's (-1: the CPU)"
    )
    args = p.parse_args(argv)
    at_least(p, 1, warmup_updates=args.warmup_updates, rounds=args.rounds)
    positive(p, seconds=args.seconds)
    gpu_flags = ["--gpu-ids", *map(str, args.gpu_ids)]
    for mode in args.modes:
        try:
            refusal = main_py_refusal(["--env", args.env, *mode_flags(mode), *gpu_flags])
        except ValueError as err:
            refusal = str(err)
        if refusal is not None:
            print(f"bench_step.py: error: mode {mode}: {refusal}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    print(f"env alone: {env_alone(args.env):.2f} ms/step (wrappers included, random actions)")
    print(f"{'mode':16} " + " ".join(f"{ph:>9}" for ph in (*PHASES, "total")) + "  (ms/step)")
    if args.ops:
        profile(args.env, args.modes[0], args.seconds, args.warmup_updates, args.ops, args.gpu_ids)
    for _ in range(args.rounds):
        for mode in args.modes:
            row = profile(args.env, mode, args.seconds, args.warmup_updates, gpu_ids=args.gpu_ids)
            print(f"{mode:16} " + " ".join(f"{row[ph]:9.2f}" for ph in (*PHASES, "total")))
    return 0


if __name__ == "__main__":
    from bench_training import run_script  # it imports this module

    sys.exit(run_script("bench_step.py", main))
