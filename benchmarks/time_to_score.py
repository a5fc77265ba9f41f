r"""Time to score: how long until an agent plays well, for each training configuration.

For each configuration (a string of extra ``main.py`` flags), trains ``--env`` (Pong) with
``--workers`` workers for at most ``--minutes`` of wall time, and reports the wall time and
frames at which the mean of the last 10 test games first reached each ``--target`` (Pong: 18;
Breakout: e.g. 50 100 200 300 400), the steady frames/s, and how finely the test process
sampled the run. A configuration stops as soon as it reaches its highest target.

    python benchmarks/time_to_score.py --minutes 30 --config "" --config "--envs-per-worker 16"
    python benchmarks/time_to_score.py --env BreakoutNoFrameskip-v4 --target 50 100 200 \
        --minutes 120 --config "--envs-per-worker 8 --precision bf16"
    python benchmarks/time_to_score.py --ray-nodes 2 --workers 1 --config "--envs-per-worker 8"

``--ray-nodes N`` trains on Ray's one-machine cluster instead: a head and N - 1 more nodes on
this machine (1 CPU each, loopback only), ``--workers`` per node, one test process on the head,
as ``main.py --ray-address`` runs on a real cluster. The frames are every node's together, so
the milestone's frames compare with a single-machine run's of the same mode.

How the figure is kept honest: the test process plays greedy games back to back
(``--test-interval 0``), each with the latest weights, and a game's time is when it ended, so
the milestone is never earlier than the agent could really play. It can be late by up to the
10 games of the window; the report gives the median wall seconds per test game (the
resolution) with each figure. Frames count raw emulator frames (4 per agent step), all
workers together.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_step import main_py_refusal  # noqa: E402
from bench_training import (  # noqa: E402
    frames_at_end,
    output_file,
    output_folder,
    read_in_background,
    steady_frames_per_s,
    stop_group,
    stop_signals,
    stopped_with,
)

from checkpoint import env_file_stem, write_atomic, write_json_atomic  # noqa: E402
from visualize import first_reaching, moving_average, parse_log  # noqa: E402


def summarise(log: Path, targets: list[float], window: int) -> dict:
    """The milestones and the test process's sampling, read from a training log.

    The top-level ``reached``, ``seconds``, ``frames`` and ``test_game`` are the highest
    target's; ``milestones`` holds every target's.
    """
    games = parse_log(log)
    milestones = {}
    for target in sorted(targets):
        hit = first_reaching(games, target, window)
        milestones[f"{target:g}"] = (
            None
            if hit is None
            else {"seconds": hit.seconds, "frames": hit.frames, "test_game": games.index(hit) + 1}
        )
    reached = first_reaching(games, max(targets), window)
    means = moving_average([g.reward for g in games], window)[window - 1 :]
    gaps = [b.seconds - a.seconds for a, b in zip(games, games[1:], strict=False)]
    return {
        "milestones": milestones,
        "reached": reached is not None,
        "seconds": reached.seconds if reached else None,
        "frames": reached.frames if reached else None,
        "test_game": games.index(reached) + 1 if reached else None,
        "test_games": len(games),
        "best_window_mean": float(max(means)) if len(means) else None,
        "last_reward": games[-1].reward if games else None,
        "median_seconds_per_test_game": statistics.median(gaps) if gaps else None,
    }


def main_py_flags(
    extra: list[str], env: str, workers: int, test_niceness: int, seed: int,
    ray_address: str | None = None,
) -> list[str]:  # fmt: skip
    """The main.py flags of one configuration's run (without its output folders)."""
    cluster = [] if ray_address is None else ["--ray-address", ray_address]
    return [
        "--env", env, "--workers", str(workers), "--seed", str(seed), "--test-interval", "0",
        "--test-niceness", str(test_niceness), "--status-interval", "10", *cluster, *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def one_machine_cluster(nodes: int) -> Iterator[str | None]:
    """Ray's one-machine cluster of `nodes` nodes (none for 0), yielding its address.

    Each node has 1 CPU and a small object store and listens on loopback only; the cluster is
    shut down on the way out, whatever happened.
    """
    if nodes == 0:
        yield None
        return
    from bench_exchange import start_one_machine_cluster  # imports Ray's settings for it

    cluster = start_one_machine_cluster(nodes)
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def run_config(
    extra: list[str], env: str, workers: int, minutes: float, targets: list[float], window: int,
    test_niceness: int, seed: int, warmup: float, keep: Path | None,
    ray_address: str | None = None, keep_weights: Path | None = None, label: str = "default",
) -> dict:  # fmt: skip
    """Train one configuration until it reaches its highest target or the time budget ends.

    With `ray_address`, main.py trains on that Ray cluster (`workers` per node). `keep` gets
    a copy of the training log; `keep_weights` of the weights main.py saved (its ``.dat``
    files) and its run record, so that the final agent can be played afterwards
    (``gym_eval.py --model``): the run's own folder is deleted. Both copies are named
    ``<label>_...``.

    The result's ``stopped_itself`` says whether main.py ended before it was stopped (a crash
    or a ``--max-steps`` budget), with its exit code and last stderr line in ``last_line``;
    ``interrupted`` whether Ctrl-C stopped it (what it had done is summarised and kept all
    the same).
    """
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "main.py",
            *main_py_flags(extra, env, workers, test_niceness, seed, ray_address),
            "--save-model-dir", f"{tmp}/", "--log-dir", f"{tmp}/",
        ]  # fmt: skip
        log = Path(tmp) / f"{env_file_stem(env)}_log"
        started = time.monotonic()
        # A process group of its own (the stop below signals it), but this session: Linux's
        # autogroup shares the CPU fairly between sessions, so main.py in a session of its own
        # would hold its test process's share apart from the Ray workers' (started from this
        # session), and --test-niceness would no longer weigh it against them.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            process_group=0, preexec_fn=stopped_with(os.getpid()),
        )  # fmt: skip
        stderr_lines, reader = read_in_background(proc)
        result: dict = {}
        interrupted = False
        try:
            while proc.poll() is None and time.monotonic() - started < minutes * 60:
                with contextlib.suppress(subprocess.TimeoutExpired):  # returns when it ends
                    proc.wait(timeout=10)
                if log.exists():
                    result = summarise(log, targets, window)
                    if result["reached"]:
                        break
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the run so far is summarised and kept
            interrupted = True
        finally:  # also on Ctrl-C: main.py runs in a process group of its own, which ^C missed
            stopped_itself = stop_group(proc)
        reader.join(timeout=10)
        result = summarise(log, targets, window) if log.exists() else {"reached": False}
        stderr = "".join(stderr_lines)
        steady = steady_frames_per_s(stderr, warmup)
        result.update(
            {
                "flags": shlex.join(extra),
                "command": shlex.join(["python", *cmd[1:]]),
                "wall_seconds": round(time.monotonic() - started),
                "frames_per_s": None if steady is None else steady[0],
                "frames_at_end": frames_at_end(stderr),  # how far it trained, reached or not
                "exit_code": proc.returncode,
                "stopped_itself": stopped_itself,
                "interrupted": interrupted,
                "last_line": (stderr.strip().splitlines() or [""])[-1],
            }
        )
        # Copied atomically: a Ctrl-C while copying leaves no cut file under a kept name.
        if keep is not None:
            text = log.read_bytes() if log.exists() else b""
            write_atomic(keep / f"{label}_log", lambda f: f.write(text))
        if keep_weights is not None:
            for saved in [*sorted(Path(tmp).glob("*.dat")), *Path(tmp).glob("*_run.json")]:
                data = saved.read_bytes()
                write_atomic(keep_weights / f"{label}_{saved.name}", lambda f, d=data: f.write(d))
    return result


def kept_before(
    keep_logs: Path | None, keep_weights: Path | None, env: str, labels: list[str]
) -> str | None:
    """Why a run's kept files would overwrite an earlier run's, or None.

    The files are named by configuration (`config_labels`), so a sweep of seeds, envs or
    worker counts over one configuration needs a folder per run.
    """
    stem = env_file_stem(env)
    for label in labels:
        for flag, path in (
            ("--keep-logs", None if keep_logs is None else keep_logs / f"{label}_log"),
            (
                "--keep-weights",
                None if keep_weights is None else keep_weights / f"{label}_{stem}_run.json",
            ),
        ):
            if path is not None and path.exists():
                return (
                    f"{flag} {str(path.parent)!r} holds an earlier run's {path.name}; give "
                    "each run (a seed, say) a folder of its own"
                )
    return None


def config_labels(configs: list[str]) -> list[str]:
    """A file-name label per configuration, its flags' letters and digits, each one different.

    Flags that differ only in punctuation (``--lr=1e-4``, ``--lr 1e-4``) and a configuration
    given twice get ``_2``, ``_3``... so that no run's kept log or weights overwrite another's.
    """
    labels: list[str] = []
    for config in configs:
        base = re.sub(r"[^A-Za-z0-9]+", "_", config).strip("_") or "default"
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}_{n}"
        labels.append(label)
    return labels


def describe(row: dict, targets: list[float], window: int) -> str:
    """One line per configuration (the highest target's figure, and the lower ones reached)."""
    score = max(targets)
    fps = f"{row['frames_per_s']:,.0f} frames/s" if row.get("frames_per_s") else "frames/s ?"
    resolution = row.get("median_seconds_per_test_game")
    sampling = f"{row.get('test_games', 0)} test games" + (
        f", one per {resolution:.0f} s" if resolution else ""
    )
    lower = [
        f"{target} after {hit['seconds'] / 60:.1f} min, {hit['frames']:,} frames"
        for target, hit in (row.get("milestones") or {}).items()
        if hit is not None and float(target) < score
    ]
    if row.get("reached"):
        what = (
            f"mean of {window} reached {score:g} after {row['seconds'] / 60:.1f} min, "
            f"{row['frames']:,} frames"
        )
    else:
        best = row.get("best_window_mean")
        ended = "stopped after" if row.get("interrupted") else "did not reach"
        if not row.get("interrupted"):
            ended += f" {score:g} in"
        trained = row.get("frames_at_end")
        what = (
            f"{ended} {row['wall_seconds'] / 60:.1f} min"
            + (f", {trained:,} frames" if trained is not None else "")
            + (f" (best {window}-game mean {best:.2f})" if best is not None else "")
        )
        if row.get("stopped_itself"):
            what += (
                f": main.py stopped by itself with exit code {row['exit_code']} "
                f"({row['last_line']})"
            )
    if lower:
        what += f" (reached {'; '.join(lower)})"
    return f"[{row['flags'] or 'defaults'}] {what}; {fps}; {sampling}"


def main(argv: list[str] | None = None) -> int:
    """Run each configuration in turn; print one line each and save the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", action="append", default=None,
        help="extra main.py flags, quoted; repeat for several (default: one run, no flags)",
    )  # fmt: skip
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--minutes", type=float, default=30, help="wall-time budget per config")
    p.add_argument(
        "--target", "--score", dest="targets", type=float, nargs="+", default=[18.0],
        help="10-game mean(s) to time; the run stops at the highest (Pong: 18)",
    )  # fmt: skip
    p.add_argument("--window", type=int, default=10, help="test games in the mean")
    p.add_argument("--test-niceness", type=int, default=10, help="as main.py's (its default)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ray-nodes", type=int, default=0,
        help="train on Ray's one-machine cluster of this many nodes (--workers per node; "
        "needs requirements-ray.txt); 0: no Ray (default)",
    )  # fmt: skip
    p.add_argument("--warmup", type=float, default=60, help="seconds left out of frames/s")
    p.add_argument("--keep-logs", type=Path, help="copy each run's training log here")
    p.add_argument(
        "--keep-weights", type=Path,
        help="copy each run's saved weights (.dat) and run record here, to play them later",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    output_file(p, "--json", args.json)
    output_folder(p, "--keep-logs", args.keep_logs)
    output_folder(p, "--keep-weights", args.keep_weights)
    if args.window < 1:
        p.error(f"--window must be at least 1, got {args.window}")
    if args.minutes <= 0:
        p.error(f"--minutes must be positive, got {args.minutes}")
    if args.ray_nodes < 0:
        p.error(f"--ray-nodes must be 0 (no Ray) or a number of nodes, got {args.ray_nodes}")
    if args.ray_nodes:
        try:
            import ray  # noqa: F401
        except ImportError:
            p.error(
                "--ray-nodes needs Ray, which is not installed: pip install -r requirements-ray.txt"
            )
    ray_flag = "auto" if args.ray_nodes else None  # the address is known once the cluster is up
    configs = args.config or [""]
    for config in configs:
        try:
            flags = shlex.split(config)
        except ValueError as err:
            print(f"time_to_score.py: error: --config {config!r}: {err}", file=sys.stderr)
            return 2
        refusal = main_py_refusal(
            main_py_flags(flags, args.env, args.workers, args.test_niceness, args.seed, ray_flag)
        )
        if refusal is not None:
            print(f"time_to_score.py: error: --config {config!r}: {refusal}", file=sys.stderr)
            return 2
    labels = config_labels(configs)
    taken = kept_before(args.keep_logs, args.keep_weights, args.env, labels)
    if taken is not None:
        print(f"time_to_score.py: error: {taken}", file=sys.stderr)
        return 2
    results = []
    failed = False
    with stop_signals(), one_machine_cluster(args.ray_nodes) as address:
        for config, label in zip(configs, labels, strict=True):
            row = run_config(
                shlex.split(config), args.env, args.workers, args.minutes, args.targets,
                args.window, args.test_niceness, args.seed, args.warmup, args.keep_logs, address,
                args.keep_weights, label,
            )  # fmt: skip
            row["ray_nodes"] = args.ray_nodes
            results.append(row)
            print(describe(row, args.targets, args.window), flush=True)
            if args.json:
                write_json_atomic(results, args.json)
            failed |= bool(row["stopped_itself"] and row["exit_code"])
            if row["interrupted"]:
                print("time_to_score.py: stopped; the run so far is kept", file=sys.stderr)
                return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
