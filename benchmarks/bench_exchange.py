"""The cluster's exchange cost: one push-and-pull with the parameter server, between Ray nodes.

Starts Ray's one-machine cluster (a head and one more node, loopback only), puts the real
`cluster.ParameterServer` on the head with the A3C-LSTM's weights, and times from the other
node: a node's exchange exactly as `cluster.NodeLauncher` makes it (flat weights, the change,
``exchange``, applying ``pulled - current``), and the server alone at capacity (several
pushers at once, no model work). Prints and writes JSON; nothing is asserted.

    python benchmarks/bench_exchange.py --exchanges 50 --pushers 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

import gymnasium as gym  # noqa: E402

from cluster import ParameterServer, WeightSync, flat_weights  # noqa: E402
from model import A3Clstm  # noqa: E402


def time_node_exchanges(server, hidden: int, exchanges: int) -> dict[str, float]:
    """On the calling node: the mean ms of a full exchange and of the server call alone."""
    import ray

    model = A3Clstm(1, gym.spaces.Discrete(6), hidden)
    model.share_memory()
    sync = WeightSync(model, flat_weights(model))
    calls: list[float] = []

    def send(change: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        weights, _ = ray.get(server.exchange.remote("bench", change, 0, 0))
        calls.append(time.perf_counter() - started)
        return weights

    sync.exchange(send)  # warm-up
    calls.clear()
    started = time.perf_counter()
    for _ in range(exchanges):
        sync.exchange(send)
    total = time.perf_counter() - started
    return {
        "exchange_ms": 1e3 * total / exchanges,
        "server_call_ms": 1e3 * float(np.mean(calls)),
        "weights": int(sync.snapshot.size),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--exchanges", type=int, default=50)
    parser.add_argument("--pushers", type=int, default=4, help="concurrent pushers at capacity")
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 200 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    other = cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        head = ray.get_runtime_context().get_node_id()
        weights = flat_weights(A3Clstm(1, gym.spaces.Discrete(6), args.hidden_size))
        on_head = NodeAffinitySchedulingStrategy(node_id=head, soft=False)
        on_other = NodeAffinitySchedulingStrategy(node_id=other.node_id, soft=False)
        server = (
            ray.remote(ParameterServer).options(num_cpus=0, scheduling_strategy=on_head)
        ).remote(weights)
        timer = ray.remote(time_node_exchanges).options(num_cpus=0, scheduling_strategy=on_other)
        node_figures = ray.get(timer.remote(server, args.hidden_size, args.exchanges))

        change = np.zeros_like(weights)
        pushers = [
            ray.remote(_push_many).options(num_cpus=0, scheduling_strategy=on_other)
            for _ in range(args.pushers)
        ]
        ray.get(server.exchange.remote("warm", change, 0, 0))
        started = time.perf_counter()
        counts = ray.get(
            [push.remote(server, change, args.exchanges, f"p{i}") for i, push in enumerate(pushers)]
        )
        elapsed = time.perf_counter() - started
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "cpu": _cpu_name(),
            "ray": ray.__version__,
            "hidden_size": args.hidden_size,
            "weights": node_figures["weights"],
            "bytes_per_exchange": 2 * weights.nbytes,
            "exchange_ms": round(node_figures["exchange_ms"], 2),
            "server_call_ms": round(node_figures["server_call_ms"], 2),
            "server_exchanges_per_s_at_capacity": round(sum(counts) / elapsed, 1),
            "pushers": args.pushers,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _push_many(server, change: np.ndarray, count: int, name: str) -> int:
    import ray

    for _ in range(count):
        ray.get(server.exchange.remote(name, change, 0, 0))
    return count


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
