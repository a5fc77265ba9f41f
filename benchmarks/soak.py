"""Soak test: a long main.py run, watched for memory, file-descriptor and process growth.

Starts ``main.py`` (Pong, 2 workers by default) for ``--minutes``, samples every
``--every`` seconds the resident memory of each process, its open file descriptors and the
number of processes in the run's process group, then stops the run with SIGINT. Prints a table
over time and a verdict per series: the growth from the first sample after ``--warmup`` seconds
to the last. Pass ``--json`` to keep the samples.

    python benchmarks/soak.py --minutes 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import at_least, positive  # noqa: E402
from bench_training import (  # noqa: E402
    group_processes,
    output_file,
    read_in_background,
    role,
    rss_mib,
    stop_group,
    stop_signals,
    stopped_with,
)

from checkpoint import write_json_atomic  # noqa: E402


def open_fds(pid: int) -> int:
    """Open file descriptors of `pid` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def sample(pgid: int, start: float) -> dict:
    """One snapshot of the run: per role, summed RSS and fds, and the process count."""
    processes = group_processes(pgid)
    by_role: dict[str, dict[str, float]] = {}
    for pid, cmd in processes.items():
        entry = by_role.setdefault(role(cmd), {"count": 0, "rss_mib": 0.0, "fds": 0})
        entry["count"] += 1
        entry["rss_mib"] = max(entry["rss_mib"], rss_mib(pid))  # the largest of the role
        entry["fds"] = max(entry["fds"], open_fds(pid))
    return {"t": round(time.monotonic() - start, 1), "processes": len(processes), **by_role}


def main(argv: list[str] | None = None) -> int:
    """Run, sample, stop, report."""
    p = argparse.ArgumentParser(description="Soak main.py and watch its resources.")
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--minutes", type=float, default=20)
    p.add_argument("--every", type=float, default=30, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=120, help="seconds before the baseline")
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)
    output_file(p, "--json", args.json)
    positive(p, minutes=args.minutes, every=args.every)
    at_least(p, 0, warmup=args.warmup)
    at_least(p, 1, workers=args.workers)

    samples = []
    with tempfile.TemporaryDirectory() as tmp, stop_signals():
        cmd = [
            sys.executable, "main.py", "--env", args.env, "--workers", str(args.workers),
            "--save-model-dir", tmp, "--log-dir", tmp, "--tensorboard-logger",
            "--state-interval", "60", "--test-interval", "30",
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True, preexec_fn=stopped_with(os.getpid()),
        )  # fmt: skip
        lines, reader = read_in_background(proc)
        start = time.monotonic()
        end = start + 60 * args.minutes
        interrupted = False
        try:
            while time.monotonic() < end and proc.poll() is None:
                samples.append(sample(proc.pid, start))
                print(json.dumps(samples[-1]), flush=True)
                time.sleep(args.every)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            ended_by_itself = stop_group(proc)
            reader.join(timeout=10)
    if ended_by_itself or proc.returncode != 0:
        print(f"soak.py: main.py exited with {proc.returncode}:\n{''.join(lines)[-2000:]}")
        return 1
    if interrupted or not samples:
        print("soak.py: stopped; nothing written", file=sys.stderr)
        return 130

    steady = [s for s in samples if s["t"] >= args.warmup] or samples
    first, last = steady[0], steady[-1]
    print(f"\n{args.env}, {args.workers} workers, {args.minutes:g} min; from t={first['t']}s:")
    print(f"processes: {first['processes']} -> {last['processes']}")
    for who in ("launcher", "test", "worker", "helper"):
        if who in first and who in last:
            print(
                f"{who:8} RSS {first[who]['rss_mib']:.0f} -> {last[who]['rss_mib']:.0f} MiB "
                f"(peak {max(s.get(who, {}).get('rss_mib', 0) for s in steady):.0f}), "
                f"fds {first[who]['fds']} -> {last[who]['fds']}"
            )
    if args.json:
        write_json_atomic({"args": vars(args), "samples": samples}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
