"""Training on a Ray cluster: Hogwild inside each machine, a parameter server between them.

Each machine runs a `NodeLauncher`: the single-machine Hogwild pool, without a test process.
A `ParameterServer` on the head adds every node's pushed weight change and answers with the
global weights. The driver runs the test process and writes the log, checkpoints and run
record as on one machine. Ray is imported only here, only with ``--ray-address``; see
docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import signal
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from cli import TrainConfig
from environment import EnvSpec
from utils import UsageError, count_of
from validate import check_gpus, check_precision, host_port

if TYPE_CHECKING:
    from launcher import Launcher

ROOT = Path(__file__).resolve().parent

RAY_EXCLUDES = [
    ".git", ".ci", "trained_models", "logs", "runs", "demo", "docs", "tests", "benchmarks",
    "__pycache__", ".venv", "venv", "*.dat", "*.pt", "*.gif", "*.mp4", "*.png",
]  # fmt: skip
"""What the other machines do not need from this checkout (Ray's ``working_dir`` upload)."""

STOP_SECONDS = 60.0  # how long the driver waits for the nodes' final exchange at the stop
# How long the driver waits for one answer of the parameter server, and a node for its join;
# past it the server is taken as lost, so Ctrl-C and the final save never wait for good.
SERVER_SECONDS = 60.0
ADOPT_SECONDS = 10.0  # how often the driver looks for alive nodes without a launcher
MAX_STARTS = 3  # launchers started on one node at most: one that keeps dying is left alone
# How long after a loss a launcher is restarted on the same node: Ray lists a machine that
# died as alive until its health check gives up on it (about 15 s by default).
RESTART_SECONDS = 20.0
BUSY_LOAD = 1.0  # the exchange load (`exchange_load`) at which the driver warns: they overlap
BUSY_WINDOW_SECONDS = 60.0  # the driver judges the exchange load over windows this long
BUSY_WARNING_SECONDS = 300.0  # the least time between two warnings of a high exchange load
FP16_MAX = float(np.finfo(np.float16).max)


# The exchange arithmetic (no Ray)


def flat_weights(model: nn.Module) -> np.ndarray:
    """The model's parameters as one float32 vector (`parameters()` order), a copy."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def weights_digest(weights: np.ndarray) -> str:
    """A short fingerprint of a flat float32 vector, to tell two copies of it equal or not."""
    data = np.ascontiguousarray(weights, dtype=np.float32).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def add_flat(model: nn.Module, change: np.ndarray) -> None:
    """Add a flat vector (`flat_weights`' layout) in place: updates made meanwhile are kept."""
    _write_flat(list(model.parameters()), change, torch.Tensor.add_)


def set_flat(model: nn.Module, weights: np.ndarray) -> None:
    """Copy a flat vector (`flat_weights`' layout) into the parameters, in place."""
    _write_flat(list(model.parameters()), weights, torch.Tensor.copy_)


def _write_flat(tensors: list[torch.Tensor], flat: np.ndarray, write: Callable) -> None:
    """Write `flat`'s consecutive runs into `tensors` with `write` (``add_`` or ``copy_``)."""
    expected = sum(tensor.numel() for tensor in tensors)
    if flat.shape != (expected,):
        raise ValueError(f"expected {expected} values, got {flat.size}")
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            size = tensor.numel()
            write(tensor, _tensor(flat[offset : offset + size]).view_as(tensor))
            offset += size


# The fp16 arithmetic runs on torch views of the numpy arrays: torch's fp16 ops are faster.


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A tensor on `values`' memory. Ray hands out read-only arrays: only read those."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(values)


def to_fp16(values: np.ndarray) -> np.ndarray:
    """`values` rounded to fp16, clipped to its range (an inf would poison the server's sum)."""
    return _tensor(values).clamp(-FP16_MAX, FP16_MAX).to(torch.float16).numpy()


def add_into(total: np.ndarray, values: np.ndarray) -> None:
    """``total += values`` in place, `values` float32 or fp16 (the same float32 sum either way)."""
    _tensor(total).add_(_tensor(values))


class ErrorFeedback:
    """fp16 sends of a float32 stream that lose nothing over time (error feedback).

    What a send's rounding drops is owed and added to the next send, so everything sent adds
    up to everything meant; alone, changes under fp16's smallest step would never arrive.
    """

    def __init__(self, size: int):
        self.owed = np.zeros(size, dtype=np.float32)

    def send(self, values: np.ndarray) -> np.ndarray:
        """`values` plus what earlier sends owe, in fp16; what the rounding dropped is owed."""
        meant = values + self.owed
        sent = to_fp16(meant)
        _tensor(meant).sub_(_tensor(sent))
        self.owed = meant
        return sent

    def flush(self, values: np.ndarray) -> np.ndarray:
        """`values` plus everything owed, in float32 (an exact last send)."""
        meant = values + self.owed
        self.owed = np.zeros_like(self.owed)
        return meant


class WeightSync:
    """One node's side of the exchange with the parameter server.

    An exchange pushes ``shared - snapshot`` (the workers' updates since the last), receives
    the global weights ``pulled`` and applies ``shared += pulled - current``: updates made
    during the round trip stay and go out with the next push. In fp16 both ways carry changes
    through error feedback; the server keeps a copy of each node's snapshot, equal to the bit.
    """

    def __init__(self, model: nn.Module, snapshot: np.ndarray, precision: str = "fp32"):
        """Start from the global weights `snapshot`, already in `model`."""
        self.model = model
        self.snapshot = snapshot
        self.feedback = ErrorFeedback(snapshot.size) if precision == "fp16" else None

    def exchange(self, send: Callable[[np.ndarray], np.ndarray], last: bool = False) -> np.ndarray:
        """One push and pull: `send` takes the change and returns what the server answers.

        A `last` exchange goes in float32 and sets the server's weights, since ``current +
        (pulled - current)`` can miss `pulled` by a rounding step. Returns the new snapshot.
        """
        current = flat_weights(self.model)
        change = current - self.snapshot
        if self.feedback is not None:
            change = self.feedback.flush(change) if last else self.feedback.send(change)
        answer = send(change)
        if answer.dtype == np.float16:
            pulled = self.snapshot.copy()
            add_into(pulled, answer)  # the sum the server makes in its copy of the snapshot
        else:
            pulled = answer
        if last:
            set_flat(self.model, pulled)
        else:
            add_flat(self.model, pulled - current)
        self.snapshot = pulled
        return pulled


class StatisticsSync:
    """One node's side of the exchange of its optimizer's statistics (``--exchange-statistics``).

    A node whose workers took `k` steps since its `snapshot` holds ``current = decay**k *
    snapshot + new``. It pushes `new` and ``decay**k``; the server applies ``avg = decay**k *
    avg + new``, as one optimizer stepped by every node would. (Adding ``current - snapshot``,
    as for the weights, would decay the averages once per node.) The node then takes the
    cluster's averages, keeping the `k2` steps made during the round trip: ``avg = now +
    decay**k2 * (pulled - current)``. The other nodes' steps go in an extra step-count slot.
    """

    def __init__(
        self, optimizer: Any, workers: int, averages: np.ndarray | None, steps: int, before: int
    ):
        """Start from the cluster's `averages` (None: this node's zeros) and step counts.

        `before` is this node's own steps before this launcher (a restart), pushed on top.
        """
        self.optimizer = optimizer
        self.workers = workers
        self.before = before
        self.averages = optimizer.moving_averages()
        self.tensors = [tensor for tensor, _, _ in self.averages]
        self.sizes = np.array([tensor.numel() for tensor in self.tensors], dtype=np.int64)
        self.decays = np.array([decay for _, decay, _ in self.averages], dtype=np.float64)
        if averages is not None:
            self._write(averages, torch.Tensor.copy_)
        self.snapshot = self.read()
        self.read_at = self.own_steps()
        optimizer.step_counts[workers] = steps

    def own_steps(self) -> int:
        """Optimizer steps this launcher's workers took."""
        return int(self.optimizer.step_counts[: self.workers].sum())

    def read(self) -> np.ndarray:
        """The averages as one float32 vector (a copy)."""
        return torch.cat([tensor.reshape(-1) for tensor in self.tensors]).numpy()

    def _write(self, flat: np.ndarray, write: Callable) -> None:
        _write_flat(self.tensors, flat, write)
        with torch.no_grad():
            for tensor, _, second in self.averages:
                if second:
                    tensor.clamp_(min=0)  # a Hogwild race or a rounding: never below 0

    def exchange(self, send: Callable[..., tuple[np.ndarray, int]]) -> np.ndarray:
        """One push and pull: `send(new, decays, sizes, steps)` returns the averages and steps."""
        steps = self.own_steps()
        current = self.read()
        decays = self.decays ** (steps - self.read_at)
        decayed = self.snapshot.copy()
        decay_runs(decayed, decays, self.sizes)
        pulled, total = send(current - decayed, decays, self.sizes, steps + self.before)
        change = pulled - current
        decay_runs(change, self.decays ** (self.own_steps() - steps), self.sizes)  # k2 steps
        self._write(change, torch.Tensor.add_)
        self.snapshot = pulled
        self.read_at = steps
        self.optimizer.step_counts[self.workers] = total - steps
        return pulled


def decay_runs(values: np.ndarray, decays: np.ndarray, sizes: np.ndarray) -> None:
    """``values *= decays`` in place, one decay per run of `sizes` values (one per tensor)."""
    start = 0
    for size, decay in zip(sizes.tolist(), decays.tolist(), strict=True):
        values[start : start + size] *= np.float32(decay)
        start += size


class ParameterServer:
    """The global weights, the sum of every node's pushes (run as a Ray actor on the head).

    `views` holds, for each node exchanging in fp16, the weights it holds as the server's (its
    `WeightSync.snapshot`, to the bit). `recent_round_trips` counts since the driver's last
    `pull`, each launcher's first timed exchange (`timed`) left out: its workers were starting.
    """

    def __init__(self, weights: np.ndarray, base_steps: int = 0, base_skipped: int = 0):
        self.weights = np.array(weights, dtype=np.float32, copy=True)
        self.base_steps = base_steps
        self.base_skipped = base_skipped
        self.counts: dict[str, tuple[int, int]] = {}  # node -> its steps and skipped steps
        self.pushes: dict[str, int] = {}
        self.bytes_exchanged = 0
        self.round_trips = (0, 0.0)  # the whole run's: count, total milliseconds
        self.recent_round_trips: list[float] = []
        self.timed: set[tuple[str, int]] = set()
        self.reports: list[dict[str, Any]] = []
        self.views: dict[str, np.ndarray] = {}
        self.generations: dict[str, int] = {}  # node -> how many launchers joined from it
        self.final_answers: dict[str, str] = {}  # node -> digest of its last exchange's answer
        self.statistics: np.ndarray | None = None
        self.node_optimizer_steps: dict[str, int] = {}

    def exchange(
        self,
        node: str,
        change: np.ndarray,
        steps: int,
        skipped: int,
        last_round_trip_ms: float | None = None,
        reports: list[dict[str, Any]] | None = None,
        generation: int = 0,
        last: bool = False,
    ) -> tuple[np.ndarray, int]:
        """Add a node's change; return the global weights and the run's total steps.

        An fp16 change is answered with the weights' fp16 change since the node's view, its
        rounding left for the next answer; a first fp16 exchange, and any float32 one, with the
        weights. A replaced launcher (an older `generation`) still has its change added but
        touches neither the node's counts nor its view. A `last` answer's digest is kept for
        the run record.
        """
        add_into(self.weights, change)
        self.reports.extend(reports or ())  # its workers trained, also a replaced launcher's
        if generation != self.generations.get(node, 0):
            self.bytes_exchanged += change.nbytes + self.weights.nbytes
            return self.weights, self.total_steps()
        answer = self.weights
        view = self.views.get(node)
        if change.dtype != np.float16:
            self.views.pop(node, None)
        elif view is None:
            self.views[node] = self.weights.copy()
        else:
            answer = to_fp16(self.weights - view)
            add_into(view, answer)  # the node adds the same to its snapshot
        self.pushes[node] = self.pushes.get(node, 0) + 1
        self.counts[node] = (steps, skipped)
        self.bytes_exchanged += change.nbytes + answer.nbytes
        if last_round_trip_ms is not None:
            count, total = self.round_trips
            self.round_trips = (count + 1, total + last_round_trip_ms)
            if (node, generation) in self.timed:
                self.recent_round_trips.append(last_round_trip_ms)
            self.timed.add((node, generation))
        if last:
            self.final_answers[node] = weights_digest(answer)
        return answer, self.total_steps()

    def exchange_statistics(
        self,
        node: str,
        new: np.ndarray,
        decays: np.ndarray,
        sizes: np.ndarray,
        steps: int,
        generation: int = 0,
    ) -> tuple[np.ndarray, int]:
        """Merge a node's statistics (`StatisticsSync`); return them and every node's steps."""
        if self.statistics is None:
            self.statistics = np.zeros_like(new, dtype=np.float32)
        decay_runs(self.statistics, decays, sizes)  # avg = decays * avg + new
        add_into(self.statistics, new)
        if generation == self.generations.get(node, 0):
            self.node_optimizer_steps[node] = steps
        self.bytes_exchanged += new.nbytes + self.statistics.nbytes
        return self.statistics, sum(self.node_optimizer_steps.values())

    def join(self, node: str) -> dict[str, Any]:
        """A node launcher starting: the weights, the run's steps, the node's own counts so far.

        A restarted launcher goes on from its node's counts and starts its fp16 exchanges
        afresh; its `generation` tells an older launcher's late exchanges apart.
        """
        self.views.pop(node, None)
        self.generations[node] = self.generations.get(node, -1) + 1
        return {
            "weights": self.weights,
            "steps": self.total_steps(),
            "base_steps": self.base_steps,
            "node_counts": self.counts.get(node, (0, 0)),
            "generation": self.generations[node],
            "statistics": self.statistics,
            "optimizer_steps": sum(self.node_optimizer_steps.values()),
            "node_optimizer_steps": self.node_optimizer_steps.get(node, 0),
        }

    def leave(self, node: str) -> None:
        """A node's launcher lost: drop its fp16 view (a model's copy); its counts stay."""
        self.views.pop(node, None)

    def total_steps(self) -> int:
        """Agent steps of the whole run: before it, and every node's since."""
        return self.base_steps + sum(steps for steps, _ in self.counts.values())

    def pull(self) -> dict[str, Any]:
        """What the driver needs: weights, counts, reports and round trips since its last pull."""
        reports, self.reports = self.reports, []
        recent, self.recent_round_trips = self.recent_round_trips, []
        return {
            "weights": self.weights,
            "steps": self.total_steps(),
            "skipped": self.base_skipped + sum(skipped for _, skipped in self.counts.values()),
            "reports": reports,
            "round_trips": (len(recent), sum(recent)),
        }

    def stats(self) -> dict[str, Any]:
        """The run record's exchange figures."""
        count, total = self.round_trips
        return {
            "pushes_per_node": dict(self.pushes),
            "bytes_exchanged": self.bytes_exchanged,
            "round_trip_ms": round(total / count, 2) if count else None,
            "final_answers": dict(self.final_answers),
        }


def exchange_load(nodes: int, round_trip_ms: float, sync_interval: float) -> float:
    """The share of time the exchanges would keep the server busy if it did all their work.

    A node exchanges once every interval plus a round trip, so `nodes` nodes spend
    ``nodes * rt / (interval + rt)`` of the time exchanging: an upper bound on the server's
    load. Past 1 the exchanges overlap.
    """
    return nodes * round_trip_ms / (1e3 * sync_interval + round_trip_ms)


def busy_warning(nodes: int, round_trip_ms: float, config: TrainConfig) -> str | None:
    """The warning for an exchange load (`exchange_load`) of `BUSY_LOAD` or more, else None."""
    sync_interval = config.sync_interval
    load = exchange_load(nodes, round_trip_ms, sync_interval)
    if load < BUSY_LOAD:
        return None
    # The interval at which the same round trips would make a load of one half.
    enough = math.ceil(round_trip_ms * (2 * nodes - 1) / 1e3)
    fixes = [f"raise --sync-interval to {max(enough, math.ceil(2 * sync_interval))} s"]
    if config.exchange_statistics:
        fixes.append("drop --exchange-statistics (3x the bytes)")
    if config.exchange_precision == "fp32":
        fixes.append("use --exchange-precision fp16 where the network is the limit")
    return (
        f"{nodes} nodes' exchanges take {round_trip_ms:.0f} ms each against --sync-interval "
        f"{sync_interval:g} s, an exchange load of {load:.2f}: they overlap, so the parameter "
        f"server or the network is at its limit and the nodes wait for it; {', or '.join(fixes)}"
    )


# A node: the single-machine Hogwild pool, and its exchanges


def node_config(config: TrainConfig, index: int, place: int) -> TrainConfig:
    """The configuration of a node's pool: its workers' place in the whole run.

    The node started `index`-th (0 = the head; a restart counts anew) seeds from
    seed + index*W*K, so no two envs of the run share a seed. ``--distributed-step-size`` is
    dealt over the workers training at once: the node in `place` (`pick_place`) takes the list
    rotated by place*W, so a node that replaces a lost one takes its sizes.
    """
    per_node = config.workers * config.envs_per_worker
    sizes = config.distributed_step_size
    shift = place * config.workers % len(sizes) if sizes else 0
    return dataclasses.replace(
        config,
        seed=config.seed + index * per_node,
        distributed_step_size=(*sizes[shift:], *sizes[:shift]),
    )


def pick_place(previous: int | None, taken: set[int]) -> int:
    """The place of a node starting: its `previous` one when free, else the lowest free one."""
    if previous is not None and previous not in taken:
        return previous
    return next(place for place in range(len(taken) + 1) if place not in taken)


class NodeLauncher:
    """One machine's Hogwild pool (run as a Ray actor pinned to that machine)."""

    def __init__(
        self, config: TrainConfig, spec: EnvSpec, server: Any, node: str, index: int, place: int
    ):
        """Build the node's shared model from the server's weights, its optimizer, its pool."""
        import ray

        # Ray deletes and unpacks this code's folder again whenever a node on the same machine
        # sets up, and a process whose working directory was deleted cannot spawn. The modules
        # come through PYTHONPATH, so the working directory moves to one no node replaces.
        os.chdir(tempfile.gettempdir())

        from launcher import Launcher, share_model

        # This machine's GPUs and CPU: a node short of them fails to start; the driver names it.
        check_gpus(config.gpu_ids)
        check_precision(config.precision, config.gpu_ids)
        self.config = node_config(config, index, place)
        self.server = server
        self.node = node
        self.index = index
        self.ray = ray
        slots = config.workers + config.exchange_statistics  # + the other nodes' steps
        shared = share_model(config, spec, slots)
        model, optimizer = shared.model, shared.optimizer
        joined = ray.get(server.join.remote(node), timeout=SERVER_SECONDS)
        set_flat(model, joined["weights"])  # in place: into the shared memory
        self.pool = Launcher(self.config, spec, shared, None, extra_slots=1)
        self.pool.resumed_steps = joined["base_steps"]  # for the seeds of its workers' starts
        # Slot W holds every step but this launcher's own: the other nodes' and this node's
        # earlier launchers' (a restart). Only this actor writes it, at each exchange.
        self.others_slot = config.workers
        self.pool.ctx.steps[self.others_slot] = joined["steps"]
        self.before = joined["node_counts"]  # its earlier launchers' steps and skipped steps
        self.generation = joined["generation"]
        self.sync = WeightSync(model, joined["weights"], config.exchange_precision)
        self.statistics = None
        if config.exchange_statistics:
            self.statistics = StatisticsSync(
                optimizer, config.workers, joined["statistics"], joined["optimizer_steps"],
                joined["node_optimizer_steps"],
            )  # fmt: skip
        self.pool.on_poll = self._poll
        self.next_sync = 0.0
        self.round_trip_ms: float | None = None
        self.reports: list[dict[str, Any]] = []

    def _exchange(self, last: bool = False) -> None:
        started = time.monotonic()
        ctx = self.pool.ctx
        steps = sum(ctx.steps[: self.config.workers])
        skipped = sum(ctx.skipped[: self.config.workers])
        counts = (steps + self.before[0], skipped + self.before[1])  # this node's, all launchers
        pushed = (*counts, self.round_trip_ms, self.reports, self.generation, last)
        self.reports = []

        def send(change: np.ndarray) -> np.ndarray:
            answer, total = self.ray.get(self.server.exchange.remote(self.node, change, *pushed))
            ctx.steps[self.others_slot] = total - steps
            return answer

        self.sync.exchange(send, last)
        if self.statistics is not None and not last:  # the last: no step follows
            remote = self.server.exchange_statistics.remote
            self.statistics.exchange(
                lambda *sent: self.ray.get(remote(self.node, *sent, self.generation))
            )
        self.round_trip_ms = 1e3 * (time.monotonic() - started)

    def _take_reports(self) -> None:
        for payload in self.pool.monitor.train_window:
            payload.pop("normalizer", None)
            payload["rank"] = self.index * self.config.workers + int(payload["rank"])
            self.reports.append(payload)
        self.pool.monitor.train_window = []

    def _poll(self) -> None:
        self._take_reports()
        if time.monotonic() >= self.next_sync:
            self._exchange()
            self.next_sync = time.monotonic() + self.config.sync_interval

    def run(self) -> dict[str, Any]:
        """Train until stopped or out of budget, exchange a last time, return the node's summary.

        The workers stop first, so this node then holds the server's weights exactly.
        """
        try:  # inside the try: a failed spawn still stops the children already started
            if not self.pool.ctx.stopping():  # told to stop before it ran: no workers to start
                self.pool.start()
                self.pool.supervise()
        finally:
            self.pool.stop_children()
        self._take_reports()
        self._exchange(last=True)
        return {
            "node": self.node,
            "host": os.uname().nodename,
            "workers": self.config.workers,
            "stop_reason": self.pool.stop_reason or "stopped",
            "failed": self.pool.failed,
            "weights_digest": weights_digest(flat_weights(self.sync.model)),
            "code": str(Path(__file__).resolve().parent),  # the copy Ray unpacked on the node
            # Where its workers' seeds came from (`ProcessStart`): its --seed, offset by its
            # start, and the steps its sitting resumed from.
            "seeds": {"seed": self.config.seed, "resumed_steps": self.pool.resumed_steps},
        }

    def stop(self) -> None:
        """Ask the pool to stop (the driver's shutdown); `run` then returns."""
        self.pool.ctx.request_stop()


# The driver


def connect(ray: Any, address: str) -> None:
    """Join the cluster at `address` (``auto``, ``host:port``) or start one here (``local``).

    This checkout, less `RAY_EXCLUDES`, reaches the nodes through Ray's runtime environment.
    """
    runtime = {
        "working_dir": str(ROOT),
        "excludes": RAY_EXCLUDES,
        # Ray starts its workers at niceness 15; the node launchers' workers would inherit it
        # and lose the CPU to the head's test process. At 0 they run as on one machine.
        "env_vars": {"RAY_worker_niceness": "0"},
    }
    where = None if "://" in address else host_port(address)  # ray:// is Ray's client
    if where:  # Ray itself retries a silent host:port for minutes
        try:
            socket.create_connection(where, timeout=2).close()
        except OSError as err:
            silent = ConnectionError(f"nothing accepts a connection there: {err}")
            raise UsageError(init_refusal(address, silent)) from None
    try:
        # "local", not None: RAY_ADDRESS must not make it join one.
        dashboard = False if address == "local" else None
        ray.init(
            address=address, include_dashboard=dashboard, runtime_env=runtime, log_to_driver=True
        )
    except ray.exceptions.AuthenticationError:
        raise UsageError(
            f"--ray-address {address}: the cluster wants a token; {TOKEN_FIX}"
        ) from None
    except (ValueError, ConnectionError, RuntimeError) as err:
        raise UsageError(init_refusal(address, err, reached=where is not None)) from None


def init_refusal(address: str, err: Exception, reached: bool = False) -> str:
    """The one-line error for ``ray.init``'s `err`; `reached`: `address` took a connection."""
    why = " ".join(str(err).split())
    if why.startswith("Package size"):  # the checkout uploaded to the nodes (`RAY_EXCLUDES`)
        return (
            f"{ROOT} is too large to send to the nodes ({why.split('. ')[0]}); move large "
            "files out of this checkout or list them in a .rayignore file there"
        )
    if why.startswith("Version mismatch"):
        return (
            f"--ray-address {address}: this machine's Ray or Python is not the cluster's "
            f"({why.removeprefix('Version mismatch: ')}); install the cluster's Ray version "
            "here, under the same Python minor version (pip install ray==<its version>)"
        )
    if why.startswith("No node info found"):
        return (
            f"--ray-address {address}: this machine is not a node of that cluster ({why}); "
            f"run main.py on one of its machines, or join this one first with 'ray start "
            f"--address {address}'"
        )
    if isinstance(err, ConnectionError) and reached:
        # Ray says no more than this to a wrong token, and to a port not the cluster's.
        return (
            f"--ray-address {address}: something answers there but Ray could not join it "
            f"({why}): either the cluster wants its authentication token ({TOKEN_FIX}), "
            "or this is not the cluster's address (the one 'ray start --head' printed, "
            "port 6379 by default; not the dashboard's 8265 or the client's 10001)"
        )
    if isinstance(err, ConnectionError):
        return (
            f"--ray-address {address}: no Ray cluster answers there ({why}); start one with "
            "'ray start --head' (it prints the address), or use --ray-address local"
        )
    if not isinstance(err, ValueError):
        return f"--ray-address {address}: Ray could not join the cluster ({why})"
    if address == "auto" and (env := os.environ.get("RAY_ADDRESS")):  # Ray's auto reads it first
        return (
            f"--ray-address auto read RAY_ADDRESS={env!r}, which is not an "
            f"address ({why}); set it to the head's host:port, or unset it"
        )
    return (
        f"--ray-address {address!r} is not an address ({why}); pass auto, local or "
        "host:port (the head's 'ray start --head' prints it)"
    )


# What a user whose cluster uses Ray's token authentication sets (Ray 2.61+: every one).
TOKEN_FIX = (
    "export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the head's token, from 'ray "
    "get-auth-token' there> before main.py (docs/cluster.md#set-up-a-cluster)"
)


def pick_nodes(ray: Any, wanted: int) -> list[dict[str, Any]]:
    """The alive nodes to train on, the head first (`wanted` 0: all); UsageError if too few."""
    head = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n["Alive"]]
    alive.sort(key=lambda n: (n["NodeID"] != head, n["NodeID"]))
    if wanted > len(alive):
        raise UsageError(
            f"--nodes {wanted} asks for more machines than the cluster has alive ({len(alive)}); "
            f"pass --nodes {len(alive)} or fewer, or add nodes with 'ray start --address ...'"
        )
    return alive[:wanted] if wanted else alive


def pinned(node_id: str) -> Any:
    """Ray's scheduling strategy that puts an actor on node `node_id` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


class ClusterRun:
    """The driver's side of a cluster run: actors, weights for the test process, node losses.

    A lost launcher is logged and the run goes on. Every `ADOPT_SECONDS` the driver starts a
    launcher on each alive node without one, up to ``--nodes``: a restart (`RESTART_SECONDS`
    after the loss), a machine back or a new one. At most `MAX_STARTS` per node id, and no
    restart after a launcher failed.
    """

    def __init__(self, ray: Any, launcher: Launcher, nodes: list[dict[str, Any]]):
        """Start the parameter server and one node launcher per chosen node, the head first."""
        self.ray = ray
        self.config = config = launcher.config
        self.launcher = launcher
        self.log = launcher.log
        head = nodes[0]["NodeID"]
        ctx = launcher.ctx
        self.server = (
            ray.remote(ParameterServer)
            .options(num_cpus=0, scheduling_strategy=pinned(head))
            .remote(flat_weights(launcher.shared_model), ctx.total_steps(), ctx.total_skipped())
        )
        self.node_actor = ray.remote(NodeLauncher)
        self.nodes: dict[str, str] = {}  # every node id started on -> its host
        self.actors: dict[str, Any] = {}
        self.runs: dict[Any, str] = {}  # a launcher's run() -> its node id
        self.starts: dict[str, int] = {}
        self.places: dict[str, int] = {}  # a node's place in the pool (`pick_place`)
        self.finished: dict[str, dict[str, Any]] = {}
        self.lost: dict[str, str] = {}
        self.lost_at: dict[str, float] = {}
        self.refused: set[str] = set()  # nodes whose launcher could not start: not retried
        for node in nodes:
            self._start(node)
        self.next_pull = 0.0
        self.busy_window = (time.monotonic(), 0, 0.0)  # (start, exchanges timed, total ms)
        self.next_busy_warning = 0.0
        self.next_adopt = time.monotonic() + ADOPT_SECONDS
        self.log.info(
            f"cluster: {count_of(len(self.nodes), 'node')} x "
            f"{count_of(config.workers, 'worker')}, parameter server on "
            f"{self.nodes[head]}, exchanges every {config.sync_interval:g} s "
            f"({config.exchange_precision})"
        )

    def _start(self, node: dict[str, Any]) -> None:
        """A node launcher on `node` (a `ray.nodes()` entry), running."""
        node_id = node["NodeID"]
        self.nodes[node_id] = node["NodeManagerAddress"]
        index = sum(self.starts.values())  # a new index each start: its own seeds and ranks
        taken = {self.places[running] for running in self.runs.values()}
        place = self.places[node_id] = pick_place(self.places.get(node_id), taken)
        actor = self.node_actor.options(
            num_cpus=0, max_concurrency=2, scheduling_strategy=pinned(node_id)
        ).remote(self.config, self.launcher.spec, self.server, node_id, index, place)
        self.actors[node_id] = actor
        self.runs[actor.run.remote()] = node_id
        self.starts[node_id] = self.starts.get(node_id, 0) + 1

    def _name(self, node_id: str) -> str:
        return f"node {node_id[:12]} ({self.nodes[node_id]})"

    def _adopt(self) -> None:
        """Start launchers on alive nodes without one, up to ``--nodes`` (0: all).

        A node that lost its launcher waits `RESTART_SECONDS`, unless no launcher is left.
        """
        now = time.monotonic()
        self.next_adopt = now + ADOPT_SECONDS
        ended = any(not r["failed"] for r in self.finished.values())
        if ended or self.launcher.ctx.budget_reached():
            return  # the run is ending: a node stopped on its workers' end or the budget
        running = set(self.runs.values())
        for node in pick_nodes(self.ray, 0):
            node_id = node["NodeID"]
            if len(running) >= (self.config.nodes or math.inf):
                return
            starts = self.starts.get(node_id, 0)
            if node_id in {*running, *self.finished, *self.refused} or starts >= MAX_STARTS:
                continue
            restart_at = self.lost_at.get(node_id, -math.inf) + RESTART_SECONDS
            if now < restart_at and running:
                self.next_adopt = min(self.next_adopt, restart_at)  # look again then
                continue
            self._start(node)
            running.add(node_id)
            what = f"restarted (start {starts + 1} of at most {MAX_STARTS})" if starts else "joined"
            self.log.warning(
                f"{self._name(node_id)} {what}; the run goes on with "
                f"{count_of(len(running), 'node')}"
            )

    def pull(self) -> tuple[int, float]:
        """The server's weights into the driver's model; returns the round trips since the last."""
        pulled = self.ray.get(self.server.pull.remote(), timeout=SERVER_SECONDS)
        set_flat(self.launcher.shared_model, pulled["weights"])
        ctx = self.launcher.ctx
        # The driver's one slot holds the cluster's count, written here only.
        ctx.steps[0] = pulled["steps"] - ctx.base_steps
        ctx.skipped[0] = pulled["skipped"] - ctx.base_skipped
        for payload in pulled["reports"]:
            self.launcher.monitor.take("train", payload)
        return pulled["round_trips"]

    def watch_load(self, count: int, total_ms: float) -> None:
        """Add a pull's round trips to the window; at its end, warn if the load is high."""
        start, window_count, window_ms = self.busy_window
        window_count, window_ms = window_count + count, window_ms + total_ms
        now = time.monotonic()
        if now - start < BUSY_WINDOW_SECONDS:
            self.busy_window = (start, window_count, window_ms)
            return
        self.busy_window = (now, 0, 0.0)
        if not window_count or not self.runs or now < self.next_busy_warning:
            return
        warning = busy_warning(len(self.runs), window_ms / window_count, self.config)
        if warning:
            self.log.warning(warning)
            self.next_busy_warning = now + BUSY_WARNING_SECONDS

    def poll(self) -> None:
        """Every supervision round: nodes that ended or died, new launchers, weights."""
        done = []
        if self.runs:
            done, _ = self.ray.wait(list(self.runs), num_returns=len(self.runs), timeout=0)
        ended = [(self.runs.pop(ref), ref) for ref in done]  # all out first: `_settle` counts
        for node_id, ref in ended:
            self._settle(node_id, ref)
        # With no launcher left, ask the server first: a lost server ends every node's run
        # and fails their restarts, and the run must say so, not that no node could start.
        if time.monotonic() >= self.next_pull or (ended and not self.runs):
            try:
                self.watch_load(*self.pull())
            except self.ray.exceptions.RayError as err:
                lines = [line for line in str(err).splitlines() if line.strip()] or [repr(err)]
                self.launcher.stop_reason = f"the parameter server was lost: {lines[0][:300]}"
                self.launcher.failed = True
                self.launcher.ctx.request_stop()
            self.next_pull = time.monotonic() + self.config.sync_interval
        # After a loss, wait for the next round (Ray may list a dying machine as alive), unless
        # no launcher is left: then a node still waiting its restart starts now.
        if not self.launcher.ctx.stopping() and (
            time.monotonic() >= self.next_adopt or not self.runs
        ):
            self._adopt()
        if not self.runs and not self.launcher.ctx.stopping():
            if self.finished:
                why = "every node stopped"
            elif set(self.lost) <= self.refused:
                why = "no node could start its launcher"
            else:
                why = "every node was lost"
            self.launcher.stop_reason = self.launcher.stop_reason or why
            self.launcher.failed = all(r["failed"] for r in self.finished.values())
            self.launcher.ctx.request_stop()

    def _settle(self, node_id: str, ref: Any) -> bool:
        """Take a launcher's end: its summary, or why it was lost. Returns whether it was lost."""
        if self.launcher.ctx.stopping():
            after = "the run is stopping"
        elif self.runs:
            after = f"the run goes on with {count_of(len(self.runs), 'node')}"
        else:
            after = "no node is training now"
        try:
            result = self.finished[node_id] = self.ray.get(ref)
            what = f"failed: {result['stop_reason']}" if result["failed"] else ""
        except self.ray.exceptions.RayError as err:
            lines = [line for line in str(err).splitlines() if line.strip()] or [repr(err)]
            # A launcher that raised (in run() or while starting): its traceback's last line
            # names the exception; else Ray's own reason comes first.
            refused = bool(getattr(err, "actor_init_failed", False))
            task_error = refused or isinstance(err, self.ray.exceptions.RayTaskError)
            cause = (lines[-1] if task_error else lines[0]).strip()[:300]
            self.lost[node_id] = cause
            self.lost_at[node_id] = time.monotonic()
            self.server.leave.remote(node_id)
            if refused:
                self.refused.add(node_id)  # the same machine would refuse again
            what = f"{'could not start' if refused else 'lost'}: {cause}"
        if what:
            self.log.error(f"{self._name(node_id)} {what}; {after}")
        self.ray.kill(self.actors[node_id])  # its run is over: free its model and optimizer
        return node_id not in self.finished  # a node whose launcher finished never restarts

    def stop(self) -> None:
        """Stop every node, wait for its last exchange, pull the final weights, record it all."""
        started = time.monotonic()
        stopping = len(self.runs)
        for node_id in self.runs.values():
            self.actors[node_id].stop.remote()
        lost = 0
        while self.runs and time.monotonic() < started + STOP_SECONDS:
            done, _ = self.ray.wait(list(self.runs), num_returns=1, timeout=1.0)
            for ref in done:
                lost += self._settle(self.runs.pop(ref), ref)
        stop_seconds = time.monotonic() - started
        ended_well = any(not result["failed"] for result in self.finished.values())
        self.log.info(
            f"cluster: {stopping - len(self.runs) - lost} of {count_of(stopping, 'node')} "
            f"stopped and made their last exchange in {stop_seconds:.1f} s"
            + (f" ({lost} lost while stopping)" if lost else "")
            if stopping
            else "cluster: every node had stopped by itself"
            if ended_well
            else "cluster: no node was running"
        )
        for node_id in self.runs.values():
            self.lost[node_id] = f"no final exchange within {STOP_SECONDS:.0f} s"
            self.log.error(
                f"{self._name(node_id)} made {self.lost[node_id]}: stopped without its last updates"
            )
            self.ray.kill(self.actors[node_id])  # its workers then stop by themselves
        if not ended_well:
            self.launcher.failed = True  # every node failed or was lost, to the end
        try:
            self.pull()
            stats = self.ray.get(self.server.stats.remote(), timeout=SERVER_SECONDS)
        except self.ray.exceptions.RayError as err:
            self.log.error(
                f"could not reach the parameter server at the end ({err}): the weights saved "
                "are its last pull's, without the nodes' last updates"
            )
            self.launcher.failed = True
            stats = {}
        answers = stats.pop("final_answers", None)
        for node_id, result in self.finished.items():
            # What the node holds at the end against what the server sent it last (None:
            # unknown, the server did not answer).
            digest = result.pop("weights_digest", None)
            result["matches_server"] = None if answers is None else digest == answers.get(node_id)
        self.launcher.monitor.record["cluster"] = {
            "nodes": [
                {"id": node_id, "host": host, "workers": self.config.workers}
                for node_id, host in self.nodes.items()
            ],
            **stats,
            "sync_interval": self.config.sync_interval,
            "stop_seconds": round(stop_seconds, 2),
            "starts": self.starts,
            "finished": self.finished,
            "lost": self.lost,
        }


@contextlib.contextmanager
def signals_noted(ray: Any) -> Iterator[list[int]]:
    """Inside, SIGINT and SIGTERM are noted in the list yielded, not acted on.

    ``ray.init`` swallows a SIGINT, and its SIGTERM handler exits leaving a local instance's
    agents running, so it may not set one here. A second signal raises KeyboardInterrupt.
    """
    noted: list[int] = []

    def note(signum: int, _frame: object) -> None:
        noted.append(signum)
        if len(noted) > 1:  # pressed again: now, even in a slow or hung start-up
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    ray_utils = ray._private.utils
    set_sigterm_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield noted
    finally:
        ray_utils.set_sigterm_handler = set_sigterm_handler
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_cluster(config: TrainConfig, prepare: Callable[..., Launcher]) -> int:
    """``main.py --ray-address ...``: the whole run; returns the exit code.

    `prepare` is ``main.prepare``: it builds the driver's launcher once the nodes are picked.
    """
    try:
        import ray
    except ImportError:
        raise UsageError(
            "--ray-address needs Ray, which is not installed; pip install -r "
            "requirements-ray.txt (or drop --ray-address to train on this machine)"
        ) from None
    try:
        with signals_noted(ray) as noted:  # until the launcher's own handlers take over
            connect(ray, config.ray_address)
            nodes = pick_nodes(ray, config.nodes)  # before prepare makes any folder
            launcher = prepare(config, cluster=True)
        if noted:  # a Ctrl-C or SIGTERM before anything started
            raise KeyboardInterrupt  # main.py: "stopped before training started", exit 130
        # From the nodes' start: a Ctrl-C then still stops them with their last exchange and
        # saves the weights (`Launcher.run`, which catches them too, sees the stop at once).
        with launcher.signals_caught():
            launcher.open_record()  # before any node starts: a failure leaves none to stop
            try:
                cluster = ClusterRun(ray, launcher, nodes)
            except Exception as err:  # the server or a launcher could not be created
                launcher.monitor.close(f"the cluster could not start: {err}", 1)
                raise
            launcher.on_poll = cluster.poll
            launcher.before_shutdown = cluster.stop
            return launcher.run()
    finally:
        # A Ctrl-C while Ray shuts down (the run's handlers are gone) must not hide the run's
        # exit code behind a KeyboardInterrupt; Ray's own exit handler finishes the job.
        with contextlib.suppress(KeyboardInterrupt):
            ray.shutdown()
