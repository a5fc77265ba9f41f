"""The cluster path's overhead on one box: 2 Ray nodes x W workers against 2W without Ray.

Starts Ray's one-machine cluster (a head and one more node, loopback only), then times
``main.py`` in turn: the single-machine launcher with ``--workers 2W``, and ``--ray-address``
with W workers (``--node-workers``, default 1) on each of the 2 nodes, for ``--seconds``
each, ``--rounds`` times alternately, reading raw frames/s from the status lines after
``--warmup`` seconds (as ``bench_training.py``). The same training flags go to both;
``--cluster-flags`` go to the cluster run alone (its opt-in exchange modes). Prints and
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

from bench_exchange import _cpu_name, start_one_machine_cluster  # noqa: E402
from bench_training import run_once  # noqa: E402


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

    cluster = start_one_machine_cluster(2)
    common = ["--env", args.env, *shlex.split(args.flags), "--status-interval", "5"]
    runs: dict[str, list[float]] = {"single": [], "cluster": []}
    try:
        for _ in range(args.rounds):
            single = run_once(
                [*common, "--workers", str(2 * args.node_workers)], args.seconds, args.warmup, 5
            )
            runs["single"].append(single["frames_per_s"])
            clustered = run_once(
                [*common, "--workers", str(args.node_workers), "--ray-address", cluster.address,
                 "--sync-interval", str(args.sync_interval), *shlex.split(args.cluster_flags)],
                args.seconds, args.warmup, 5,
            )  # fmt: skip
            runs["cluster"].append(clustered["frames_per_s"])
            print(
                f"single {single['frames_per_s']:,.0f} frames/s, cluster "
                f"{clustered['frames_per_s']:,.0f} frames/s",
                flush=True,
            )
    finally:
        cluster.shutdown()
    ratio = statistics.fmean(runs["cluster"]) / statistics.fmean(runs["single"])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu_name(),
        "flags": args.flags,
        "cluster_flags": args.cluster_flags,
        "seconds": args.seconds,
        "sync_interval": args.sync_interval,
        "node_workers": args.node_workers,
        "frames_per_s": {k: [round(v) for v in vs] for k, vs in runs.items()},
        "cluster_over_single": round(ratio, 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
