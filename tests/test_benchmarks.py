"""The benchmarks' own checks: configurations main.py would refuse are refused before any run.

The timed figures themselves are never asserted (the machines are noisy); what is tested is
that a benchmark fails in one line, at once and with main.py's reason, instead of after the
configurations before the bad one have run for many minutes, or with a figure that hides why.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import gym_eval
import launcher
import utils
from checkpoint import file_sha256
from environment import MaxAndSkipEnv
from model import build_model
from tests.conftest import ROOT, live_processes

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_cluster_overhead  # noqa: E402
import bench_step  # noqa: E402
import bench_training  # noqa: E402
import points_lost  # noqa: E402
import pong_observation  # noqa: E402
import pong_returns  # noqa: E402
import time_to_score  # noqa: E402


def test_the_overhead_benchmark_counts_each_roles_cores_over_its_window():
    before = {1: ("workers", 10.0), 2: ("workers", 5.0), 3: ("raylets", 1.0), 4: ("other", 0.0)}
    after = {
        1: ("workers", 19.0), 2: ("workers", 14.0), 3: ("raylets", 1.5),
        5: ("workers", 3.0),  # started inside the window: its start-up is not the steady state
        4: ("test process", 2.0),  # a pid taken again by another process: left out
    }  # fmt: skip
    assert bench_cluster_overhead.cpu_by_role(before, after, 10.0) == {
        "workers": 1.8, "raylets": 0.05,
    }  # fmt: skip
    # On this machine: this process is there and its CPU only grows; a worker's title
    # (setproctitle's, here its command line) makes it a worker.
    first = bench_cluster_overhead.cpu_seconds()
    sum(range(10**6))
    second = bench_cluster_overhead.cpu_seconds()
    assert second[os.getpid()][1] >= first[os.getpid()][1]
    title = [sys.executable, "-c", "import time; time.sleep(30)", "Train Agent: 0"]
    with subprocess.Popen(title) as child:
        try:
            deadline = time.monotonic() + 10
            while bench_cluster_overhead.cpu_seconds().get(child.pid, ("",))[0] != "workers":
                assert time.monotonic() < deadline, "the child never showed as a worker"
                time.sleep(0.05)
        finally:
            child.kill()


def test_main_py_refusal_passes_flags_main_py_takes():
    assert bench_step.main_py_refusal(["--env", "PongNoFrameskip-v4"]) is None
    assert bench_step.main_py_refusal(bench_step.mode_flags("fast,k4")) is None


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--envs-per-worker", "0"], ["--envs-per-worker", "0"]),
        (["--envs-per-workr", "4"], ["unrecognized arguments: --envs-per-workr 4", "see main.py"]),
        (["--lr-schedule", "linear"], ["--lr-schedule linear", "--max-steps"]),
        (["--gpu-ids", "99"], ["--gpu-ids", "99"]),
    ],
)
def test_main_py_refusal_gives_main_py_s_one_line_reason(flags, words):
    refusal = bench_step.main_py_refusal(flags)
    assert refusal is not None and "\n" not in refusal
    for word in words:
        assert word in refusal


def test_main_py_refusal_refuses_bf16_where_the_cpu_lacks_it(monkeypatch):
    monkeypatch.setattr(utils, "cpu_has_bf16", lambda: False)
    refusal = bench_step.main_py_refusal(["--precision", "bf16"])
    assert refusal is not None and "use --precision fp32" in refusal
    monkeypatch.setattr(utils, "cpu_has_bf16", lambda: True)
    assert bench_step.main_py_refusal(["--precision", "bf16"]) is None


def test_bench_step_refuses_bf16_without_the_hardware_before_timing(monkeypatch, capsys):
    monkeypatch.setattr(utils, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(bench_step, "profile", lambda *a, **k: pytest.fail("timed a refused mode"))
    assert bench_step.main(["--modes", "fast", "fast,k8,bf16", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_step.py: error: mode fast,k8,bf16: --precision bf16 needs")
    assert "\n" not in err


def test_bench_step_checks_its_gpu_ids_as_main_py_would(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_step, "profile", lambda *a, **k: pytest.fail("timed a refused mode"))
    assert bench_step.main(["--gpu-ids", "0", "--modes", "fast,k16", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_step.py: error: mode fast,k16: --gpu-ids 0 asks for a GPU")
    assert "\n" not in err


def test_bench_step_times_the_worker_on_the_gpus_it_is_given(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_step, "main_py_refusal", lambda flags: None)
    monkeypatch.setattr(bench_step, "env_alone", lambda env: 1.0)

    def profile(env, mode, seconds, warmup, ops=0, gpu_ids=(-1,)):
        seen.append((mode, list(gpu_ids)))
        return dict.fromkeys((*bench_step.PHASES, "total"), 0.0)

    monkeypatch.setattr(bench_step, "profile", profile)
    assert bench_step.main(["--gpu-ids", "0", "--modes", "fast,k16", "--rounds", "1"]) == 0
    assert seen == [("fast,k16", [0])]


@pytest.mark.parametrize(
    ("modes", "words"),
    [
        (["fast", "fast,k0"], ["mode fast,k0", "--envs-per-worker must be at least 1, got 0"]),
        (["fast", "fast,x"], ["unknown part 'x'"]),
    ],
)
def test_bench_training_checks_every_mode_before_the_first_run(monkeypatch, capsys, modes, words):
    monkeypatch.setattr(bench_training, "run_once", lambda *a: pytest.fail("ran a mode"))
    assert bench_training.main(["--modes", *modes]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_training.py: error: ") and "\n" not in err
    for word in words:
        assert word in err


def test_bench_training_keeps_what_it_measured_when_a_later_run_fails(
    monkeypatch, capsys, tmp_path
):
    def run_once(command, *_):
        if "--envs-per-worker" in command:
            raise RuntimeError("main.py gave too few status lines after the warm-up")
        return {"frames_per_s": 900.0, "window_s": 60, "peak_rss_mib": {}, "peak_gpu_mib": {}}

    monkeypatch.setattr(bench_training, "run_once", run_once)
    out = tmp_path / "modes.json"
    assert bench_training.main(["--modes", "fast", "fast,k4", "--json", str(out)]) == 1
    assert "mode fast,k4: main.py gave too few status lines" in capsys.readouterr().err
    assert '"frames_per_s": 900.0' in out.read_text()


def test_frames_per_s_is_read_before_the_shutdown():
    """main.py's closing status line counts its shutdown, when no frames are made: the
    benchmarks read the lines before the one that starts the shutdown."""
    lines = [
        f"2026-11-28 07:00:{t:02d},000 : status 00h 00m {t:02d}s | steps 1 | frames {frames:,}"
        " | 1 frames/s\n"
        for t, frames in ((5, 500), (10, 1_000), (20, 2_000), (30, 3_000))
    ]
    assert bench_training.steady_frames_per_s("".join(lines), warmup=8) == (100.0, 20)
    stopping = f"2026-11-28 07:00:31,000 : {launcher.STOPPING}SIGINT received; the files ...\n"
    closing = "2026-11-28 07:00:38,000 : status 00h 00m 38s | steps 1 | frames 3,050 | 1\n"
    text = "".join([*lines, stopping, closing])
    assert bench_training.steady_frames_per_s(text, warmup=8) == (100.0, 20)
    rate, window = bench_training.steady_frames_per_s("".join([*lines, closing]), warmup=8)
    assert rate < 80 and window == 28  # what the closing line would do
    assert bench_training.steady_frames_per_s(lines[0], warmup=0) is None
    # The window is timed by the time stamps (to the millisecond), not the whole seconds.
    stamped = [line.replace("07:00:30,000", "07:00:30,500") for line in lines]
    assert bench_training.steady_frames_per_s("".join(stamped), warmup=8) == (2_000 / 20.5, 20.5)
    # A clock put back an hour (daylight saving) in the window: the elapsed seconds decide.
    back = [line.replace("07:00:30,000", "06:00:30,500") for line in lines]
    assert bench_training.steady_frames_per_s("".join(back), warmup=8) == (100.0, 20)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_bench_training_stopped_stops_main_py_and_keeps_what_it_measured(tmp_path, signum):
    """SIGTERM (as a CI job gets; Ctrl-C goes the same way) on the benchmark: the main.py it
    runs, in a process group of its own that a terminal's Ctrl-C does not reach, stops too;
    and so it does when the benchmark is killed outright (Linux's parent-death signal)."""
    out = tmp_path / "modes.json"
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/bench_training.py", "--env", "CartPole-v1", "--seconds",
         "300", "--warmup", "2", "--status-interval", "2", "--no-reference", "--json", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    launchers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _benchmarked_main_py(proc.pid):
            time.sleep(0.5)
        launchers = _benchmarked_main_py(proc.pid)
        assert launchers, "main.py did not start"
        while time.monotonic() < deadline and len(_groups_left(launchers)) < 3:
            time.sleep(0.5)  # main.py, its worker and its test process
        assert len(_groups_left(launchers)) >= 3
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
        if signum == signal.SIGTERM:
            assert proc.returncode == 130, stderr[-2000:]
            # Stopped in its first run: nothing measured yet, so no file is named.
            assert stderr.strip().endswith("bench_training.py: stopped") and not out.exists()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _groups_left(launchers):
            time.sleep(0.5)
        assert not _groups_left(launchers)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _groups_left(launchers):  # a failed test leaves no training behind
            os.kill(pid, signal.SIGKILL)


def _wait_for_a_test_game(parent: int, env: str) -> None:
    """Until the main.py a benchmark process runs has logged a test game played once its
    workers had counted steps (60 s at most): a run stopped before that saves no weights."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in _benchmarked_main_py(parent):
            words = live_processes().get(pid, (0, 0, ""))[2].split()
            if "--log-dir" in words:
                log = Path(words[words.index("--log-dir") + 1]) / f"{env}_log"
                if log.exists() and re.search(
                    r"episode reward .*total steps [1-9]", log.read_text()
                ):
                    return
        time.sleep(0.5)
    pytest.fail("main.py logged no test game within 60 s")


def _benchmarked_main_py(parent: int) -> list[int]:
    """The main.py a benchmark process runs (its own process group's leader)."""
    table = live_processes()
    return [pid for pid, (ppid, _, cmd) in table.items() if ppid == parent and "main.py" in cmd]


def _groups_left(leaders: list[int]) -> set[int]:
    """Live processes of these process groups: main.py, its workers and test process."""
    return {pid for pid, (_, group, _) in live_processes().items() if group in leaders}


def test_gpu_memory_reads_nvidia_smi_and_nothing_when_no_driver_answers(monkeypatch):
    def answers(returncode: int, stdout: str):
        return lambda *a, **k: subprocess.CompletedProcess([], returncode, stdout, "")

    monkeypatch.setattr(
        bench_training.subprocess, "run", answers(0, "123, 456\n77, 8.5\n5, [N/A]\n")
    )
    assert bench_training.gpu_memory_mib() == {123: 456.0, 77: 8.5, 5: 0.0}
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    monkeypatch.setattr(bench_training.subprocess, "run", answers(9, failed))
    assert bench_training.gpu_memory_mib() == {}


def test_an_overhead_benchmark_stopped_part_way_says_so_and_pairs_its_rounds(tmp_path, monkeypatch):
    class FakeCluster:
        address = "127.0.0.1:1"

        def shutdown(self):
            pass

    rates = iter([1000.0, 900.0, 1100.0])  # single, cluster, single, then Ctrl-C

    def timed_run(flags, seconds, warmup):
        rate = next(rates, None)
        if rate is None:
            raise KeyboardInterrupt
        return {"frames_per_s": rate, "window_s": 50.0, "cpu_by_role": {}}

    monkeypatch.setattr(
        bench_cluster_overhead, "start_one_machine_cluster", lambda n: FakeCluster()
    )
    monkeypatch.setattr(bench_cluster_overhead, "timed_run", timed_run)
    out = tmp_path / "overhead.json"
    assert bench_cluster_overhead.main(["--rounds", "2", "--json", str(out)]) == 130
    result = json.loads(out.read_text())
    assert (result["rounds"], result["complete"], result["paired_rounds"]) == (2, False, 1)
    assert result["cluster_over_single"] == 0.9  # the round with both runs, not 900 / 1050


def test_the_overhead_benchmark_refuses_bad_arguments_before_starting_ray(monkeypatch, capsys):
    monkeypatch.setattr(
        bench_cluster_overhead, "start_one_machine_cluster", lambda n: pytest.fail("started Ray")
    )
    for argv, words in (
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--seconds", "30", "--warmup", "25"], "--seconds 30 must exceed --warmup 25"),
        (["--flags=--envs-per-workr 8"], "the single run's flags: unrecognized arguments"),
        (["--cluster-flags=--no-such-flag"], "the cluster run's flags: unrecognized"),
        (["--flags=--lr 'x"], "No closing quotation"),
    ):
        with pytest.raises(SystemExit) as stop:
            bench_cluster_overhead.main(argv)
        assert stop.value.code == 2
        assert words in capsys.readouterr().err


def test_time_to_score_keeps_no_run_over_an_earlier_ones_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(time_to_score, "run_config", lambda *a: pytest.fail("ran a config"))
    (tmp_path / "max_steps_400_log").write_text("")
    argv = ["--keep-logs", str(tmp_path), "--seed", "2", "--config", "--max-steps 400"]
    assert time_to_score.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"time_to_score.py: error: --keep-logs {str(tmp_path)!r} holds an earlier run's "
        "max_steps_400_log; give each run (a seed, say) a folder of its own"
    )
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "default_PongNoFrameskip-v4_run.json").write_text("{}")
    assert time_to_score.main(["--keep-weights", str(tmp_path / "w")]) == 2
    assert "holds an earlier run's default_PongNoFrameskip-v4_run.json" in capsys.readouterr().err


def test_time_to_score_checks_every_config_before_the_first_run(monkeypatch, capsys):
    monkeypatch.setattr(time_to_score, "run_config", lambda *a: pytest.fail("ran a config"))
    argv = ["--config", "--envs-per-worker 4", "--config", "--envs-per-workr 8"]
    assert time_to_score.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "time_to_score.py: error: --config '--envs-per-workr 8': unrecognized arguments: "
        "--envs-per-workr 8; see main.py --help"
    )
    assert time_to_score.main(["--config", "--lr 'x"]) == 2
    assert "No closing quotation" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--json", "{dir}"], "--json {dir} is a folder; give a file name"),
        (["--json", "{dir}/no/r.json"], "cannot write in '{dir}/no'"),
        (["--keep-logs", "{file}/logs"], "'{file}' is not a folder this user can write"),
        (["--window", "0"], "--window must be at least 1, got 0"),
    ],
)
def test_time_to_score_checks_where_it_writes_before_the_first_run(
    tmp_path, monkeypatch, capsys, args, words
):
    monkeypatch.setattr(time_to_score, "run_config", lambda *a: pytest.fail("ran a config"))
    (tmp_path / "file").write_text("")
    names = {"dir": str(tmp_path), "file": str(tmp_path / "file")}
    with pytest.raises(SystemExit) as stop:
        time_to_score.main([arg.format(**names) for arg in args])
    assert stop.value.code == 2 and words.format(**names) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "args", "words"),
    [
        ("bench_exchange", ["--exchanges", "0"], "--exchanges must be at least 1, got 0"),
        ("bench_exchange", ["--hidden-size", "0"], "--hidden-size must be at least 1, got 0"),
        ("soak", ["--every", "-1"], "--every must be positive, got -1"),
        ("soak", ["--minutes", "0"], "--minutes must be positive, got 0"),
        ("bench_training", ["--status-interval", "0"], "--status-interval must be positive, got 0"),
        ("bench_training", ["--workers", "2", "0"], "--workers must be at least 1, got 0"),
        ("bench_step", ["--seconds", "nan"], "--seconds must be positive, got nan"),
    ],
)
def test_benchmarks_refuse_counts_and_times_that_cannot_work_before_they_start(
    monkeypatch, capsys, script, args, words
):
    """Before a Ray cluster, main.py or a timed loop starts (they failed late: a traceback, a
    sleep of -1 s, a busy loop, a whole run for nothing)."""
    import importlib

    module = importlib.import_module(script)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started main.py"))
    with pytest.raises(SystemExit) as stop:
        module.main(args)
    assert stop.value.code == 2 and words in capsys.readouterr().err


def test_time_to_score_names_each_run_apart():
    """Kept logs and weights are named after the flags; no two runs share a name."""
    labels = time_to_score.config_labels(["--lr=1e-4", "--lr 1e-4", "", "--lr=1e-4", "", "a_2"])
    assert labels == ["lr_1e_4", "lr_1e_4_2", "default", "lr_1e_4_3", "default_2", "a_2"]
    assert time_to_score.config_labels(["a", "a", "a_2"]) == ["a", "a_2", "a_2_2"]


def test_time_to_score_on_a_cluster_passes_its_address_and_refuses_bad_node_counts(capsys):
    flags = time_to_score.main_py_flags(["--lr", "0.001"], "PongNoFrameskip-v4", 1, 5, 1, "h:1")
    assert flags[flags.index("--ray-address") + 1] == "h:1" and flags[-2:] == ["--lr", "0.001"]
    assert "--ray-address" not in time_to_score.main_py_flags([], "PongNoFrameskip-v4", 2, 5, 1)
    with pytest.raises(SystemExit):
        time_to_score.main(["--ray-nodes", "-1"])
    assert "--ray-nodes must be 0 (no Ray) or a number of nodes, got -1" in capsys.readouterr().err


@pytest.mark.slow
def test_time_to_score_says_when_main_py_stopped_by_itself(tmp_path, capsys):
    """A run main.py ends on its own is reported with its exit code and last line, not as
    "did not reach": here a resume from a folder with nothing to resume from (exit 2)."""
    torch.manual_seed(0)
    argv = [
        "--env", "CartPole-v1", "--workers", "1", "--minutes", "1", "--json",
        str(tmp_path / "tts.json"), "--config",
        f"--load --load-model-dir {tmp_path}/nothing/ --max-steps 1000",
    ]  # fmt: skip
    assert time_to_score.main(argv) == 1
    line = capsys.readouterr().out.strip()
    assert "main.py stopped by itself with exit code 2 (main.py: error: " in line
    assert "\n" not in line


@pytest.mark.slow
def test_time_to_score_keeps_the_weights_of_a_run_it_was_asked_to(tmp_path):
    """--keep-weights copies the run's .dat and run record out of its deleted folder."""
    keep = tmp_path / "kept"
    argv = [
        "--env", "CartPole-v1", "--workers", "1", "--minutes", "2", "--keep-weights", str(keep),
        "--config", "--max-steps 400",
    ]  # fmt: skip
    assert time_to_score.main(argv) == 0
    weights = keep / "max_steps_400_CartPole-v1.dat"
    assert sorted(p.name for p in keep.iterdir()) == [
        "max_steps_400_CartPole-v1.dat", "max_steps_400_CartPole-v1_run.json",
    ]  # fmt: skip
    state = torch.load(weights, map_location="cpu", weights_only=True)
    assert state and all(torch.isfinite(t).all() for t in state.values())
    record = json.loads((keep / "max_steps_400_CartPole-v1_run.json").read_text())
    assert record["env"] == "CartPole-v1"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_time_to_score_stopped_keeps_the_run_so_far(tmp_path, signum):
    """Ctrl-C or SIGTERM on a long benchmark: main.py stops; its log, weights and row are
    kept. Started as a CI script starts a job in the background: with SIGINT ignored."""
    keep = tmp_path / "kept"
    out = tmp_path / "tts.json"
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/time_to_score.py", "--env", "CartPole-v1", "--workers", "1",
         "--minutes", "5", "--target", "1e9", "--test-niceness", "0", "--keep-logs", str(keep),
         "--keep-weights", str(keep), "--json", str(out), "--config", "--max-steps 100000000"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    launchers: list[int] = []
    try:
        _wait_for_a_test_game(proc.pid, "CartPole-v1")
        launchers = _benchmarked_main_py(proc.pid)
        proc.send_signal(signum)  # to the benchmark alone: main.py has a group of its own
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _groups_left(launchers):  # a failed test leaves no training behind
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-2000:]
    assert "time_to_score.py: stopped; the run so far is kept" in stderr
    assert "stopped after" in stdout
    (row,) = json.loads(out.read_text())
    assert row["interrupted"] is True and row["test_games"] > 0
    label = "max_steps_100000000"
    assert "episode reward" in (keep / f"{label}_log").read_text()
    assert (keep / f"{label}_CartPole-v1.dat").stat().st_size > 0
    run_folder = row["command"].split("--log-dir ")[1].split()[0]
    assert not any(run_folder in cmd for _, _, cmd in live_processes().values())


def test_bench_conv_layers_times_every_layer_and_the_floor(tmp_path, capsys):
    import bench_conv_layers

    out = tmp_path / "layers.json"
    assert bench_conv_layers.main(["--batch", "2", "--repeats", "1", "--json", str(out)]) == 0
    assert "per agent step" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [round(row["mflop_per_frame"], 1) for row in result["layers"]] == [10.2, 73.9, 21.2, 6.0]
    assert "input grad ms" not in result["layers"][0]  # the frames need no gradient
    assert result["floor_ms_per_step"] > 0 and result["ms_per_step"] > 0  # no timing compared


def test_bench_conv_layers_refuses_bf16_without_the_hardware(monkeypatch, capsys):
    import bench_conv_layers

    monkeypatch.setattr(utils, "cpu_has_bf16", lambda: False)
    assert bench_conv_layers.main(["--precision", "bf16"]) == 2
    assert "use --precision fp32" in capsys.readouterr().err


def test_time_to_score_reports_every_target_of_any_game(tmp_path):
    rewards = [0, 10, 60, 60, 120, 130, 250]
    lines = [" : workers: 2"] + [
        f"Time 00h {i:02d}m 00s, episode reward {r}.0, episode length 900, reward mean 0.0, "
        f"total steps {1000 * i}, total frames {4000 * i}, frames/s 70"
        for i, r in enumerate(rewards, start=1)
    ]
    log = tmp_path / "BreakoutNoFrameskip-v4_log"
    log.write_text("\n".join(f"2026-11-23 10:00:00,000{line}" for line in lines) + "\n")
    result = time_to_score.summarise(log, [100, 50, 400], window=2)
    assert result["milestones"] == {
        "50": {"seconds": 240.0, "frames": 16000, "test_game": 4},
        "100": {"seconds": 360.0, "frames": 24000, "test_game": 6},
        "400": None,
    }
    assert not result["reached"] and result["best_window_mean"] == 190.0
    row = {**result, "flags": "", "frames_per_s": 70.0, "wall_seconds": 420}
    line = time_to_score.describe(row, [50, 100, 400], 2)
    assert "did not reach 400 in 7.0 min (best" in line
    # how far it trained: the closing status line's count, past the last test game's
    stderr = (
        "2026-11-23 10:07:00,000 : status 00h 07m 00s | steps 7,100 | frames 28,400 | 70\n"
        "2026-11-23 10:07:01,000 : stopping: SIGINT received\n"
        "2026-11-23 10:07:03,500 : status 00h 07m 03s | steps 7,250 | frames 29,000 | 70\n"
    )
    row["frames_at_end"] = bench_training.frames_at_end(stderr)
    line = time_to_score.describe(row, [50, 100, 400], 2)
    assert "did not reach 400 in 7.0 min, 29,000 frames (best 2-game mean 190.00)" in line
    assert "(reached 50 after 4.0 min, 16,000 frames; 100 after 6.0 min, 24,000 frames)" in line


def test_pong_observation_shows_the_last_raw_frame_and_refuses_ids_without_a_max(capsys):
    class Frames(gym.Env):
        """Raw frame i is all i, so the max over a window and its last frame differ."""

        observation_space = gym.spaces.Box(0, 255, (2, 2), np.uint8)
        action_space = gym.spaces.Discrete(2)

        def __init__(self):
            self.i = 0

        def step(self, action):
            self.i += 1
            frame = np.full((2, 2), 10 * self.i if self.i % 2 else 0, np.uint8)
            return frame, 1.0, False, False, {}

    env = MaxAndSkipEnv(Frames(), skip=4)
    assert env.step(0)[0].max() == 30  # the max over raw frames 2-4: frame 3 (frame 4 is dark)
    obs, reward, *_ = pong_observation._last_frame_step(env, 0)
    assert obs.max() == 0 and reward == 4.0  # raw frame 8, dark; every frame's reward summed
    assert pong_observation.main(["--env", "ALE/Pong-v5"]) == 2
    assert "ALE/Pong-v5 has no max over a skip window" in capsys.readouterr().err
    # Spawned game processes would play max-pooled (the patch is this process's); bad flags
    # are one line.
    assert pong_observation.main(["--processes", "2"]) == 2
    assert pong_observation.main(["--env", "Foo-v9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--processes 2: pong_observation.py plays in one process" in err[0]
    assert "unknown env id 'Foo-v9'" in err[1] and len(err) == 2


def test_points_lost_counts_the_steps_from_the_previous_point():
    assert points_lost.rallies([0, 0, 1, 0, -1, -1, 0]) == [(1, 3), (-1, 2), (-1, 1)]
    assert points_lost.rallies([0, 0]) == []


def test_points_lost_plays_real_games_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    env = gym.make("CartPole-v1")
    model = build_model(env.observation_space, env.action_space, 16)
    torch.save(model.state_dict(), tmp_path / "cart.dat")
    out = tmp_path / "rallies.json"
    flags = ["--env", "CartPole-v1", "--hidden-size", "16", "--num-episodes", "2"]
    assert points_lost.main([*flags, "--model", str(tmp_path / "cart.dat"), "--out", str(out)]) == 0
    games = json.loads(out.read_text())["games"]
    assert len(games) == 2 and all(steps == 1 for g in games for _, steps in g)  # +1 a step
    assert "2 games, mean" in capsys.readouterr().out
    assert points_lost.main([*flags, "--model", str(tmp_path / "missing.dat")]) == 2
    assert points_lost.main([*flags, "--repeat-action-probability", "2"]) == 2
    assert points_lost.main([*flags, "--processes", "2"]) == 2
    assert points_lost.main([*flags, "--demo"]) == 2
    assert points_lost.main([*flags, "--out", str(tmp_path / "no" / "such.json")]) == 2
    assert points_lost.main([*flags, "--out", str(tmp_path)]) == 2  # before the games, not after
    err = capsys.readouterr().err.strip().splitlines()
    # --repeat-action-probability 2 on CartPole: two problems, a line each.
    assert len(err) == 7 and "missing.dat" in err[0] and "must be in [0, 1]" in err[1]
    assert "applies to ALE games only" in err[2]
    assert "--processes 2" in err[3] and "drop --demo" in err[4] and "such.json" in err[5]
    assert "is a folder; give a file name" in err[6]
    assert all(line.startswith("points_lost.py: error: ") for line in err)


def _frame(
    ball_x: int,
    ball_y: int = 100,
    paddle_y: int = 90,
    reward: float = 0.0,
    chosen: int = 0,
    played: int = 0,
) -> pong_returns.Frame:
    return pong_returns.Frame(chosen, played, reward, paddle_y, ball_x, ball_y)


def test_pong_returns_finds_returns_and_misses_and_marks_the_serve():
    point_won = [_frame(150), _frame(205, reward=1.0)]  # the agent's return beat the opponent
    returned = [_frame(180), _frame(186, ball_y=95), _frame(182)]  # turns back at 186
    stuck = [_frame(100, chosen=2, played=0)] * 3  # three frames where stickiness changed it
    missed = [_frame(185, ball_y=70), _frame(188, ball_y=72), _frame(195), _frame(205, reward=-1.0)]
    frames = point_won + returned + stuck + missed
    frames = [dataclasses.replace(f, paddle_y=100 + i) for i, f in enumerate(frames)]
    found = pong_returns.contacts(frames)
    assert [(c.returned, c.serve, c.offset) for c in found] == [
        (True, True, 95 - 103),  # the first ball after a point won: the serve
        (False, False, 72 - 109),  # measured at the last frame before the paddle's column
    ]
    assert found[0].stuck == 0 and found[1].stuck == 3 and found[1].frame == 9
    assert found[1].paddle_path == (100, 100, 101, 105, 109)  # 32, 16, 8, 4, 0 frames before
    lost_first = pong_returns.contacts([_frame(188, ball_y=50), _frame(205, reward=-1.0)])
    assert [(c.returned, c.serve) for c in lost_first] == [(False, False)]


def test_pong_returns_notes_the_policy_before_each_contact():
    sure_down = (0.0, 0.0, 0.0, 0.5, 0.0, 0.5)  # LEFT and LEFTFIRE move the paddle down
    even = (1 / 6,) * 6
    frames = [_frame(100)] * 70 + [_frame(180), _frame(186), _frame(182)]  # turns back at 186
    frames = [dataclasses.replace(f, policy=even) for f in frames]
    frames[71] = dataclasses.replace(frames[71], policy=sure_down)  # 0 frames before contact
    (contact,) = pong_returns.contacts(frames)
    assert contact.frame == 71 and contact.policy_path == (even,) * 5 + (sure_down,)
    line = pong_returns.policy_means([contact])
    assert line.split("; ")[0] == "H 1.79 up 0.33 down 0.33"
    assert line.split("; ")[-1] == "H 0.69 up 0.00 down 1.00"
    assert pong_returns.policy_means([dataclasses.replace(contact, policy_path=())]) == ""
    unnoted = dataclasses.replace(contact, policy_path=((),) * 6)  # in a game's no-op start
    assert pong_returns.policy_means([contact, unnoted]) == f"{line} (1 of 2)"


def test_pong_returns_plays_the_argmax_or_a_draw_from_the_softmax():
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0, 0.0]]))
    output = (torch.zeros(1, 1), logits, torch.zeros(1, 4), torch.zeros(1, 4))
    greedy = pong_returns.PolicyRecorder(sample=False, seed=1)
    assert greedy.seen(None, (), output) is None  # the greedy player's output unchanged
    assert greedy.latest == pytest.approx((0.1, 0.0, 0.6, 0.3, 0.0, 0.0))
    sampled = pong_returns.PolicyRecorder(sample=True, seed=1)
    played = [int(sampled.seen(None, (), output)[1].argmax(1)) for _ in range(3000)]
    counts = collections.Counter(played)
    assert set(counts) == {0, 2, 3}  # never an action of probability 0
    assert 0.55 < counts[2] / 3000 < 0.65 and 0.25 < counts[3] / 3000 < 0.35


def test_pong_returns_does_stickiness_as_ale_does():
    class Atari(gym.Env):
        def __init__(self):
            self.ale = self
            self.played = []

        def getRAM(self):  # noqa: N802 (ALE's name)
            return np.zeros(128, dtype=np.uint8)

        def step(self, action):
            self.played.append(action)
            return None, 0.0, False, False, {}

        def reset(self, **kwargs):
            return None, {}

    atari = Atari()
    recorder = pong_returns.StickyRecorder(0.25, seed=3)
    recorder.attach(atari)
    for _ in range(4000):
        atari.step(2 if len(atari.played) % 2 else 3)  # a new action every frame
    changed = sum(f.chosen != f.played for f in recorder.frames)
    assert 800 < changed < 1200  # about a quarter of the frames play the previous action
    assert all(f.played == p for f, p in zip(recorder.frames, atari.played, strict=True))
    atari.reset()
    recorder.rng = np.random.default_rng(0)
    recorder.probability = 1.0
    atari.step(3)
    assert atari.played[-1] == 0  # after a reset the previous action is NOOP


@pytest.mark.slow
def test_pong_returns_plays_real_pong_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    model = build_model(gym.spaces.Box(0, 1, (1, 80, 80)), gym.spaces.Discrete(6), 32)
    torch.save(model.state_dict(), tmp_path / "pong.dat")
    out = tmp_path / "contacts.json"
    flags = ["--env", "PongNoFrameskip-v4", "--hidden-size", "32", "--num-episodes", "1"]
    flags += ["--max-episode-length", "400", "--repeat-action-probability", "0.25"]
    assert (
        pong_returns.main([*flags, "--model", str(tmp_path / "pong.dat"), "--out", str(out)]) == 0
    )
    written = json.loads(out.read_text())
    assert written["sticky"] == 0.25 and len(written["games"]) == 1
    assert written["actions"] == "greedy" and written["seed"] == 1
    assert written["model_sha256"] == file_sha256(tmp_path / "pong.dat")
    assert len(written["rewards"]) == 1
    assert any(not c["returned"] for c in written["games"][0])  # an untrained agent misses
    assert all(sum(c["policy_path"][-1]) == pytest.approx(1, abs=1e-3) for c in written["games"][0])
    printed = capsys.readouterr().out
    assert "1 games, sticky actions 0.25 (done here, not by ALE), greedy actions" in printed
    assert "  policy (64, 32, 16, 8, 4, 0) frames before, mean: H " in printed
    model_flag = ["--model", str(tmp_path / "pong.dat")]
    assert pong_returns.main([*flags, *model_flag, "--sample-actions", "--out", str(out)]) == 0
    sampled = json.loads(out.read_text())
    assert sampled["actions"] == "sampled" and "greedy" not in capsys.readouterr().out
    # The same seeds, another player: this untrained network's policy is near uniform, so
    # the drawn actions, and with them the balls, are not the argmax's.
    assert sampled["games"] != written["games"]
    assert pong_returns.main([*flags, "--model", str(tmp_path / "missing.dat")]) == 2
    assert pong_returns.main([*flags[2:], "--env", "ALE/Pong-v5"]) == 2
    assert pong_returns.main([*flags[2:], "--env", "BreakoutNoFrameskip-v4"]) == 2
    assert pong_returns.main([*flags, "--processes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "missing.dat" in err[0] and "ALE/Pong-v5" in err[1]
    assert "use PongNoFrameskip-v4" in err[2] and "pong_returns.py plays in one process" in err[3]
    assert all(line.startswith("pong_returns.py: error: ") for line in err)


def test_points_lost_plays_gym_evals_games(tmp_path, capsys):
    """The same seeds, wrappers and player: the same scores as gym_eval.py in one process."""
    env = gym.make("CartPole-v1")
    model = build_model(env.observation_space, env.action_space, 16)
    torch.save(model.state_dict(), tmp_path / "cart.dat")
    flags = ["--env", "CartPole-v1", "--hidden-size", "16", "--num-episodes", "3", "--seed", "7"]
    flags += ["--model", str(tmp_path / "cart.dat"), "--max-episode-length", "60"]
    assert points_lost.main([*flags, "--out", str(tmp_path / "r.json")]) == 0
    ours = [sum(r for r, _ in g) for g in json.loads((tmp_path / "r.json").read_text())["games"]]
    assert gym_eval.main([*flags, "--log-dir", str(tmp_path / "eval")]) == 0
    summary = json.loads((tmp_path / "eval" / "CartPole-v1_eval.json").read_text())
    assert ours == summary["rewards"]


def test_a_benchmark_stopped_with_ctrl_c_says_so_in_one_line(capsys):
    def interrupted() -> int:
        raise KeyboardInterrupt

    assert bench_training.run_script("bench_step.py", interrupted) == 130
    assert capsys.readouterr().err == "bench_step.py: stopped\n"
    assert bench_training.run_script("bench_step.py", lambda: 0) == 0


@pytest.mark.slow
def test_the_gpu_check_runs_every_step_on_a_cpu_in_its_dry_run(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] is True
    assert set(results["steps"]) == {"machine", "pytest_gpu", "time_to_score"}
    assert all(step["exit_code"] == 0 for step in results["steps"].values())
    assert results["machine"]["torch"] == torch.__version__ and results["machine"]["cores"]
    assert "skipped" in results["pytest_gpu"] and "failed" not in results["pytest_gpu"]
    score = results["time_to_score"]
    # main.py trained (a loaded machine may not count a frame in the dry run's 30 s)
    assert set(score["to_mean"]) == {"0", "10", "18"} and score["frames_at_end"] is not None
    assert "--envs-per-worker 16 --amsgrad --lr 0.0001" in score["command"]
    assert "--gpu-ids" not in score["command"]  # a CPU's dry run
    assert list((out / "logs").glob("*_log")) and (out / "machine.txt").exists()
