"""The cluster path's overhead on one box: 2 Ray nodes x W workers against 2W without Ray.

Starts Ray's one-machine cluster (a head and one more node, loopback only), then times
``main.py`` in turn: the single-machine launcher with ``--workers 2W``, and ``--ray-address``
with W workers (``--node-workers``, default 1) on each of the 2 nodes, for ``--seconds``
each, ``--rounds`` times alternately, reading raw frames/s from the status lines after
``--warmup`` seconds (as ``bench_training.py``). The same training flags go to both;
``--cluster-flags`` go to the cluster run alone (its opt-in exchange modes). Each run also
reports where the machine's CPU went from the warm-up to 3 s before the stop, by this
script's clock, nearly the frames' window by main.py's (`cpu_by_role`: seconds of CPU
per core-second for the workers, the test process, the launcher or driver, the node
launchers, the parameter server and Ray's own processes), read from ``/proc``. Prints and
writes JSON; nothing is asserted. The issue's target: the cluster at >= 0.9x the single
machine's frames/s.

    python benchmarks/bench_cluster_overhead.py --seconds 90 --rounds 2 --flags=--amsgrad
    python benchmarks/bench_cluster_overhead.py --sync-interval 1 \
        --flags="--envs-per-worker 8 --amsgrad" --cluster-flags=--exchange-statistics
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

from bench_exchange import _cpu_name, start_one_machine_cluster  # noqa: E402
from bench_step import main_py_refusal  # noqa: E402
from bench_training import (  # noqa: E402
    output_file,
    processes,
    run_once,
    stop_signals,
    stopped,
    write_results,
)

CPU_ROLES = (
    ("Train Agent", "workers"),
    ("Test Agent", "test process"),
    ("ray::NodeLauncher", "node launchers"),
    ("ray::ParameterServer", "parameter server"),
    ("raylet", "raylets"),
    ("gcs_server", "Ray GCS"),
    ("main.py", "launcher or driver"),
    ("ray", "Ray's other processes"),
)
"""A process's role by the first of these found in its command line (or title)."""

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process on the machine: pid -> (role, CPU seconds so far, user and system)."""
    out = {}
    for pid, fields, cmd in processes():
        who = next((name for key, name in CPU_ROLES if key in cmd), "other")
        out[pid] = (who, (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def cpu_by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float
) -> dict[str, float]:
    """Cores used by each role between two `cpu_seconds` readings `seconds` apart.

    Processes alive at both readings count (one that started or ended between them does
    not), so the figures are the steady state's.
    """
    used: dict[str, float] = {}
    for pid, (who, end) in after.items():
        if pid in before and before[pid][0] == who:
            used[who] = used.get(who, 0.0) + (end - before[pid][1]) / seconds
    return {who: round(cores, 3) for who, cores in sorted(used.items(), key=lambda kv: -kv[1])}


STATUS_SECONDS = 5.0
"""main.py's --status-interval in the timed runs: frames/s is read from those lines."""


def timed_run(flags: list[str], seconds: float, warmup: float) -> dict:
    """`run_once`, plus the CPU each role used from the warm-up to near the end."""
    readings: list[tuple[float, dict]] = []

    def read_at(delays: tuple[float, float]) -> None:
        start = time.monotonic()
        for delay in delays:
            time.sleep(max(0.0, start + delay - time.monotonic()))
            readings.append((time.monotonic(), cpu_seconds()))

    reader = threading.Thread(target=read_at, args=((warmup, seconds - 3),), daemon=True)
    reader.start()
    result = run_once(flags, seconds, warmup, STATUS_SECONDS)
    reader.join()
    if len(readings) == 2:
        (t0, before), (t1, after) = readings
        result["cpu_by_role"] = cpu_by_role(before, after, t1 - t0)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="PongNoFrameskip-v4")
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--warmup", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync-interval", type=float, default=3.0)
    parser.add_argument(
        "--node-workers", type=int, default=1,
        help="workers on each of the 2 nodes; the single machine gets twice as many",
    )  # fmt: skip
    parser.add_argument("--flags", default="", help="extra main.py flags for both, quoted")
    parser.add_argument(
        "--cluster-flags", default="", help="extra main.py flags for the cluster run, quoted"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    output_file(parser, "--json", args.json)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.seconds <= args.warmup + 2 * STATUS_SECONDS:
        parser.error(
            f"--seconds {args.seconds:g} must exceed --warmup {args.warmup:g} by two status "
            f"intervals ({STATUS_SECONDS:g} s each)"
        )
    try:
        common = ["--env", args.env, *shlex.split(args.flags)]
        single = [*common, "--workers", str(2 * args.node_workers)]
        clustered = [
            *common, "--workers", str(args.node_workers), "--sync-interval",
            str(args.sync_interval), *shlex.split(args.cluster_flags),
        ]  # fmt: skip
    except ValueError as err:  # shlex: an unclosed quote
        parser.error(f"--flags or --cluster-flags: {err}")
    for name, flags in (("single", single), ("cluster", [*clustered, "--ray-address", "auto"])):
        refusal = main_py_refusal(flags)
        if refusal is not None:
            parser.error(f"the {name} run's flags: {refusal}")

    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu_name(),
        "flags": args.flags,
        "cluster_flags": args.cluster_flags,
        "seconds": args.seconds,
        "sync_interval": args.sync_interval,
        "node_workers": args.node_workers,
        "rounds": args.rounds,
        "complete": False,  # until every round ran: a file saved part-way says so
    }
    runs: dict[str, list[float]] = {"single": [], "cluster": []}
    cpu: dict[str, list[dict[str, float]]] = {"single": [], "cluster": []}
    windows: dict[str, list[float]] = {"single": [], "cluster": []}

    def record(kind: str, run: dict) -> None:
        """One run's figures into the result, saved at once: a later failure keeps them."""
        runs[kind].append(run["frames_per_s"])
        cpu[kind].append(run.get("cpu_by_role", {}))
        windows[kind].append(run["window_s"])
        result["frames_per_s"] = {k: [round(v) for v in vs] for k, vs in runs.items()}
        paired = min(len(runs["single"]), len(runs["cluster"]))  # rounds with both runs
        if paired:
            ratio = statistics.fmean(runs["cluster"][:paired]) / statistics.fmean(
                runs["single"][:paired]
            )
            result["cluster_over_single"] = round(ratio, 3)
            result["paired_rounds"] = paired
        result["window_s"] = windows
        result["cpu_by_role"] = cpu
        if args.json:
            write_results(result, args.json)

    with stop_signals():
        cluster = None
        try:
            cluster = start_one_machine_cluster(2)
            for _ in range(args.rounds):
                record("single", timed_run(single, args.seconds, args.warmup))
                address = ["--ray-address", cluster.address]
                record("cluster", timed_run([*clustered, *address], args.seconds, args.warmup))
                print(
                    f"single {runs['single'][-1]:,.0f} frames/s, cluster "
                    f"{runs['cluster'][-1]:,.0f} frames/s; cores used: single "
                    f"{cpu['single'][-1]}, cluster {cpu['cluster'][-1]}",
                    flush=True,
                )
            result["complete"] = True
            if args.json:
                write_results(result, args.json)
        except KeyboardInterrupt:
            return stopped("bench_cluster_overhead.py", args.json)
        except RuntimeError as err:  # main.py failed: its last line is in the message
            print(f"bench_cluster_overhead.py: error: {err}", file=sys.stderr)
            return 1
        finally:
            if cluster is not None:
                cluster.shutdown()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
