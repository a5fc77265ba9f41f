"""Training on a Ray cluster: the exchange arithmetic, then the real CLI on a real Ray cluster.

The cluster is Ray's own one-machine cluster (`ray.cluster_utils.Cluster`): a head and one
more node, each a real raylet with its own object store, listening on loopback only.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import cluster
from cluster import (
    ClusterRun,
    ErrorFeedback,
    ParameterServer,
    StatisticsSync,
    WeightSync,
    add_flat,
    busy_warning,
    exchange_load,
    flat_weights,
    node_config,
    pick_place,
    set_flat,
    weights_digest,
)
from monitor import RunMonitor
from shared_optim import SharedAdam, SharedRMSprop
from tests.conftest import (
    PONG,
    PONG_FLAGS,
    ROOT,
    folders,
    live_processes,
    load_pong_dat,
    main_here,
    make_args,
    run_cli,
    script_here,
)
from train import step_size_for

# Loopback only: otherwise Ray advertises this machine's interface address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def hogwild_update(model: nn.Module, seed: int) -> np.ndarray:
    """What a worker's optimizer step does to the shared model; returns the change."""
    change = np.random.default_rng(seed).normal(size=flat_weights(model).size).astype(np.float32)
    add_flat(model, change)
    return change


# -- the exchange arithmetic, without Ray -------------------------------------------------------


def test_ray_inits_value_errors_name_what_to_mend(monkeypatch):
    big = (
        "Package size (600.00MiB) exceeds the maximum size of 512.00MiB. To exclude large "
        "files, add them to '.gitignore' or '.rayignore' files"
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster.init_refusal("auto", ValueError(big)) == (
        f"{cluster.ROOT} is too large to send to the nodes (Package size (600.00MiB) exceeds "
        "the maximum size of 512.00MiB); move large files out of this checkout or list them in "
        "a .rayignore file there"
    )
    bad = ValueError("Invalid address format: head")
    assert cluster.init_refusal("auto", bad).startswith("--ray-address 'auto' is not an")
    monkeypatch.setenv("RAY_ADDRESS", "head")
    assert cluster.init_refusal("auto", bad) == (
        "--ray-address auto read RAY_ADDRESS='head', which is not an address (Invalid address "
        "format: head); set it to the head's host:port, or unset it"
    )
    assert cluster.init_refusal("h:1", bad).startswith("--ray-address 'h:1' is not an")


def test_ray_inits_connection_errors_tell_no_cluster_from_a_wrong_token_or_port():
    refused = ConnectionError("Failed to connect to GCS\nat h:1")
    assert cluster.init_refusal("auto", refused) == (
        "--ray-address auto: no Ray cluster answers there (Failed to connect to GCS at h:1); "
        "start one with 'ray start --head' (it prints the address), or use --ray-address local"
    )
    said = cluster.init_refusal("h:1", refused, reached=True)
    assert said.startswith("--ray-address h:1: something answers there but Ray could not join")
    assert cluster.TOKEN_FIX in said and "not the dashboard's 8265" in said


def test_ray_inits_runtime_errors_name_what_to_mend():
    mismatch = (
        "Version mismatch: The cluster was started with:\n    Ray: 2.60.0\n    Python: 3.12.1\n"
        "This process on node 10.0.0.2 was started with:\n    Ray: 2.59.0\n    Python: 3.11.7\n"
    )
    said = cluster.init_refusal("h:6379", RuntimeError(mismatch))
    assert said.startswith("--ray-address h:6379: this machine's Ray or Python is not the")
    assert "Ray: 2.60.0 Python: 3.12.1 This process" in said and "\n" not in said
    assert said.endswith("(pip install ray==<its version>)")
    elsewhere = "No node info found matching attributes: '10.0.0.9' when trying to resolve"
    assert "join this one first with 'ray start --address h:6379'" in cluster.init_refusal(
        "h:6379", RuntimeError(elsewhere)
    )
    assert cluster.init_refusal("auto", RuntimeError("boom")) == (
        "--ray-address auto: Ray could not join the cluster (boom)"
    )

    def init(**_kwargs):
        raise RuntimeError(mismatch)

    fake_ray = SimpleNamespace(init=init, exceptions=SimpleNamespace(AuthenticationError=OSError))
    with pytest.raises(cluster.UsageError, match="this machine's Ray or Python is not the"):
        cluster.connect(fake_ray, "auto")


def test_a_signal_while_ray_starts_is_noted_not_lost_and_rays_exit_handler_kept_out():
    # ray.init swallows a SIGINT (the run then trained to its end) and sets a SIGTERM handler
    # that exits at once, leaving a local instance's agents behind.
    set_by_ray = []
    utils = SimpleNamespace(set_sigterm_handler=set_by_ray.append)
    fake_ray = SimpleNamespace(_private=SimpleNamespace(utils=utils))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with cluster.signals_noted(fake_ray) as noted:
        fake_ray._private.utils.set_sigterm_handler(lambda *_: sys.exit(15))  # as ray.init does
        os.kill(os.getpid(), signal.SIGTERM)
    assert noted == [signal.SIGTERM] and set_by_ray == []
    assert fake_ray._private.utils.set_sigterm_handler == set_by_ray.append  # given back
    assert {sig: signal.getsignal(sig) for sig in before} == before
    # Pressed again (a slow or hung start-up): it stops now.
    with pytest.raises(KeyboardInterrupt), cluster.signals_noted(fake_ray) as noted:
        os.kill(os.getpid(), signal.SIGINT)
        first = list(noted)  # checked outside: the raises above would take a failed assert's
        os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt for a pass
    assert first == [signal.SIGINT] and noted == [signal.SIGINT, signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_flat_weights_round_trip_in_place():
    model = net(0)
    model.share_memory()
    storage = [p.data_ptr() for p in model.parameters()]
    weights = flat_weights(model)
    set_flat(model, weights * 2)
    assert np.allclose(flat_weights(model), weights * 2)
    assert [p.data_ptr() for p in model.parameters()] == storage  # still the shared tensors
    with pytest.raises(ValueError, match="expected 26 values, got 3"):
        add_flat(model, np.zeros(3, np.float32))


def test_updates_made_during_a_round_trip_survive_and_go_out_with_the_next_push():
    start = flat_weights(net(0))
    server = ParameterServer(start)
    node = net(0)
    sync = WeightSync(node, start.copy())
    before = hogwild_update(node, 1)
    during: list[np.ndarray] = []

    def send(change: np.ndarray) -> np.ndarray:
        during.append(hogwild_update(node, 2))  # a worker steps while the push is in flight
        return server.exchange("a", change, steps=10, skipped=0)[0].copy()

    sync.exchange(send)
    assert np.allclose(server.weights, start + before, atol=1e-6)
    # shared = pulled + what the workers did meanwhile, not pulled alone.
    assert np.allclose(flat_weights(node), start + before + during[0], atol=1e-6)
    sync.exchange(lambda change: server.exchange("a", change, 20, 0)[0].copy())
    assert np.allclose(server.weights, start + before + during[0], atol=1e-6)
    assert np.allclose(flat_weights(node), server.weights, atol=1e-6)


def test_the_server_adds_every_nodes_push_once():
    start = flat_weights(net(0))
    server = ParameterServer(start, base_steps=100)
    nodes = [net(0), net(0)]
    syncs = [WeightSync(node, start.copy()) for node in nodes]
    total = np.zeros_like(start)
    for round_ in range(3):
        for index, (node, sync) in enumerate(zip(nodes, syncs, strict=True)):
            total += hogwild_update(node, 10 * round_ + index)
            name = f"node{index}"
            sync.exchange(lambda change, n=name: server.exchange(n, change, 50, 1)[0].copy())
    for sync in syncs:  # a last exchange each, with nothing new: everyone holds the sum
        sync.exchange(lambda change: server.exchange("any", change, 0, 0)[0].copy())
    assert np.allclose(server.weights, start + total, atol=1e-5)  # a sum, not an average
    for node in nodes:
        assert np.allclose(flat_weights(node), server.weights, atol=1e-5)
    assert server.pull()["steps"] == 100 + 50 + 50
    assert server.stats()["pushes_per_node"] == {"node0": 3, "node1": 3, "any": 2}


def test_the_driver_hears_the_round_trips_since_its_last_pull_and_warns_when_they_overlap():
    start = flat_weights(net(0))
    server = ParameterServer(start)
    change = np.zeros_like(start)
    server.exchange("a", change, 1, 0)  # a node's first exchange has no round trip to report
    server.exchange("a", change, 2, 0, last_round_trip_ms=900.0)  # nor is its first counted
    server.exchange("b", change, 2, 0, last_round_trip_ms=900.0)  # (its workers were starting)
    assert server.pull()["round_trips"] == (0, 0.0)
    server.exchange("a", change, 3, 0, last_round_trip_ms=100.0)
    server.exchange("b", change, 3, 0, last_round_trip_ms=300.0)
    assert server.pull()["round_trips"] == (2, 400.0)
    assert server.pull()["round_trips"] == (0, 0.0)  # since the last pull only
    assert server.stats()["round_trip_ms"] == 550.0  # the run record's: the whole run, all
    # 2 nodes at 1 s with 188 ms round trips (the statistics' exchange measured on 2 nodes):
    # busy a third of the time at most; 10 such nodes overlap.
    assert exchange_load(2, 188.0, 1.0) == pytest.approx(0.316, abs=1e-3)
    statistics = make_args(sync_interval=1.0, exchange_statistics=True)
    assert busy_warning(2, 188.0, statistics) is None
    warning = busy_warning(10, 188.0, statistics)
    assert warning is not None and "\n" not in warning
    assert "10 nodes' exchanges take 188 ms" in warning and "load of 1.58" in warning
    assert "raise --sync-interval to 4 s" in warning  # 188 ms x 19: a load of one half
    assert "drop --exchange-statistics" in warning and "--exchange-precision fp16" in warning
    advice = busy_warning(64, 60.0, make_args(sync_interval=1.0, exchange_precision="fp16"))
    assert "raise --sync-interval to 8 s" in advice and "fp16" not in advice.split(";")[1]
    assert "statistics" not in advice


def test_the_driver_judges_the_load_over_a_window_and_warns_at_most_every_few_minutes(
    monkeypatch,
):
    clock = [1000.0]
    monkeypatch.setattr(cluster.time, "monotonic", lambda: clock[0])
    warnings_logged = []
    run = SimpleNamespace(
        busy_window=(clock[0], 0, 0.0),
        next_busy_warning=0.0,
        runs={"ref0": "a", "ref1": "b"},
        config=make_args(sync_interval=0.1),
        log=SimpleNamespace(warning=warnings_logged.append),
    )

    def pull(count, total_ms, after):
        clock[0] += after
        ClusterRun.watch_load(run, count, total_ms)

    pull(10, 1000.0, 30.0)  # 100 ms round trips at 0.1 s, 2 nodes: a load of 1
    assert warnings_logged == []  # the window is not over yet
    pull(10, 1000.0, 31.0)
    assert len(warnings_logged) == 1 and "2 nodes' exchanges take 100 ms" in warnings_logged[0]
    assert run.busy_window == (clock[0], 0, 0.0)  # a new window
    pull(20, 2000.0, 61.0)
    assert len(warnings_logged) == 1  # not again within BUSY_WARNING_SECONDS
    clock[0] += cluster.BUSY_WARNING_SECONDS
    pull(20, 200.0, 61.0)  # 10 ms round trips: no warning
    pull(20, 2000.0, 61.0)
    assert len(warnings_logged) == 2


def test_error_feedback_delivers_what_fp16_alone_would_round_away():
    feedback = ErrorFeedback(3)
    step = np.array([1e-8, 3e-5, 1.0 + 2**-12], dtype=np.float32)  # under fp16's smallest step,
    sent = np.zeros(3, np.float64)  # between two fp16 values, and just over 1 (step 2**-10)
    for _ in range(1000):
        sent += feedback.send(step).astype(np.float64)
    meant = 1000 * step.astype(np.float64)
    assert np.all(step.astype(np.float16).astype(np.float64) * 1000 != meant)  # fp16 alone is off
    # Everything sent is everything meant, but for the one rounding still owed.
    assert np.allclose(sent + feedback.owed, meant, rtol=1e-6, atol=1e-9)
    assert np.all(np.abs(feedback.owed) <= np.abs(step) + 1e-7)
    assert np.allclose(sent + feedback.flush(np.zeros(3, np.float32)), meant, rtol=1e-6)
    assert not feedback.owed.any()


def test_error_feedback_clips_to_fp16s_range_and_owes_the_rest():
    feedback = ErrorFeedback(1)
    first = feedback.send(np.array([1e5], np.float32))
    assert np.isfinite(first).all() and float(first[0]) == 65504.0
    assert float(feedback.owed[0]) == 1e5 - 65504.0
    assert float(feedback.send(np.zeros(1, np.float32))[0]) == 1e5 - 65504.0


def test_fp16_exchanges_keep_every_update_and_end_on_the_servers_weights():
    start = flat_weights(net(0))
    servers = {p: ParameterServer(start) for p in ("fp32", "fp16")}
    nodes = {p: [net(0), net(0)] for p in servers}
    syncs = {p: [WeightSync(n, start.copy(), p) for n in nodes[p]] for p in servers}

    def exchange(precision: str, index: int, during: np.ndarray | None, last: bool = False):
        def send(sent: np.ndarray) -> np.ndarray:
            if during is not None:
                add_flat(nodes[precision][index], during)  # a worker steps meanwhile
            return servers[precision].exchange(f"n{index}", sent, 0, 0, last=last)[0].copy()

        syncs[precision][index].exchange(send, last)

    total = np.zeros_like(start)
    for round_ in range(6):
        for index in range(2):
            rng = np.random.default_rng(10 * round_ + index)
            # Steps large enough that fp16's rounding of them (2**-11 of each) would show in
            # the sum without error feedback; the same on both runs.
            before, during = (3e-2 * rng.normal(size=(2, start.size))).astype(np.float32)
            total += before + during
            for precision in servers:
                add_flat(nodes[precision][index], before)
                exchange(precision, index, during)
            if round_ > 0:  # the fp16 node's snapshot is the server's copy of it, to the bit
                assert np.array_equal(
                    syncs["fp16"][index].snapshot, servers["fp16"].views[f"n{index}"]
                )
    for precision, server in servers.items():
        for index in range(2):
            exchange(precision, index, None, last=True)
            # Right after its last exchange a node holds exactly the server's weights, and the
            # digests the run record compares say so.
            assert np.array_equal(flat_weights(nodes[precision][index]), server.weights)
            digest = weights_digest(flat_weights(nodes[precision][index]))
            assert server.stats()["final_answers"][f"n{index}"] == digest
        assert digest != weights_digest(start)  # a digest tells different weights apart
        assert np.allclose(server.weights, start + total, rtol=0, atol=2e-6), precision
    # The first answer to each node is its float32 weights; the rest go in half the bytes.
    fp32, fp16 = (servers[p].bytes_exchanged for p in ("fp32", "fp16"))
    assert fp16 < 0.62 * fp32


def test_a_restarted_node_goes_on_from_its_counts_and_starts_its_fp16_exchanges_afresh():
    start = flat_weights(net(0))
    server = ParameterServer(start, base_steps=100)
    node = net(0)
    sync = WeightSync(node, start.copy(), "fp16")
    for steps in (10, 20):
        hogwild_update(node, steps)
        sync.exchange(lambda change, n=steps: server.exchange("a", change, n, 1)[0].copy())
    assert "a" in server.views
    joined = server.join("a")  # a new launcher on node "a"
    assert (joined["steps"], joined["node_counts"]) == (120, (20, 1))
    assert joined["base_steps"] == 100  # the resumed steps: the sitting its workers seed by
    assert "a" not in server.views
    weights = joined["weights"].copy()  # what Ray would hand over: a copy
    fresh = net(1)
    set_flat(fresh, weights)
    resync = WeightSync(fresh, weights.copy(), "fp16")
    made = 1e-3 * hogwild_update(net(2), 3)
    add_flat(fresh, made)
    # Its first fp16 push is answered with the weights, not a change since the old snapshot.
    resync.exchange(lambda change: server.exchange("a", change, 20 + 5, 1)[0].copy())
    assert np.array_equal(resync.snapshot, server.weights)
    assert np.array_equal(flat_weights(fresh), server.weights)
    assert np.allclose(server.weights, weights + made, rtol=0, atol=1e-6)
    assert server.pull()["steps"] == 125


def test_a_replaced_launchers_late_exchange_counts_but_leaves_the_new_ones_state_alone():
    start = flat_weights(net(0))
    server = ParameterServer(start)
    old = server.join("a")["generation"]
    fp16 = np.full(start.shape, 2**-10, dtype=np.float16)
    server.exchange("a", fp16, 10, 1, generation=old)  # its first fp16 exchange: a view
    new = server.join("a")  # the launcher is restarted on its machine
    assert new["generation"] == old + 1 and "a" not in server.views
    server.exchange("a", fp16, 3, 0, generation=new["generation"])
    view = server.views["a"].copy()
    # The replaced launcher's last exchange arrives late: its updates are added, but the
    # node's counts and fp16 view are the new launcher's, and the answer is the weights.
    report = {"worker": 0, "policy_loss": 0.5}  # its workers' last training summary
    answer, total = server.exchange("a", fp16, 99, 9, reports=[report], generation=old)
    assert answer.dtype == np.float32 and np.array_equal(answer, server.weights)
    assert server.pull()["reports"] == [report]  # for TensorBoard, as any launcher's
    assert np.array_equal(server.views["a"], view)
    assert (server.counts["a"], total) == ((3, 0), 3)
    assert np.allclose(server.weights, start + 3 * 2**-10, rtol=0, atol=1e-7)
    server.leave("a")  # lost: its view (a copy of the model) goes, its counts stay
    assert "a" not in server.views and server.pull()["steps"] == 3


def test_a_restarted_launchers_first_round_trip_is_left_out_of_the_load_window():
    start = flat_weights(net(0))
    server = ParameterServer(start)
    change = np.zeros_like(start)
    first = server.join("a")["generation"]
    server.exchange("a", change, 1, 0, last_round_trip_ms=900.0, generation=first)
    server.exchange("a", change, 2, 0, last_round_trip_ms=100.0, generation=first)
    assert server.pull()["round_trips"] == (1, 100.0)
    again = server.join("a")["generation"]  # restarted: its workers are starting again
    server.exchange("a", change, 3, 0, last_round_trip_ms=800.0, generation=again)
    assert server.pull()["round_trips"] == (0, 0.0)
    server.exchange("a", change, 4, 0, last_round_trip_ms=120.0, generation=again)
    assert server.pull()["round_trips"] == (1, 120.0)
    assert server.stats()["round_trip_ms"] == 480.0  # the run record's mean: every one


class ServerLostError(Exception):
    """The driver's stand-in for Ray's errors (`driver_at_poll`)."""


def driver_at_poll(runs: dict, ended: dict, next_adopt: float) -> SimpleNamespace:
    """A `ClusterRun` as `poll` sees it; `ended`: the launchers whose run() returned -> lost."""
    stop = {"requested": False}
    run = SimpleNamespace(
        runs=runs, finished={}, lost={}, refused=set(), next_adopt=next_adopt, adopted=[],
        next_pull=math.inf, pulls=[], config=SimpleNamespace(sync_interval=5.0),
        ray=SimpleNamespace(
            wait=lambda refs, **_: ([r for r in refs if r in ended], []),
            exceptions=SimpleNamespace(RayError=ServerLostError),
        ),
        launcher=SimpleNamespace(
            stop_reason="", failed=False,
            ctx=SimpleNamespace(
                stopping=lambda: stop["requested"],
                request_stop=lambda: stop.update(requested=True),
            ),
        ),
    )  # fmt: skip

    def settle(node_id, ref):
        if ended[ref]:
            run.lost[node_id] = "killed"
        else:
            run.finished[node_id] = {"failed": True}
        return ended[ref]

    def pull():
        run.pulls.append(time.monotonic())
        return 0, 0.0

    run._settle = settle
    run.pull = pull
    run.watch_load = lambda count, total_ms: None
    run._adopt = lambda: run.adopted.append(time.monotonic())
    return run


def test_when_the_last_launcher_fails_a_node_waiting_its_restart_is_looked_at_at_once():
    # Node b was lost moments ago and waits its restart; then a, the last one running,
    # fails. The driver must look for launchers to start (b's wait ends when none is left)
    # before it calls the run over, whichever of the two ended first.
    for ended in ({"ref_a": False}, {"ref_a": True}):  # a failed, or a was lost
        run = driver_at_poll({"ref_a": "a"}, ended, next_adopt=math.inf)
        run.lost["b"] = "killed"
        ClusterRun.poll(run)
        assert len(run.adopted) == 1
    run = driver_at_poll({"ref_a": "a", "ref_c": "c"}, {"ref_a": False}, next_adopt=math.inf)
    ClusterRun.poll(run)
    assert run.adopted == [] and run.runs == {"ref_c": "c"}  # c runs on: wait for the round
    # None could start again: the run stops, and says why.
    run = driver_at_poll({"ref_a": "a"}, {"ref_a": True}, next_adopt=math.inf)
    run.refused.add("a")
    ClusterRun.poll(run)
    assert run.launcher.ctx.stopping() and run.launcher.failed
    assert run.launcher.stop_reason == "no node could start its launcher"
    run = driver_at_poll({"ref_a": "a"}, {"ref_a": True}, next_adopt=math.inf)
    ClusterRun.poll(run)
    assert run.launcher.stop_reason == "every node was lost"


def test_when_no_launcher_is_left_the_driver_asks_the_server_before_starting_new_ones():
    # A lost server ends every node's run, and restarts would fail to join it: the run must
    # stop saying the server was lost, not that no node could start.
    run = driver_at_poll({"ref_a": "a", "ref_b": "b"}, {"ref_a": False}, next_adopt=math.inf)
    ClusterRun.poll(run)
    assert run.pulls == []  # b runs on: the pull waits its turn
    run = driver_at_poll({"ref_a": "a"}, {"ref_a": False}, next_adopt=math.inf)

    def lost():
        raise ServerLostError("The actor died unexpectedly before finishing this task.\nmore")

    run.pull = lost
    ClusterRun.poll(run)
    assert run.adopted == [] and run.launcher.failed
    assert run.launcher.stop_reason == (
        "the parameter server was lost: The actor died unexpectedly before finishing this task."
    )


def test_a_server_lost_at_the_final_pull_fails_the_run_and_leaves_the_match_unknown():
    # Every node made its last exchange; then the server did not answer the driver's final
    # pull: the weights it saves miss the nodes' last updates, so the run must not exit 0.
    class RayError(Exception):
        pass

    def unreachable(*_args, **_kwargs):
        raise RayError("the actor died")

    infos: list[str] = []

    run = SimpleNamespace(
        runs={}, actors={}, lost={}, starts={"a": 1},
        finished={"a": {"failed": False, "weights_digest": "d1"}},
        nodes={"a": "127.0.0.1"},
        ray=SimpleNamespace(exceptions=SimpleNamespace(RayError=RayError), get=unreachable),
        server=SimpleNamespace(stats=SimpleNamespace(remote=lambda: None)),
        pull=unreachable, config=SimpleNamespace(sync_interval=5.0, workers=1),
        launcher=SimpleNamespace(failed=False, monitor=SimpleNamespace(record={})),
        log=SimpleNamespace(info=infos.append, error=lambda _m: None),
    )  # fmt: skip
    ClusterRun.stop(run)
    assert run.launcher.failed
    assert run.launcher.monitor.record["cluster"]["finished"]["a"]["matches_server"] is None
    assert infos[0] == "cluster: every node had stopped by itself"  # at --max-steps
    run.finished = {"a": {"failed": True}}
    ClusterRun.stop(run)
    assert infos[-1] == "cluster: no node was running"  # every node had failed or was lost


def test_the_drivers_training_reports_keep_the_normalisers_a_resumed_state_had():
    # A node's reports reach the driver without the workers' normalisers (they stay on the
    # node); a state resumed from a single-machine run keeps the ones it saved.
    saved = {"kind": "vector", "count": 7}
    games: list = []
    monitor = SimpleNamespace(
        worker_normalizers={0: saved}, train_window=[], _training_games=games.extend
    )
    RunMonitor.take(monitor, "train", {"rank": 0, "loss": 1.0, "games": [(7.0, 90)]})
    # A node's monitor keeps the workers' games in the report it passes on to the driver.
    assert games == [(7.0, 90)] and monitor.train_window[0]["games"] == [(7.0, 90)]
    RunMonitor.take(monitor, "train", {"rank": 1, "loss": 1.0, "normalizer": None})
    assert monitor.worker_normalizers == {0: saved}
    assert [r["rank"] for r in monitor.train_window] == [0, 1]
    RunMonitor.take(monitor, "train", {"rank": 1, "loss": 1.0, "normalizer": {"count": 2}})
    assert monitor.worker_normalizers[1] == {"count": 2}  # one machine's workers: as before


def optimizer_of(kind: str, model: nn.Module, slots: int) -> SharedAdam | SharedRMSprop:
    if kind == "Adam":
        return SharedAdam(model.parameters(), lr=1e-3, amsgrad=True, slots=slots)
    # (A momentum buffer adds grad / avg, which depends on the node's statistics of the
    # moment: exchanged too, but not to the bit of one optimizer's; main.py has no momentum.)
    return SharedRMSprop(model.parameters(), lr=1e-3, centered=True, slots=slots)


def gradient_step(optimizer: SharedAdam | SharedRMSprop, seed: int) -> None:
    """One worker's optimizer step, with gradients that depend on `seed` alone."""
    rng = np.random.default_rng(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.from_numpy(rng.normal(size=param.shape).astype(np.float32))
    optimizer.step()


def averages_of(optimizer: SharedAdam | SharedRMSprop) -> np.ndarray:
    return torch.cat([t.reshape(-1) for t, _, _ in optimizer.moving_averages()]).numpy()


@pytest.mark.parametrize("kind", ["Adam", "RMSprop"])
def test_exchanged_statistics_are_one_optimizers_stepped_by_every_node(kind):
    """Nodes that push in turn hold, after each pull, the statistics of one optimizer that took
    all their steps in that order, also the steps taken during a round trip; and they count
    the whole cluster's steps (Adam's bias correction)."""
    server = ParameterServer(flat_weights(net(0)))
    one = optimizer_of(kind, net(0), 1)  # one machine's shared optimizer: every step
    nodes, syncs = [], []
    for name in ("a", "b"):
        joined = server.join(name)
        nodes.append(optimizer_of(kind, net(0), 2))  # 1 worker + the other nodes' slot
        syncs.append(
            StatisticsSync(nodes[-1], 1, joined["statistics"], joined["optimizer_steps"], 0)
        )

    def exchange(index: int, during: list[int]) -> None:
        def send(*pushed):
            for seed in during:  # steps the node's workers take during the round trip
                gradient_step(nodes[index], seed)
            answer = server.exchange_statistics("ab"[index], *pushed)
            for seed in during:  # ... come after the merge, in one optimizer's order too
                gradient_step(one, seed)
            return answer[0].copy(), answer[1]

        syncs[index].exchange(send)

    seed = 0
    # A node's steps during a round trip go out with its next push: the same node pushes next.
    for round_, index in enumerate([0, 1, 0, 0, 1, 1, 1, 0]):
        for _ in range(1 + round_ % 3):  # 1-3 steps before each push
            seed += 1
            gradient_step(nodes[index], seed)
            gradient_step(one, seed)
        exchange(index, [100 + round_] if round_ in (2, 5) else [])
        assert np.allclose(averages_of(nodes[index]), averages_of(one), rtol=1e-5, atol=1e-7)
        assert nodes[index].steps_taken() == one.steps_taken()
    assert np.allclose(server.statistics, averages_of(one), rtol=1e-5, atol=1e-7)
    # A node that joins later starts from the cluster's statistics and its step count.
    joined = server.join("c")
    late = optimizer_of(kind, net(0), 2)
    StatisticsSync(late, 1, joined["statistics"], joined["optimizer_steps"], 0)
    assert np.array_equal(averages_of(late), server.statistics)
    assert late.steps_taken() == one.steps_taken()


def test_many_nodes_pushing_from_one_snapshot_make_one_optimizers_statistics():
    """64 nodes take 3 steps each from the same statistics and push in turn: the cluster's
    statistics are one optimizer's that took those 192 steps. Adding each node's change, as
    the weights are added, would decay them 64 times over: second moments below 0."""
    server = ParameterServer(flat_weights(net(0)))
    one = optimizer_of("RMSprop", net(0), 1)
    gradient_step(one, 0)
    for param in one.param_groups[0]["params"]:  # large gradients first: big averages
        param.grad.mul_(10)
    for _ in range(20):
        one.step()
    start = averages_of(one).copy()
    server.statistics = start.copy()
    changes = []
    for index in range(64):
        node = optimizer_of("RMSprop", net(0), 2)
        sync = StatisticsSync(node, 1, start, 0, 0)
        for step in range(3):
            gradient_step(node, 1000 * index + step)
            gradient_step(one, 1000 * index + step)
        changes.append(averages_of(node) - start)
        sync.exchange(lambda *pushed, n=index: server.exchange_statistics(f"n{n}", *pushed))
    assert np.allclose(server.statistics, averages_of(one), rtol=1e-4, atol=1e-6)
    second = np.concatenate([np.full(t.numel(), sq) for t, _, sq in one.moving_averages()])
    assert (server.statistics[second.astype(bool)] > 0).all()
    naive = start + np.sum(changes, axis=0)
    assert (naive[second.astype(bool)] < 0).any()


@pytest.mark.parametrize(("workers", "sizes"), [(1, (5, 20)), (2, (5, 10, 20)), (3, (5, 20))])
def test_nodes_deal_seeds_and_step_sizes_as_one_big_pool_would(workers, sizes):
    """Node i's worker r is worker i*W + r of one pool: its n-step and its envs' seeds."""
    config = make_args(workers=workers, envs_per_worker=2, seed=7, distributed_step_size=sizes)
    pool = workers * 3
    dealt, seeds = [], []
    for index in range(3):
        node = node_config(config, index, index)
        dealt += [
            step_size_for(r, node.num_steps, node.distributed_step_size) for r in range(workers)
        ]
        seeds += [node.seed + r + k * workers for r in range(workers) for k in range(2)]
    assert dealt == [step_size_for(r, config.num_steps, sizes) for r in range(pool)]
    assert sorted(seeds) == [7 + s for s in range(pool * 2)]
    assert node_config(make_args(workers=2), 1, 1).distributed_step_size == ()


def test_a_node_replacing_a_lost_one_takes_its_step_sizes_and_new_seeds():
    """Node 1 of 2 (W=1, sizes 5 and 20) is lost and a third start replaces it: with 20."""
    config = make_args(workers=1, envs_per_worker=2, seed=7, distributed_step_size=(5, 20))
    places = {"a": pick_place(None, set()), "b": pick_place(None, {0})}
    assert places == {"a": 0, "b": 1}
    assert pick_place(places["b"], {0}) == 1  # b comes back: its own place
    assert pick_place(None, {0}) == 1  # or another node takes the free one
    assert pick_place(1, {0, 1}) == 2  # b back after a newcomer took its place
    assert pick_place(None, {0, 2}) == 1
    replacement = node_config(config, 2, pick_place(None, {0}))
    first = node_config(config, 0, 0)
    sizes = [step_size_for(0, n.num_steps, n.distributed_step_size) for n in (first, replacement)]
    assert sizes == [5, 20]
    assert replacement.seed == 7 + 2 * 2  # seeds by start: none shared with the lost node's


# -- the CLI without a cluster ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "2"], "--nodes 2 needs --ray-address"),
        (["--ray-address", "local", "--sync-interval", "0"], "--sync-interval must be a positive"),
        (["--ray-address", "local", "--nodes", "-1"], "--nodes must be 0 (every node) or more"),
        (["--ray-address", ""], "--ray-address is empty (an unset variable?); pass auto"),
        (["--ray-address", "host:abc"], "--ray-address 'host:abc' is not an address"),
        (["--ray-address", "head"], "--ray-address 'head' is not an address"),
        (["--ray-address", "host:\u00b2"], "--ray-address 'host:\u00b2' is not an address"),
        (["--ray-address", "host:70000"], "--ray-address 'host:70000' is not an address"),
        (["--ray-address", "::1:6379"], "--ray-address '::1:6379' is not an address"),
        (["--exchange-precision", "fp16"], "--exchange-precision fp16 needs --ray-address"),
        (["--exchange-statistics"], "--exchange-statistics needs --ray-address"),
        (["--sync-interval", "5"], "--sync-interval 5 needs --ray-address"),
        (
            ["--ray-address", "local", "--exchange-statistics", "--no-shared-optimizer"],
            "--exchange-statistics exchanges the shared optimizer's statistics; drop "
            "--no-shared-optimizer",
        ),
        (
            ["--ray-address", "local", "--exchange-precision", "bf16"],
            "argument --exchange-precision: invalid choice: 'bf16'",
        ),
    ],
)
def test_bad_cluster_flags_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, flags, message):
    first = flags == ["--nodes", "2"]  # through the real CLI; the rest in this process
    code, stderr = main_here([*flags, *folders(tmp_path)], monkeypatch, capsys, first)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"main.py: error: {message}"), lines
    assert not (tmp_path / "models").exists()


def test_an_address_where_nothing_listens_is_refused_at_once(tmp_path):
    """Ray alone would retry such an address for minutes; main.py says so in one line."""
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a loopback port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    result = run_cli("main.py", "--ray-address", address, *folders(tmp_path), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"main.py: error: --ray-address {address}: no Ray cluster answers there (nothing "
        "accepts a connection there: "
    ), lines
    assert "'ray start --head'" in lines[0]
    assert not (tmp_path / "models").exists()


def test_without_ray_installed_ray_address_says_how_to_install_it(tmp_path):
    (tmp_path / "ray.py").write_text("raise ImportError('No module named ray')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "main.py", "--ray-address", "local", *folders(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "main.py: error: --ray-address needs Ray, which is not installed; pip install -r "
        "requirements-ray.txt (or drop --ray-address to train on this machine)"
    )


def test_a_single_machine_run_never_imports_ray():
    probe = "import sys, main, cli; cli.parse_train_args([]); print('ray' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "False", result.stderr[-2000:]


# -- a real Ray cluster: one head and one more node on this machine -----------------------------


NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}


# Ray's token authentication on, as Ray 2.61 has it for every cluster: the nodes and every
# main.py run here hold the token in RAY_AUTH_TOKEN, as docs/cluster.md tells a user to.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    saved = {name: os.environ.get(name) for name in AUTH}
    os.environ.update(AUTH)
    reload_ray_auth()
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if cluster is not None:  # a failed start leaves no Ray process behind either
            cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_ray_auth()


def reload_ray_auth() -> None:
    """Has this process's Ray read ``RAY_AUTH_*`` again: it reads them once, when imported
    (what Ray's own tests do; its modules are private, so this is for tests only)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


CLUSTER_FLAGS = [*PONG_FLAGS, "--workers", "1", "--test-interval", "0", "--sync-interval", "1"]


def actor_processes(
    actors: tuple[str, ...] = ("NodeLauncher",), table: dict | None = None
) -> dict[int, int]:
    """Pid -> parent pid of every live actor process of these classes and its spawned children,
    in ``table`` (a ``live_processes()`` snapshot) or in a fresh one."""
    table = live_processes() if table is None else table
    found = {pid for pid, (_, _, cmd) in table.items() if any(actor in cmd for actor in actors)}
    return {pid: parent for pid, (parent, _, _) in table.items() if pid in found or parent in found}


EVERY_ACTOR = ("NodeLauncher", "ParameterServer")


def descendants(pid: int, table: dict | None = None) -> set[int]:
    """Every live process below `pid` (children, theirs, ...) in ``table`` or a fresh one:
    a driver's test process and multiprocessing's helpers."""
    table = live_processes() if table is None else table
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, (parent, _, _) in table.items() if parent in frontier}
        found |= frontier
    return found


def wait_until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "auth",
    [
        {"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None},
        {"RAY_AUTH_TOKEN": None},
        {"RAY_AUTH_TOKEN": "0" * 64},
    ],
    ids=["no_auth_mode", "no_token", "wrong_token"],
)
def test_without_the_clusters_token_main_says_what_to_set(ray_cluster, tmp_path, auth):
    env = {**os.environ, "HOME": str(tmp_path), **auth}  # HOME: no ~/.ray/auth_token either
    # Ray retries a refused connection once a second, 20 times by default: 2 here.
    env["RAY_gcs_server_port_wait_time_s"] = "2"
    result = subprocess.run(
        [sys.executable, "main.py", *CLUSTER_FLAGS, "--ray-address", ray_cluster.address,
         *folders(tmp_path)],
        cwd=ROOT, env={k: v for k, v in env.items() if v is not None}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    # Ray's own warnings as it retries come first (its C++ core writes them); then ours.
    ours = [line for line in result.stderr.splitlines() if line.startswith("main.py:")]
    assert len(ours) == 1, result.stderr[-3000:]
    assert ours[0].startswith(f"main.py: error: --ray-address {ray_cluster.address}: "), ours
    assert result.stderr.strip().endswith(ours[0])
    assert "RAY_AUTH_MODE=token" in ours[0] and "RAY_AUTH_TOKEN" in ours[0], ours
    assert not (tmp_path / "models").exists()


@pytest.mark.slow
def test_more_nodes_than_the_cluster_has_alive_is_one_line_and_exit_2(ray_cluster, tmp_path):
    result = run_cli(
        "main.py", *CLUSTER_FLAGS, "--ray-address", ray_cluster.address, "--nodes", "3",
        *folders(tmp_path), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("main.py:")]
    assert ours == [
        "main.py: error: --nodes 3 asks for more machines than the cluster has alive (2); "
        "pass --nodes 2 or fewer, or add nodes with 'ray start --address ...'"
    ], result.stderr[-3000:]
    assert not list(tmp_path.iterdir())  # no file, no folder


@pytest.mark.slow
def test_pong_on_two_nodes_exchanges_finishes_and_resumes(ray_cluster, tmp_path):
    flags = [*CLUSTER_FLAGS, "--ray-address", ray_cluster.address, *folders(tmp_path)]
    result = run_cli(
        "main.py", *flags, "--max-steps", "800", "--exchange-statistics", timeout=240
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cluster: 2 nodes x 1 worker, parameter" in result.stderr
    record = json.loads((tmp_path / "logs" / f"{PONG}_run.json").read_text())
    assert record["config"]["exchange_statistics"] is True
    cluster = record["cluster"]
    ids = [node["id"] for node in cluster["nodes"]]
    assert len(ids) == 2 and set(cluster["pushes_per_node"]) == set(ids)
    assert all(count >= 2 for count in cluster["pushes_per_node"].values())
    assert cluster["round_trip_ms"] > 0
    weights = flat_weights(load_pong_dat(tmp_path / "models" / f"{PONG}.dat")).size
    # Weights float32 both ways (4 + 4 bytes a weight), and but for the last exchange Adam's
    # two moments both ways (2 x (4 + 4)).
    pushes = sum(cluster["pushes_per_node"].values())
    assert cluster["bytes_exchanged"] == weights * (8 * pushes + 16 * (pushes - len(ids)))
    # After the last exchange every node holds exactly what the server sent it (both digests).
    assert all(cluster["finished"][i]["matches_server"] is True for i in ids)
    # The nodes ran the copy of the code Ray shipped to them, not this checkout.
    assert all(Path(cluster["finished"][i]["code"]) != ROOT.resolve() for i in ids)
    # A fresh run's nodes seed from --seed, each offset by its start.
    first_seeds = [cluster["finished"][i]["seeds"] for i in ids]
    assert sorted(s["seed"] for s in first_seeds) == [1, 2]  # --seed 1, one worker x one env
    assert all(s["resumed_steps"] == 0 for s in first_seeds)
    assert record["finished"]["steps"] >= 800 and record["finished"]["exit_code"] == 0

    evaluated = script_here(
        "gym_eval.py", "--env", PONG, "--num-episodes", "1", "--hidden-size", "32",
        "--max-episode-length", "60", "--load-model-dir", str(tmp_path / "models"),
        "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    summary = json.loads((tmp_path / "logs" / f"{PONG}_eval.json").read_text())
    assert summary["training"]["frames"] == record["finished"]["frames"]  # the cluster's record

    budget = record["finished"]["steps"] + 400  # past the first run's overshoot, whatever it was
    resumed = run_cli(
        "main.py", *flags, "--max-steps", str(budget), "--load", "--exchange-precision", "fp16",
        "--load-model-dir", str(tmp_path / "models"), timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {record['finished']['steps']:,}" in resumed.stderr  # resumed from its count
    assert "optimizer statistics start afresh on each node" in resumed.stderr
    assert "exchanges every 1 s (fp16)" in resumed.stderr
    again = json.loads((tmp_path / "logs" / f"{PONG}_run.json").read_text())
    assert again["finished"]["steps"] >= budget
    assert again["config"]["exchange_precision"] == "fp16"
    cluster = again["cluster"]
    assert all(count >= 2 for count in cluster["pushes_per_node"].values())
    # fp16 exchanges, and still the server's weights exactly after each node's last one.
    assert all(cluster["finished"][i]["matches_server"] is True for i in ids)
    # The resumed nodes' workers drew seeds of their own, from the steps resumed from.
    steps = record["finished"]["steps"]
    assert all(cluster["finished"][i]["seeds"]["resumed_steps"] == steps > 0 for i in ids)
    # Per node: the first answer is the float32 weights (2 + 4 bytes a weight), the middle
    # exchanges fp16 both ways (2 + 2), the last float32 both ways (4 + 4).
    pushes = sum(cluster["pushes_per_node"].values())
    assert cluster["bytes_exchanged"] == weights * (4 * pushes + 6 * len(ids))


def count_test_games(tmp_path: Path) -> int:
    log = tmp_path / "logs" / f"{PONG}_log"
    return log.read_text().count("episode reward") if log.exists() else 0


class ClusterRunProcess:
    """``main.py`` on the test cluster, with no step budget, its stderr in a file to read.

    A file, not a pipe: nobody reads a pipe while the run goes on, and a full one would
    block the driver.
    """

    def __init__(self, ray_cluster, tmp_path: Path):
        self.tmp_path = tmp_path
        self.stderr_path = tmp_path / "stderr.log"
        with self.stderr_path.open("w") as stderr_file:
            self.proc = subprocess.Popen(
                [sys.executable, "main.py", *CLUSTER_FLAGS, "--ray-address", ray_cluster.address,
                 "--status-interval", "5", *folders(tmp_path)],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr_file, text=True,
            )  # fmt: skip

    def wait_until_training(self, test_games: int) -> None:
        """Waits for both node launchers and their workers, then for this many test games."""
        wait_until(lambda: len(actor_processes()) >= 4, 120, "two node launchers and workers")
        wait_until(lambda: count_test_games(self.tmp_path) >= test_games, 120, "test games")

    def said(self, text: str) -> bool:
        return text in self.stderr_path.read_text()

    def steps_in_status_lines(self) -> list[int]:
        return [int(m.replace(",", "")) for m in re.findall(r"\| steps ([\d,]+) \|", self.stderr())]

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self, signum: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def cluster_record(self) -> dict:
        """The run record's ``cluster`` entry, once the run has exited 0."""
        assert self.proc.returncode == 0, self.stderr()[-3000:]
        return json.loads((self.tmp_path / "logs" / f"{PONG}_run.json").read_text())["cluster"]


def every_process_of(run: ClusterRunProcess) -> set[int]:
    """Every process of a cluster run on every node: the actors (the server's included) and
    their workers, and the driver's own children (its test process, at least)."""
    snapshot = live_processes()  # one snapshot: a worker may start between two
    running = set(actor_processes(EVERY_ACTOR, snapshot))
    assert running > set(actor_processes(table=snapshot))  # the server's process is found too
    on_the_head = descendants(run.proc.pid, snapshot)
    assert on_the_head
    return running | on_the_head


@pytest.mark.slow
def test_a_killed_node_launcher_is_named_and_restarted_and_the_run_goes_on(ray_cluster, tmp_path):
    run = ClusterRunProcess(ray_cluster, tmp_path)
    try:
        run.wait_until_training(test_games=3)
        table = actor_processes()
        launchers = sorted(pid for pid, parent in table.items() if parent not in table)
        victim = launchers[-1]
        victims_children = [pid for pid, parent in table.items() if parent == victim]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: run.said("the run goes on with 1 node\n"), 60, "the loss named")
        # Its machine is alive: a new launcher starts there once the restart wait is over.
        wait_until(lambda: run.said("restarted (start 2 of at most 3)"), 120, "the restart")
        wait_until(lambda: len(actor_processes()) >= 4, 120, "its launcher and worker")
        steps = run.steps_in_status_lines()[-1]
        wait_until(lambda: run.steps_in_status_lines()[-1] > steps, 120, "more steps")
        running = every_process_of(run)
    finally:
        run.stop()  # Ctrl-C (SIGINT); the lost-machine test below sends SIGTERM
    cluster = run.cluster_record()  # exit code 0
    assert "stopped: SIGINT received" in run.stderr()
    # How long the nodes took to stop is logged and recorded (reported, not asserted on).
    assert "nodes stopped and made their last exchange in" in run.stderr()
    assert cluster["stop_seconds"] > 0
    load_pong_dat(tmp_path / "models" / f"{PONG}.dat")
    assert all(result["matches_server"] is True for result in cluster["finished"].values())
    wait_until(lambda: not running & set(live_processes()), 30, "every process")
    (victim_node,) = cluster["lost"]
    assert cluster["starts"][victim_node] == 2 and len(cluster["nodes"]) == 2
    assert set(cluster["finished"]) == set(cluster["starts"])  # both ended with the run
    # The new launcher went on from the node's step count: the run's count never fell.
    counts = run.steps_in_status_lines()
    assert counts == sorted(counts) and counts[-1] > 0
    # The lost launcher's workers noticed it was gone and stopped by themselves (looked for
    # among every process: an orphan's new parent is no launcher).
    wait_until(lambda: not set(victims_children) & set(live_processes()), 30, "orphans to stop")


@pytest.mark.slow
def test_a_lost_machine_is_named_and_a_machine_that_joins_is_taken_on(ray_cluster, tmp_path):
    """And SIGTERM on the driver then stops the run as Ctrl-C does (the killed-launcher test
    above ends with one): every process on every node ends, the final weights are saved and
    the nodes match the server."""
    run = ClusterRunProcess(ray_cluster, tmp_path)
    try:
        run.wait_until_training(test_games=2)
        (machine,) = ray_cluster.worker_nodes
        ray_cluster.remove_node(machine, allow_graceful=False)  # the raylet and all on it die
        wait_until(lambda: run.said("the run goes on with 1 node\n"), 120, "the loss named")
        ray_cluster.add_node(**NODE)  # a machine joins (or the lost one comes back: a new id)
        wait_until(lambda: run.said(") joined; the run goes on"), 120, "the new node")
        wait_until(lambda: len(actor_processes()) >= 4, 120, "its launcher and worker")
        running = every_process_of(run)
    finally:
        run.stop(signal.SIGTERM)
        if not ray_cluster.worker_nodes:  # failed in between: the later tests need 2 nodes
            ray_cluster.add_node(**NODE)
            ray_cluster.wait_for_nodes()
    cluster = run.cluster_record()  # exit code 0
    assert "stopped: SIGTERM received" in run.stderr()
    assert "nodes stopped and made their last exchange in" in run.stderr()
    assert cluster["stop_seconds"] > 0
    load_pong_dat(tmp_path / "models" / f"{PONG}.dat")
    wait_until(lambda: not running & set(live_processes()), 30, "every process")
    assert len(cluster["nodes"]) == 3 and len(cluster["lost"]) == 1
    (lost,) = cluster["lost"]
    assert lost not in cluster["finished"] and len(cluster["finished"]) == 2
    # The new machine's launcher trained and made its last exchange; nobody failed.
    assert all(cluster["pushes_per_node"][node] >= 1 for node in cluster["finished"])
    assert not any(result["failed"] for result in cluster["finished"].values())
    assert all(result["matches_server"] is True for result in cluster["finished"].values())


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_nothing_running_on_any_node(ray_cluster, tmp_path):
    run = ClusterRunProcess(ray_cluster, tmp_path)
    try:
        wait_until(lambda: len(actor_processes()) >= 4, 120, "two node launchers and workers")
        wait_until(lambda: descendants(run.proc.pid), 60, "the driver's test process")
        running = set(actor_processes(EVERY_ACTOR)) | descendants(run.proc.pid)
    finally:
        run.proc.kill()
        run.proc.wait(timeout=30)
    # Ray ends the actors the dead driver owned (the server too); the workers see their
    # launcher gone, and so does the driver's own test process on the head.
    wait_until(lambda: not running & set(live_processes()), 60, "every process")
