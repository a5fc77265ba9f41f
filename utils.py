"""Helpers shared by every process: configuration, logging, weight init, gradient hand-off."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import pickle
import queue
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import torch
from torch import nn

CONFIG_KEYS = ("crop1", "crop2", "dimension2")
"""Fields every `config.json` entry must hold (rows crop1:crop2+160 are kept)."""


class UsageError(ValueError):
    """Bad user input: the CLI prints the message as one line and exits with code 2."""


class FatalRunError(RuntimeError):
    """A child's error that restarting the child cannot fix; the launcher stops the run."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit with code 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>; see <prog> --help`` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


FATAL_EXIT = 3
"""Exit code of a child that failed with `FatalRunError` or `UsageError` (not restarted)."""


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------


def read_config(path: str | Path) -> dict[str, dict[str, int]]:
    """Read and validate the per-game crop settings.

    Args:
        path: the JSON file (`config.json` by default on the command line).

    Returns:
        A mapping from a game-name fragment (e.g. ``"Pong"``) to its
        ``{"crop1", "crop2", "dimension2"}`` settings. It always has a ``"Default"`` entry.

    Raises:
        UsageError: the file is missing, is not JSON, or an entry is malformed.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(
            f"env config {str(path)!r} not found; pass --env-config with the path of config.json"
        ) from None
    except OSError as err:
        raise UsageError(f"env config {str(path)!r} cannot be read: {err.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(
            f"env config {str(path)!r} is not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg}); fix the file or restore config.json from the repository"
        ) from None
    if not isinstance(config, dict):
        raise UsageError(
            f"env config {str(path)!r} must hold a JSON object of game entries, "
            f"got {type(config).__name__}"
        )
    if "Default" not in config:
        raise UsageError(
            f'env config {str(path)!r} has no "Default" entry; add '
            '"Default": {"crop1": 34, "crop2": 34, "dimension2": 80}'
        )
    for name, entry in config.items():
        if not isinstance(entry, dict):
            raise UsageError(
                f"env config {str(path)!r}: entry {name!r} must be an object with "
                f"{', '.join(CONFIG_KEYS)}, got {entry!r}"
            )
        for key in CONFIG_KEYS:
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(
                    f"env config {str(path)!r}: entry {name!r} needs an integer {key!r}, "
                    f"got {value!r}"
                )
        # Rows past the 210-row screen are clipped (the original's VideoPinball entry ends at
        # row 220), so only an empty or negative crop is an error.
        if not 0 <= entry["crop1"] < min(entry["crop2"] + 160, 210):
            raise UsageError(
                f"env config {str(path)!r}: entry {name!r} keeps rows "
                f"{entry['crop1']}:{entry['crop2'] + 160} of the 210-row screen, which is empty; "
                "use 0 <= crop1 < min(crop2 + 160, 210)"
            )
    return config


def env_config(config: dict[str, dict[str, int]], env_id: str) -> dict[str, int]:
    """Pick the entry of `config` for `env_id`.

    As in the original, an entry applies when its key is a substring of the id, and the last
    such key in file order wins; with no match the ``"Default"`` entry is used.
    """
    chosen = config["Default"]
    for key, entry in config.items():
        if key != "Default" and key in env_id:
            chosen = entry
    return chosen


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------


def setup_logger(name: str, log_file: str | Path, level: int = logging.INFO) -> logging.Logger:
    """Return a logger writing ``%(asctime)s : %(message)s`` to `log_file` and the terminal.

    Calling it twice with the same name does not duplicate lines: old handlers are replaced.
    """
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter("%(asctime)s : %(message)s")
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_file, mode="a")
    file_handler.setFormatter(formatter)
    stream_handler = logging.StreamHandler()
    stream_handler.setFormatter(formatter)
    logger.setLevel(level)
    logger.addHandler(file_handler)
    logger.addHandler(stream_handler)
    logger.propagate = False
    return logger


# ----------------------------------------------------------------------------------------------
# Weight initialisation
# ----------------------------------------------------------------------------------------------


def norm_col_init(weights: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """Draw a normal matrix shaped like `weights` and rescale each output row to norm `std`.

    Used for the actor (0.01: a near-uniform first policy) and critic (1.0) heads.
    """
    x = torch.randn(weights.size())
    x *= std / torch.sqrt((x**2).sum(1, keepdim=True))
    return x


def init_lstm(lstm: nn.LSTMCell) -> None:
    """Xavier-uniform input weights, orthogonal recurrent weights, forget-gate bias 1.

    A forget bias of 1 keeps the cell state flowing at the start of training, before the
    gate has learnt anything.
    """
    hidden = lstm.hidden_size
    with torch.no_grad():
        nn.init.xavier_uniform_(lstm.weight_ih)
        nn.init.orthogonal_(lstm.weight_hh)
        lstm.bias_ih.zero_()
        lstm.bias_hh.zero_()
        lstm.bias_ih[hidden : 2 * hidden] = 1.0


# ----------------------------------------------------------------------------------------------
# Gradient hand-off
# ----------------------------------------------------------------------------------------------


def ensure_shared_grads(model: nn.Module, shared_model: nn.Module, gpu: bool = False) -> None:
    """Give the shared model this worker's current gradients, on every call.

    Why it exists: the optimizer steps the shared (CPU, shared-memory) parameters, but
    backward ran on the worker's own copy. The original handed a gradient over only while the
    shared parameter had none, relying on PyTorch 1.x zeroing that same tensor in place. On
    PyTorch 2.x ``zero_grad()`` sets gradients to None and backward allocates a new tensor, so
    the shared parameter kept pointing at the first gradient forever and every later update
    re-applied it: CPU training could not learn.

    On CPU the shared parameter simply references the worker's new gradient tensor (no copy;
    ``.grad`` is per process, so workers never see each other's). From a GPU each gradient
    leaves with one non-blocking copy into a pinned CPU buffer kept on the shared parameter
    and reused across updates; the copies are queued back to back and the stream is
    synchronised once, before returning, so the optimizer never reads a buffer in flight.

    Args:
        model: the worker's model, after ``backward()``.
        shared_model: the shared CPU model the optimizer steps.
        gpu: the worker's model lives on a CUDA device.
    """
    for param, shared_param in zip(model.parameters(), shared_model.parameters(), strict=True):
        grad = param.grad
        if grad is None:
            shared_param.grad = None
        elif not gpu:
            shared_param.grad = grad
        else:
            buffer = shared_param.grad
            if buffer is None or buffer.shape != grad.shape or not buffer.is_pinned():
                buffer = torch.empty(shared_param.shape, dtype=grad.dtype, pin_memory=True)
                shared_param.grad = buffer
            buffer.copy_(grad, non_blocking=True)
    if gpu:
        torch.cuda.current_stream(next(model.parameters()).device).synchronize()


def format_elapsed(seconds: float) -> str:
    """``00h 02m 13s`` (hours keep counting past a day)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}h {minutes:02d}m {secs:02d}s"


def require_at_least(flag: str, value: int, minimum: int = 1) -> None:
    """Raise UsageError ``"<flag> must be at least <minimum>, got <value>"`` when too small."""
    if value < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {value}")


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def env_file_stem(env_id: str) -> str:
    """A file-name-safe form of an env id (``ALE/Pong-v5`` -> ``ALE_Pong-v5``)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", env_id).lstrip(".")
    if not stem:
        raise UsageError(f"env id {env_id!r} gives no usable file name; use a registered id")
    return stem


def checkpoint_path(folder: str | Path, env_id: str, suffix: str = ".dat") -> Path:
    """``<folder>/<env>.dat`` with the env id made safe for a file name."""
    return Path(folder) / f"{env_file_stem(env_id)}{suffix}"


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write a file through a temporary file and a rename.

    A reader (or a crash) never sees a half-written file: the old file stays until the new
    one is complete on disk, and a failed write leaves no temporary file behind.

    Args:
        path: the file to (re)place.
        write: writes the whole content to the binary file object it is given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` `obj` to `path` with `write_atomic`.

    Serialises in memory first, so a failing disk raises the plain OSError (``No space left
    on device``, ``File too large``) rather than torch's zip-writer error.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, lambda f: f.write(buffer.getbuffer()))


def _torch_load(path: Path, what: str) -> Any:
    """``torch.load`` with ``weights_only=True``, its failures turned into UsageErrors."""
    try:
        with warnings.catch_warnings():  # our one-line error says it all
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(
            f"{what} {str(path)!r} holds pickled objects, not just tensors; refusing to "
            "load it (it could run code): use a file A3G wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise UsageError(
            f"{what} {str(path)!r} is truncated or not a PyTorch file ({err}); use an intact file"
        ) from None


def check_state_dict(model: nn.Module, state: Any, path: str | Path) -> dict[str, torch.Tensor]:
    """Make sure `state` is a state_dict that fits `model`; return it.

    Raises:
        UsageError: not a state_dict of tensors, or saved for another game (action count),
            another ``--hidden-size`` or another network.
    """
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UsageError(f"checkpoint {str(path)!r} is not a state_dict of tensors")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {str(path)!r} is for another network: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    saved_hidden, own_hidden = state["lstm.weight_hh"].shape[1], own["lstm.weight_hh"].shape[1]
    if saved_hidden != own_hidden:
        raise UsageError(
            f"checkpoint {str(path)!r} was saved with --hidden-size {saved_hidden}; this run "
            f"uses {own_hidden}: pass --hidden-size {saved_hidden}"
        )
    saved_actions, own_actions = (
        state["actor_linear.bias"].shape[0],
        own["actor_linear.bias"].shape[0],
    )
    if saved_actions != own_actions:
        raise UsageError(
            f"checkpoint {str(path)!r} was saved for a game with {saved_actions} actions; this "
            f"env has {own_actions}: load the .dat of the same game"
        )
    for key, value in state.items():
        if value.shape != own[key].shape:
            raise UsageError(
                f"checkpoint {str(path)!r}: {key} has shape {tuple(value.shape)}, the model "
                f"expects {tuple(own[key].shape)}: it was saved for another env or network"
            )
    return state


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a ``.dat`` state_dict (ours or the original A3G's) into `model`.

    Uses ``weights_only=True``, so a file holding pickled objects cannot run code.

    Raises:
        UsageError: the file is missing, unreadable, not a state_dict, or saved for another
            game (action count) or another ``--hidden-size``.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f"checkpoint {str(path)!r} not found; train first, or point --load-model-dir at "
            f"the folder holding {path.name}"
        )
    model.load_state_dict(check_state_dict(model, _torch_load(path, "checkpoint"), path))


STATE_FORMAT = 1
"""Version of the training-state file layout."""


def load_training_state(path: str | Path) -> dict[str, Any]:
    """Read a training-state file written by the launcher (``weights_only=True``).

    Raises:
        UsageError: unreadable, truncated, pickled objects, or not a training state.
    """
    path = Path(path)
    state = _torch_load(path, "training state")
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise UsageError(
            f"training state {str(path)!r} is not an A3G training-state file (format "
            f"{STATE_FORMAT}); delete it to load the weights alone"
        )
    return state


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------


@dataclass
class ProcessContext:
    """What the launcher shares with every child: stop signal, counters, report channels.

    Attributes:
        stop_event: set by the launcher when the run must end.
        steps: total agent steps of all workers (a shared ``multiprocessing.Value``); a
            resumed run starts it from the saved count.
        skipped: updates skipped for a NaN or inf loss or gradient, all workers together.
        errors: children put ``(title, one-line cause, traceback)`` here before dying.
        reports: children put ``(kind, payload)`` summaries here for the launcher's monitor:
            ``("train", dict)`` from workers every few seconds, ``("test", dict)`` per game.
        max_steps: stop once `steps` reaches it (0 = no limit).
        start_time: when the run started (``time.time()``), earlier by the saved training
            time in a resumed run, for elapsed time and frames/s.
        parent_pid: the launcher's pid; a child whose parent changes was orphaned (the
            launcher was killed) and stops by itself.
    """

    stop_event: Any
    steps: Any
    skipped: Any
    errors: Any
    reports: Any
    max_steps: int = 0
    start_time: float = 0.0
    parent_pid: int = 0

    @classmethod
    def create(
        cls,
        mp_context: Any,
        max_steps: int = 0,
        steps: int = 0,
        elapsed: float = 0.0,
        skipped: int = 0,
    ) -> ProcessContext:
        """Make the shared objects from a multiprocessing context; the clock starts now.

        Args:
            mp_context: the multiprocessing context the children are started with.
            max_steps: the step budget (0 = none).
            steps: steps already taken (a resumed run).
            elapsed: seconds already trained (a resumed run).
            skipped: non-finite updates already skipped (a resumed run).
        """
        return cls(
            mp_context.Event(),
            mp_context.Value("q", steps),
            mp_context.Value("q", skipped),
            mp_context.Queue(),
            mp_context.Queue(),
            max_steps,
            time.time() - elapsed,
            os.getpid(),
        )

    def report(self, kind: str, payload: dict[str, Any]) -> None:
        """Send a summary to the launcher (never blocks: the queue is unbounded)."""
        self.reports.put((kind, payload))

    def total_steps(self) -> int:
        """Agent steps taken by all workers so far."""
        return int(self.steps.value)

    def add_steps(self, n: int) -> None:
        """Count `n` more agent steps (once per rollout, so the lock is cheap)."""
        with self.steps.get_lock():
            self.steps.value += n

    def count_skipped(self) -> None:
        """Count one update skipped for a non-finite loss or gradient."""
        with self.skipped.get_lock():
            self.skipped.value += 1

    def total_skipped(self) -> int:
        """Updates skipped by all workers so far."""
        return int(self.skipped.value)

    def budget_reached(self) -> bool:
        """``--max-steps`` is set and reached."""
        return self.max_steps > 0 and self.total_steps() >= self.max_steps

    def orphaned(self) -> bool:
        """The launcher is gone (killed without its shutdown): this child must end too."""
        return os.getpid() != self.parent_pid and os.getppid() != self.parent_pid

    def stopping(self) -> bool:
        """The launcher asked to stop, or it is gone."""
        return self.stop_event.is_set() or self.orphaned()

    def should_stop(self) -> bool:
        """`stopping`, or the step budget is spent (what a worker checks)."""
        return self.stopping() or self.budget_reached()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking early to stop; True if the child must stop."""
        deadline = time.monotonic() + seconds
        while not self.stopping():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.stop_event.wait(min(left, 1.0))
        return True


@contextlib.contextmanager
def child_process(title: str, ctx: ProcessContext) -> Iterator[None]:
    """Set up a spawned child and turn its failure into a report for the launcher.

    One thread per process (with several processes per core, more threads only fight),
    SIGINT ignored (the launcher drives shutdown, so Ctrl-C prints no tracebacks from
    children), the process title set. An exception is sent to the launcher as one line plus
    its traceback, and the process exits with code 1 (the launcher restarts it), or
    `FATAL_EXIT` for a `FatalRunError` or `UsageError` (the launcher stops the run).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # a nicety only: titles show in ps/top
        pass
    try:
        yield
    except Exception as err:  # reported, then the process exits non-zero
        ctx.errors.put((title, f"{type(err).__name__}: {err}", traceback.format_exc()))
        ctx.errors.close()
        ctx.errors.join_thread()
        sys.exit(FATAL_EXIT if isinstance(err, FatalRunError | UsageError) else 1)


def worker_device(gpu_id: int) -> torch.device:
    """The device for `gpu_id` (-1 = CPU), made current before any other CUDA call.

    Setting the device first keeps a process from creating a CUDA context (and holding
    memory) on GPU 0 when it works on another GPU.
    """
    if gpu_id < 0:
        return torch.device("cpu")
    torch.cuda.set_device(gpu_id)
    return torch.device("cuda", gpu_id)


# ----------------------------------------------------------------------------------------------
# Run monitoring: TensorBoard, the status line, the run record
# ----------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Versions of Python and the libraries a result depends on."""
    import platform

    import cv2
    import gymnasium
    import numpy

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__,
        "opencv": cv2.__version__,
    }
    try:
        import ale_py

        out["ale_py"] = ale_py.__version__
    except ImportError:
        out["ale_py"] = "not installed"
    return out


def hardware(gpu_ids: list[int]) -> str:
    """``"2 CPU cores"`` or ``"1x NVIDIA H100 + 16 CPU cores"``: what a run ran on."""
    cores = f"{os.cpu_count()} CPU cores"
    if gpu_ids == [-1] or not torch.cuda.is_available():
        return cores
    names = [torch.cuda.get_device_name(i) for i in sorted(set(gpu_ids))]
    grouped = {name: names.count(name) for name in names}
    return " + ".join([f"{n}x {name}" for name, n in grouped.items()] + [cores])


def git_commit() -> str | None:
    """The checkout's commit, if this is a git checkout."""
    import subprocess

    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def write_json_atomic(obj: Any, path: str | Path) -> None:
    """Write `obj` as indented JSON with `write_atomic`."""
    text = json.dumps(obj, indent=2, default=str) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


class RunMonitor:
    """The launcher's view of a run: TensorBoard, the terminal status line, the run record.

    Workers and the test process send small summaries through `ProcessContext.reports`;
    this one place averages them and writes, so no worker ever waits on a disk.
    """

    def __init__(
        self,
        args: Any,
        model: nn.Module,
        observation_shape: tuple[int, ...],
        frames_per_step: int,
        ctx: ProcessContext,
        log: logging.Logger,
        record_path: Path,
        resumed_from: str | None = None,
    ):
        """Open the TensorBoard run (with the model graph) and write the run record.

        A resumed run (`resumed_from` names the training-state file) keeps the records of the
        runs before it under ``previous_runs``.
        """
        self.args = args
        self.model = model
        self.frames_per_step = frames_per_step
        self.ctx = ctx
        self.log = log
        self.record_path = record_path
        self.interval = args.status_interval
        self.rewards: list[float] = []
        self.best = -math.inf
        self.normalizers: dict[str, Any] = {}
        self.train_window: list[dict[str, float]] = []
        self.last_tick = time.time()
        self.last_steps = ctx.total_steps()
        self.fps = 0.0
        self.writer = None
        if args.tensorboard_logger:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir)
            hx, cx = model.initial_state(1)
            dummy = torch.zeros(1, *observation_shape)
            self.writer.add_graph(model, (dummy, hx, cx))
        self.record = {
            "env": args.env,
            "command": " ".join(["python", *sys.argv]),
            "config": vars(args),
            "versions": versions(),
            "hardware": hardware(args.gpu_ids),
            "git_commit": git_commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if resumed_from is not None:
            self.record["resumed_from"] = resumed_from
            with contextlib.suppress(OSError, ValueError):
                previous = json.loads(Path(record_path).read_text())
                history = previous.pop("previous_runs", [])
                self.record["previous_runs"] = [*history, previous]
        write_json_atomic(self.record, record_path)

    @property
    def frames(self) -> int:
        """Raw frames played by all workers so far."""
        return self.ctx.total_steps() * self.frames_per_step

    def drain(self) -> None:
        """Take every pending report from the children."""
        while True:
            try:
                kind, payload = self.ctx.reports.get_nowait()
            except queue.Empty:
                return
            normalizer = payload.pop("normalizer", None)
            if kind == "test":
                self.normalizers["test"] = normalizer
                self._test_game(payload)
            elif kind == "train":
                self.normalizers[str(payload["rank"])] = normalizer
                self.train_window.append(payload)

    def restore(self, rewards: list[float], normalizers: dict[str, Any]) -> None:
        """Continue from a resumed run's test rewards and normaliser statistics."""
        self.rewards = [float(r) for r in rewards]
        self.best = max(self.rewards, default=-math.inf)
        self.normalizers = dict(normalizers)

    @property
    def test_totals(self) -> dict[str, float]:
        """The test games so far as the test process counts them (empty before the first)."""
        if not self.rewards:
            return {}
        return {"games": len(self.rewards), "reward_total": sum(self.rewards), "best": self.best}

    def _test_game(self, game: dict[str, float]) -> None:
        self.rewards.append(game["reward"])
        self.best = max(self.best, game["reward"])
        if self.writer is not None:
            frames = int(game["frames"])
            self.writer.add_scalar("test/episode_reward", game["reward"], frames)
            self.writer.add_scalar("test/episode_length", game["length"], frames)
            self.writer.add_scalar("test/reward_mean_100", self.mean_100, frames)

    @property
    def mean_100(self) -> float:
        """Mean test reward of the last 100 games (NaN before the first)."""
        recent = self.rewards[-100:]
        return sum(recent) / len(recent) if recent else math.nan

    def tick(self, force: bool = False) -> None:
        """Every ``--status-interval`` seconds: training scalars, histograms, a status line."""
        self.drain()
        now = time.time()
        if not force and now - self.last_tick < self.interval:
            return
        steps = self.ctx.total_steps()
        frames_done = (steps - self.last_steps) * self.frames_per_step
        self.fps = frames_done / max(now - self.last_tick, 1e-9)
        self.last_tick, self.last_steps = now, steps
        if self.writer is not None:
            self._write_training(steps * self.frames_per_step)
        self.train_window = []
        if self.interval > 0:
            self.log.info(self.status_line(now, steps))

    def _write_training(self, frames: int) -> None:
        assert self.writer is not None
        self.writer.add_scalar("train/fps", self.fps, frames)
        self.writer.add_scalar("train/lr", self.args.lr, frames)
        if self.train_window:
            updates = sum(r["updates"] for r in self.train_window) or 1
            keys = [k for k in self.train_window[0] if k not in ("rank", "updates")]
            for key in keys:
                value = sum(r[key] * r["updates"] for r in self.train_window) / updates
                self.writer.add_scalar(f"train/{key}", value, frames)
        for name, param in self.model.named_parameters():
            self.writer.add_histogram(name, param.detach(), frames)
        self.writer.flush()

    def status_line(self, now: float, steps: int) -> str:
        """``status 00h 05m 12s | steps 1,234 | frames 4,936 | 2,345 frames/s | test ...``."""
        clock = format_elapsed(now - self.ctx.start_time)
        if self.rewards:
            test = (
                f"test reward {self.rewards[-1]:g} (mean of last {min(len(self.rewards), 100)} "
                f"{self.mean_100:.2f}, best {self.best:g}, {len(self.rewards)} games)"
            )
        else:
            test = "no test game finished yet"
        skipped = self.ctx.total_skipped()
        skipped_text = f" | {skipped} non-finite updates skipped" if skipped else ""
        return (
            f"status {clock} | steps {steps:,} | frames {steps * self.frames_per_step:,} | "
            f"{self.fps:,.0f} frames/s | {test}{skipped_text}"
        )

    def close(self, stop_reason: str, exit_code: int) -> None:
        """Final scalars, close TensorBoard, complete the run record."""
        self.tick(force=True)
        if self.writer is not None:
            self.writer.close()
        elapsed = time.time() - self.ctx.start_time
        self.record["finished"] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(elapsed, 1),
            "steps": self.ctx.total_steps(),
            "frames": self.frames,
            "test_games": len(self.rewards),
            "best_test_reward": None if not self.rewards else self.best,
            "test_reward_mean_100": None if not self.rewards else self.mean_100,
            "skipped_updates": self.ctx.total_skipped(),
            "stop_reason": stop_reason,
            "exit_code": exit_code,
        }
        write_json_atomic(self.record, self.record_path)
