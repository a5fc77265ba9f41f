"""Shared test helpers: the default configurations, config.json, CLI runs, process checks."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from checkpoint import release_run_locks
from cli import EvalConfig, TrainConfig, parse_eval_args, parse_train_args
from environment import read_config
from model import A3Clstm
from utils import cpu_has_bf16

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _run_locks_let_go():
    """A launcher prepared in the test's process holds its folders until the process ends
    (`checkpoint.hold_run_lock`): let go after each test, as a run's process would."""
    yield
    release_run_locks()


@pytest.fixture
def args() -> TrainConfig:
    """The training defaults, as `main.py` with no flags would use them."""
    return parse_train_args([])


@pytest.fixture(scope="session")
def config() -> dict:
    return read_config(ROOT / "config.json")


def make_args(**overrides) -> TrainConfig:
    """The training defaults with some fields replaced (lists become tuples, as parsed)."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return dataclasses.replace(parse_train_args([]), **values)


def make_eval_args(**overrides) -> EvalConfig:
    """The evaluation defaults with some fields replaced."""
    return dataclasses.replace(parse_eval_args([]), **overrides)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_CPU = cpu_has_bf16()
requires_bf16_cpu = pytest.mark.skipif(not BF16_CPU, reason="this CPU has no bfloat16 kernels")
requires_bf16_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)),
    reason="needs a GPU with native bfloat16 (compute capability 8.0+; T4 and V100 emulate it)",
)
# Parity tests compare fp32 paths: no TF32 anywhere on a GPU (what workers set too).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


# -- end-to-end runs of the CLI ------------------------------------------------------------------

PONG = "PongNoFrameskip-v4"
# Small and fast: short games so the test process finishes some, a small LSTM.
PONG_FLAGS = ["--env", PONG, "--hidden-size", "32", "--max-episode-length", "60"]


def run_cli(script: str, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def main_py_running(flags: list[str], stderr_file: Path) -> Iterator[subprocess.Popen]:
    """``python main.py *flags`` in a session of its own while the block runs, its stderr in
    `stderr_file` (read while it runs); its process group is killed if it outlives the block."""
    with stderr_file.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "main.py", *flags],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink, text=True, start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main_here(flags: list[str], monkeypatch, capsys, through_cli: bool = False) -> tuple[int, str]:
    """``main.main(flags)`` in this process (or ``python main.py``): exit code and stderr.

    The path ``python main.py`` takes up to its first refusal, without the 3 s a new process
    spends importing torch; tests of many bad inputs send one `through_cli` to show the two
    agree and the rest through this.
    """
    import main

    if through_cli:
        result = run_cli("main.py", *flags, timeout=120)
        return result.returncode, result.stderr
    monkeypatch.setattr(sys, "argv", ["main.py"])  # argparse's errors name sys.argv[0]
    # pytest's own handlers on the root logger would keep main's logging.basicConfig from
    # sending log lines (a warning before a refusal) to stderr, as `python main.py` does.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        code = main.main(flags)
    except SystemExit as stop:
        code = stop.code
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return code, capsys.readouterr().err


def script_here(script: str, *flags: str) -> subprocess.CompletedProcess:
    """``python <script> *flags`` (gym_eval.py, visualize.py) run in this process.

    What `run_cli` returns, 3 s sooner (no new interpreter importing torch): for refusals and
    short runs; the end-to-end tests keep `run_cli`. The torch thread count a script sets
    (``--threads``) is given back.
    """
    module = importlib.import_module(script.removesuffix(".py"))
    out, err = io.StringIO(), io.StringIO()
    argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [script]  # argparse's errors name sys.argv[0]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = module.main(list(flags))
            except SystemExit as stop:
                code = stop.code
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([script, *flags], code, out.getvalue(), err.getvalue())


def folders(tmp_path: Path) -> list[str]:
    return ["--save-model-dir", str(tmp_path / "models"), "--log-dir", str(tmp_path / "logs")]


def live_processes() -> dict[int, tuple[int, int, str]]:
    """Pid -> (parent pid, process group, command line) of every live (non-zombie) process."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), cmdline)
    return table


def group_alive(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`."""
    return [pid for pid, (_, group, _) in live_processes().items() if group == pgid]


def wait_group_gone(pgid: int, seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def load_pong_dat(path: Path, hidden: int = 32) -> A3Clstm:
    model = A3Clstm(1, gym.spaces.Discrete(6), hidden)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model
