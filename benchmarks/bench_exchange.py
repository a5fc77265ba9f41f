"""The cluster's exchange cost: one push-and-pull with the parameter server, between Ray nodes.

Starts Ray's one-machine cluster (a head and one more node, loopback only), puts the real
`cluster.ParameterServer` on the head with the A3C-LSTM's weights, and times from the other
node, for each ``--precisions`` in turn (fp32, fp16: one run, so compare their ratio):

- a node's exchange exactly as `cluster.NodeLauncher` makes it (`cluster.WeightSync`: flat
  weights, the change, ``exchange``, applying what came back), end to end and the server call;
- the server at capacity: several pushers at once, no model work, exchanges a second;
- the server's own CPU time per exchange (its process: the method, Ray's (de)serialisation and
  its threads): on a machine where the pushers do not share the server's cores, one server
  core serves about 1000 / that many exchanges a second;
- the two raylets' CPU time per exchange (their object managers move the bytes between the
  nodes; on a real cluster the head's raylet does its half of this).

With ``--statistics`` each exchange also exchanges Adam's two moments, as a run with
``--exchange-statistics`` does (`cluster.StatisticsSync`: the weights' call, then the
statistics' call).

Prints and writes JSON; nothing is asserted.

    python benchmarks/bench_exchange.py --exchanges 50 --pushers 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

import gymnasium as gym  # noqa: E402
from bench_step import at_least  # noqa: E402
from bench_training import output_file, run_script  # noqa: E402

from checkpoint import write_json_atomic  # noqa: E402
from cluster import ParameterServer, StatisticsSync, WeightSync, flat_weights  # noqa: E402
from model import A3Clstm  # noqa: E402
from shared_optim import SharedAdam  # noqa: E402

DTYPES = {"fp32": np.float32, "fp16": np.float16}


class MeasuredServer(ParameterServer):
    """The real server, plus a reading of its process's CPU time."""

    def cpu_seconds(self) -> float:
        """CPU seconds this actor's process has used, all its threads."""
        return time.process_time()


def time_node_exchanges(
    server, hidden: int, exchanges: int, precision: str, statistics: bool
) -> dict[str, float]:
    """On the calling node: the mean ms of a full exchange and of the server calls alone."""
    import ray

    model = A3Clstm(1, gym.spaces.Discrete(6), hidden)
    model.share_memory()
    sync = WeightSync(model, flat_weights(model), precision)
    moments = None
    if statistics:
        optimizer = SharedAdam(model.parameters(), amsgrad=True, slots=2)
        optimizer.share_memory()
        moments = StatisticsSync(optimizer, 1, None, 0, 0)
    calls: list[float] = []
    name = f"node-{precision}-{statistics}"

    def send(change: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        answer, _ = ray.get(server.exchange.remote(name, change, 0, 0))
        calls.append(time.perf_counter() - started)
        return answer

    def send_statistics(*pushed: Any) -> tuple[np.ndarray, int]:
        started = time.perf_counter()
        answer = ray.get(server.exchange_statistics.remote(name, *pushed))
        calls[-1] += time.perf_counter() - started
        return answer

    def exchange() -> None:
        sync.exchange(send)
        if moments is not None:
            moments.exchange(send_statistics)

    exchange()  # warm-up (and, for fp16, the first answer: the weights themselves)
    calls.clear()
    started = time.perf_counter()
    for _ in range(exchanges):
        exchange()
    total = time.perf_counter() - started
    return {
        "exchange_ms": 1e3 * total / exchanges,
        "server_call_ms": 1e3 * float(np.mean(calls)),
        "weights": int(sync.snapshot.size),
        "statistics": int(moments.snapshot.size) if moments is not None else 0,
    }


def measure(
    ray, server, timer, push, pushers: int, hidden: int, exchanges: int, precision: str,
    statistics: bool,
) -> dict:  # fmt: skip
    """One precision's figures: node exchange, server at capacity, server CPU per exchange."""
    node = ray.get(timer.remote(server, hidden, exchanges, precision, statistics))
    change = np.zeros(node["weights"], dtype=DTYPES[precision])
    moments = np.zeros(node["statistics"], dtype=np.float32)
    names = [f"p{i}-{precision}" for i in range(pushers)]
    ray.get([server.exchange.remote(name, change, 0, 0) for name in names])  # first answers
    # In the object store once, and one untimed round: the pushers' processes start and their
    # arguments travel before the clock starts, not inside the window.
    change_ref, moments_ref = ray.put(change), ray.put(moments)
    ray.get([push.remote(server, change_ref, moments_ref, 1, name) for name in names])
    cpu_before = ray.get(server.cpu_seconds.remote())
    raylets_before = _raylets_cpu_seconds()
    started = time.perf_counter()
    counts = ray.get(
        [push.remote(server, change_ref, moments_ref, exchanges, name) for name in names]
    )
    elapsed = time.perf_counter() - started
    cpu = ray.get(server.cpu_seconds.remote()) - cpu_before
    raylets = _raylets_cpu_seconds() - raylets_before
    done = sum(counts)
    bytes_one_way = change.nbytes + moments.nbytes
    return {
        "bytes_per_exchange": 2 * bytes_one_way,
        "exchange_ms": round(node["exchange_ms"], 2),
        "server_call_ms": round(node["server_call_ms"], 2),
        "server_exchanges_per_s_at_capacity": round(done / elapsed, 1),
        "server_cpu_ms_per_exchange": round(1e3 * cpu / done, 2),
        "server_exchanges_per_s_per_core": round(done / cpu, 1),
        "raylets_cpu_ms_per_exchange": round(1e3 * raylets / done, 2),
    }


def label(precision: str, statistics: bool) -> str:
    """A figure's name: the weights' precision, and whether the statistics went too."""
    return precision + ("+statistics" if statistics else "")


def start_one_machine_cluster(nodes: int) -> Any:
    """Ray's one-machine cluster, running: a head and `nodes` - 1 more nodes.

    Each node has 1 CPU and a small object store, no dashboard, and listens on loopback only
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set on import). The caller shuts it down.
    """
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 200 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--exchanges", type=int, default=50)
    parser.add_argument("--pushers", type=int, default=4, help="concurrent pushers at capacity")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16"], choices=DTYPES)
    parser.add_argument(
        "--statistics", action="store_true",
        help="exchange Adam's moments too, as --exchange-statistics does",
    )  # fmt: skip
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args(argv)
    output_file(parser, "--json", args.json)
    at_least(
        parser, 1, hidden_size=args.hidden_size, exchanges=args.exchanges, pushers=args.pushers
    )

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cluster = start_one_machine_cluster(2)
    (other,) = cluster.worker_nodes
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        head = ray.get_runtime_context().get_node_id()
        weights = flat_weights(A3Clstm(1, gym.spaces.Discrete(6), args.hidden_size))
        on_head = NodeAffinitySchedulingStrategy(node_id=head, soft=False)
        on_other = NodeAffinitySchedulingStrategy(node_id=other.node_id, soft=False)
        server = (
            ray.remote(MeasuredServer).options(num_cpus=0, scheduling_strategy=on_head)
        ).remote(weights)
        timer = ray.remote(time_node_exchanges).options(num_cpus=0, scheduling_strategy=on_other)
        push = ray.remote(_push_many).options(num_cpus=0, scheduling_strategy=on_other)
        common = (ray, server, timer, push, args.pushers, args.hidden_size, args.exchanges)
        figures = {
            label(precision, args.statistics): measure(*common, precision, args.statistics)
            for precision in args.precisions
        }
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "cpu": _cpu_name(),
            "ray": ray.__version__,
            "hidden_size": args.hidden_size,
            "weights": int(weights.size),
            "pushers": args.pushers,
            "exchanges": args.exchanges,
            "precisions": figures,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result, indent=2))
    if args.json:
        write_json_atomic(result, args.json)
    return 0


def _push_many(server, change: np.ndarray, moments: np.ndarray, count: int, name: str) -> int:
    import ray

    decays, sizes = np.ones(1), np.array([moments.size])
    for _ in range(count):
        ray.get(server.exchange.remote(name, change, 0, 0))
        if moments.size:
            ray.get(server.exchange_statistics.remote(name, moments, decays, sizes, 0))
    return count


def _raylets_cpu_seconds() -> float:
    """CPU seconds (user + system) of every raylet process on this machine."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().split(") ", 1)
        except OSError:
            continue
        if name.endswith("(raylet"):
            fields = rest.split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(run_script("bench_exchange.py", main))
