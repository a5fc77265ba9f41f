"""The files a run reads and writes: ``.dat`` weights, the training state, atomic writes.

``<env>.dat`` is a plain ``state_dict`` with the original A3G's keys (the two projects load
each other's). ``<env>_state.pt`` is the training state `--load` resumes from. Both are
written through a temporary file and a rename, and read with ``weights_only=True``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import socket
import struct
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from utils import UsageError, sigterm_interrupts


def env_file_stem(env_id: str) -> str:
    """A file-name-safe form of an env id (``ALE/Pong-v5`` -> ``ALE_Pong-v5``)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", env_id).lstrip(".")
    if not stem:
        raise UsageError(f"env id {env_id!r} gives no usable file name; use a registered id")
    return stem


def checkpoint_path(folder: str | Path, env_id: str, suffix: str = ".dat") -> Path:
    """``<folder>/<env>.dat`` with the env id made safe for a file name."""
    return Path(folder) / f"{env_file_stem(env_id)}{suffix}"


def current_umask() -> int:
    """This process's umask, read without changing it where the system says it (Linux)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it, then set it back
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write a file through a temporary file and a rename.

    A reader (or a crash) never sees a half-written file, and a failed write leaves no
    temporary file. The file gets the umask's mode, not a temporary file's 0600, so others can
    read a checkpoint; the folder is synced, so the rename survives a power cut.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_interrupts(exits=True):  # an interrupted write removes its temporary file
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:  # closes fd, whatever happens next
                with contextlib.suppress(OSError):  # a file system without modes (vfat) refuses
                    os.fchmod(f.fileno(), 0o666 & ~current_umask())
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    # Some network mounts cannot open a folder, and some file systems cannot sync one.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` `obj` to `path` with `write_atomic`.

    Serialises in memory first, so a failing disk raises the plain OSError, not torch's.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, lambda f: f.write(buffer.getbuffer()))


def file_sha256(path: str | Path) -> str | None:
    """The SHA-256 of a file's bytes, in hex (None if it cannot be read)."""
    digest = hashlib.sha256()
    try:
        with Path(path).open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def write_json_atomic(obj: Any, path: str | Path) -> None:
    """Write `obj` as indented JSON with `write_atomic`."""
    text = json.dumps(obj, indent=2, default=str) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def _torch_load(path: Path, what: str, fix: str = "use an intact file") -> Any:
    """``torch.load`` with ``weights_only=True``, its failures turned into UsageErrors.

    `fix` ends the message of a file that is empty or cut short.
    """
    name = f"{what} {str(path)!r}"
    try:
        with path.open("rb") as file:
            start = file.read(2)
    except OSError as err:
        raise UsageError(f"{name} cannot be read: {err.strerror}") from None
    if not start:
        raise UsageError(f"{name} is empty; {fix}")
    if not start.startswith((b"PK", b"\x80")):  # torch.save's zip, or a legacy pickle
        raise UsageError(
            f"{name} is not a PyTorch file (it begins {start!r}); use a .dat "
            "or training state A3G wrote"
        )
    try:
        with warnings.catch_warnings():  # our one-line error says it all
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(
            f"{name} holds pickled objects, not just tensors; refusing to "
            "load it (it could run code): use a file A3G wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, struct.error) as err:
        # PyTorch's first sentence says it; a cut legacy file fails in the unpickler, unhelpfully.
        lines = str(err).strip().splitlines()
        if isinstance(err, IndexError | struct.error | EOFError) or not lines:
            lines = ["it ends early"]
        reason = lines[0].split(". ")[0].rstrip(".")
        raise UsageError(f"{name} is truncated or not a PyTorch file ({reason}); {fix}") from None


def check_state_dict(model: nn.Module, state: Any, path: str | Path) -> dict[str, torch.Tensor]:
    """Make sure `state` is a state_dict that fits `model`; return it.

    Raises:
        UsageError: not a state_dict of tensors, or saved for another game (action count),
            another ``--hidden-size`` or another network.
    """
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UsageError(
            f"checkpoint {str(path)!r} is not a state_dict of tensors; use a .dat A3G (or the "
            "original A3G) wrote"
        )
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        agents = {  # by the first layer: frames or vectors
            "conv1.weight": "an Atari agent (frames) and this env gives vectors",
            "fc1.weight": "a vector-observation agent (CartPole-like) and this env gives frames",
        }
        held = [agent for key, agent in agents.items() if key in state and key not in own]
        fix = (
            f"it holds {held[0]}: pass the --env it was trained on"
            if held
            else "use a .dat A3G (or the original A3G) wrote for this env"
        )
        raise UsageError(
            f"checkpoint {str(path)!r} is for another network (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); {fix}"
        )
    saved_hidden, own_hidden = state["lstm.weight_hh"].shape[1], own["lstm.weight_hh"].shape[1]
    if saved_hidden != own_hidden:
        raise UsageError(
            f"checkpoint {str(path)!r} was saved with --hidden-size {saved_hidden}; this run "
            f"uses {own_hidden}: pass --hidden-size {saved_hidden}"
        )
    saved_actions = state["actor_linear.bias"].shape[0]
    own_actions = own["actor_linear.bias"].shape[0]
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


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the weights in the contiguous layout, as saved in ``.dat`` files."""
    return {
        k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
        for k, v in model.state_dict().items()
    }


def saved_hidden_size(path: str | Path) -> int | None:
    """The LSTM hidden size a ``.dat`` (or a training state's weights) was saved with, or None.

    Raises:
        UsageError: the file is truncated, not a PyTorch file or holds pickled objects.
    """
    path = Path(path)
    return lstm_width(_stored_weights(path)) if path.is_file() else None


def lstm_width(weights: Any) -> int | None:
    """The LSTM hidden size of a state_dict, None where it holds no LSTM weights."""
    weight = weights.get("lstm.weight_hh") if isinstance(weights, dict) else None
    return int(weight.shape[1]) if torch.is_tensor(weight) and weight.dim() == 2 else None


def load_weights(model: nn.Module, path: str | Path, hint: str = "") -> None:
    """Load a ``.dat`` state_dict (ours or the original A3G's), or a training state's, into `model`.

    Uses ``weights_only=True``, so a file holding pickled objects cannot run code. `hint` is
    added to a missing file's message.

    Raises:
        UsageError: the file is missing, unreadable, not a state_dict, or saved for another
            game (action count) or another ``--hidden-size``.
    """
    path = Path(path)
    more = f" ({hint})" if hint else ""
    if path.parent.is_file():
        raise UsageError(
            f"--load-model-dir {str(path.parent)!r} is a file; give the folder holding "
            f"{path.name}{more}"
        )
    if not path.is_file():
        raise UsageError(
            f"checkpoint {str(path)!r} not found; train first, or point --load-model-dir at "
            f"the folder holding {path.name}{more}"
        )
    model.load_state_dict(check_state_dict(model, _stored_weights(path), path))


def _stored_weights(path: Path) -> Any:
    """What a file holds as weights: a ``.dat``'s content, or a training state's ``model``."""
    content = _torch_load(path, "checkpoint")
    return content.get("model") if is_training_state(content) else content


def untrained(loaded: bool, steps: int) -> bool:
    """Whether a run's weights are the random ones it began with, which are never saved."""
    return not loaded and steps == 0


STATE_FORMAT = 1
"""Version of the training-state file layout."""


def is_training_state(content: Any) -> bool:
    """Whether what a file held is a training state (`TrainingState`) of this layout."""
    return isinstance(content, dict) and content.get("format") == STATE_FORMAT


@dataclass
class TrainingState:
    """Everything `--load` resumes from: the file ``<save-model-dir><env>_state.pt``.

    On disk it is a dict of tensors and plain values (``weights_only=True`` loads it); `save`
    and `read_file` are the whole of its layout.

    Attributes:
        training_games: every training game's ``[frames, seconds, score, steps]``, in order.
        dat_score: the test score of the weights in ``<env>.dat``, which a resumed
            ``--save-max`` run's games must match to replace it (None: not known).
        dat_trained: how far the run was when those weights were taken.
        log_dir: the run's ``--log-dir``, absolute (``config`` has it as typed).
    """

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    steps: int = 0
    frames: int = 0
    elapsed: float = 0.0
    skipped_updates: int = 0
    test_rewards: list[float] = field(default_factory=list)
    training_games: list[list[float]] = field(default_factory=list)
    worker_normalizers: dict[int, dict[str, Any]] = field(default_factory=dict)
    test_normalizer: dict[str, Any] | None = None
    tensorboard_dir: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    dat_score: float | None = None
    dat_trained: dict[str, float] | None = None
    log_dir: str = ""

    def save(self, path: str | Path) -> None:
        """Write the state atomically (an OSError leaves the previous file intact)."""
        layout = {f.name: getattr(self, f.name) for f in fields(self)}
        normalizers = {str(rank): s for rank, s in layout.pop("worker_normalizers").items()}
        if (test_normalizer := layout.pop("test_normalizer")) is not None:
            normalizers["test"] = test_normalizer
        rewards = [float(r) for r in self.test_rewards]
        summary = (
            {"games": len(rewards), "reward_total": sum(rewards), "best": max(rewards)}
            if rewards
            else {}
        )
        layout.update(
            format=STATE_FORMAT,
            test_rewards=rewards,
            test=summary,
            training_games=[list(game) for game in self.training_games],
            normalizers=normalizers,
        )
        save_atomic(layout, path)

    @staticmethod
    def read_file(path: str | Path) -> dict[str, Any]:
        """The file's raw layout, checked to be a training state (``weights_only=True``).

        Raises:
            UsageError: unreadable, truncated, pickled objects, or not a training state.
        """
        path = Path(path)
        state = _torch_load(
            path, "training state", "use an intact file, or delete it to load the weights alone"
        )
        if not is_training_state(state):
            raise UsageError(
                f"training state {str(path)!r} is not an A3G training-state file (A3G writes "
                f"format {STATE_FORMAT}); delete it to load the weights alone"
            )
        return state

    @classmethod
    def load(cls, path: str | Path) -> TrainingState:
        """Read a state file; counters an older file lacks start at zero.

        Raises:
            UsageError: see `read_file`.
        """
        raw = cls.read_file(path)
        given = {f.name: raw[f.name] for f in fields(cls) if raw.get(f.name) is not None}
        state = cls(**{"model": None, **given})
        normalizers = dict(raw.get("normalizers") or {})
        state.test_normalizer = normalizers.pop("test", None)
        state.worker_normalizers = {int(rank): s for rank, s in normalizers.items()}
        state.test_rewards = [float(r) for r in state.test_rewards]
        if "dat_score" not in raw and state.config.get("save_max") and state.test_rewards:
            state.dat_score = max(state.test_rewards)  # an older file: its .dat held the best
        return state


# Where a run's files go


# What a ``--save-max`` run's shutdown save adds to the env's file stem: ``<env>_last.dat``.
LAST_SAVE_SUFFIX = "_last"
# And the training state's: ``<env>_state.pt``.
STATE_SUFFIX = "_state"


@dataclass(frozen=True)
class RunPaths:
    """Every file a run reads or writes, computed once from the flags.

    `final_model` is the shutdown save: `model`, or ``<env>_last.dat`` under ``--save-max``
    (so the best stays).
    """

    log: Path
    record: Path
    curve: Path
    runs: Path
    model: Path
    final_model: Path
    state: Path
    load_model: Path
    load_state: Path

    @classmethod
    def of(
        cls, env_id: str, log_dir: str, save_model_dir: str, load_model_dir: str, save_max: bool
    ) -> RunPaths:
        """The paths of a run of `env_id` (ids with a ``/`` become safe file names)."""
        model = checkpoint_path(save_model_dir, env_id)
        last = checkpoint_path(save_model_dir, env_id, f"{LAST_SAVE_SUFFIX}.dat")
        return cls(
            log=checkpoint_path(log_dir, env_id, "_log"),
            record=checkpoint_path(log_dir, env_id, "_run.json"),
            curve=checkpoint_path(log_dir, env_id, "_curve.png"),
            runs=Path(log_dir) / "runs",
            model=model,
            final_model=last if save_max else model,
            state=checkpoint_path(save_model_dir, env_id, f"{STATE_SUFFIX}.pt"),
            load_model=checkpoint_path(load_model_dir, env_id),
            load_state=checkpoint_path(load_model_dir, env_id, f"{STATE_SUFFIX}.pt"),
        )


# One run at a time in a folder


# What marks a folder as written by a live run of an env: ``<folder><env>.lock``.
RUN_LOCK_SUFFIX = ".lock"

_held_run_locks: dict[Path, int] = {}
"""The run locks this process holds: each lock file's resolved path and its open fd."""


def hold_run_lock(folder: str | Path, env_id: str, flag: str) -> None:
    """Mark `folder` as written by this process's run of `env_id`, until the process ends.

    Two runs of one env writing one folder at once write over each other's files. The mark is
    an exclusive ``flock`` on ``<folder><env>.lock``, which the kernel lets go however the
    process ends, so a crash leaves no stale lock. The holder may take it again. Does nothing
    where the folder is missing or unwritable (`check_writable` says so) or has no locks.

    Raises:
        UsageError: another live process holds the mark; names its process id and the fix.
    """
    path = checkpoint_path(folder, env_id, RUN_LOCK_SUFFIX).resolve()
    fd = None if path in _held_run_locks else _open_lock_file(path)
    if fd is None:  # held already, or no folder yet or not writable: check_writable says so
        return
    try:
        if _lock(fd, fcntl.LOCK_EX, folder, env_id, flag):
            with contextlib.suppress(OSError):  # another user's file, opened to read
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode())
            _held_run_locks[path] = fd
            return
        with contextlib.suppress(OSError):  # a file system without locks: leave nothing made
            if os.fstat(fd).st_size == 0:
                path.unlink()
    except BaseException:  # the refusal, or a Ctrl-C: no file left open
        os.close(fd)
        raise
    os.close(fd)


def refuse_another_run(folder: str | Path, env_id: str, flag: str) -> None:
    """Refuse `folder` while another live process holds its run lock; reads, takes nothing.

    Raises:
        UsageError: another process holds the mark (`hold_run_lock`); names it and the fix.
    """
    path = checkpoint_path(folder, env_id, RUN_LOCK_SUFFIX).resolve()
    if path in _held_run_locks:  # this process's own
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file: no run there
        return
    try:
        _lock(fd, fcntl.LOCK_SH, folder, env_id, flag)  # let go when the file closes
    finally:
        os.close(fd)


def _open_lock_file(path: Path) -> int | None:
    """`path` opened (made where missing), read-only where it is another user's; else None."""
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # a lock needs no write
        with contextlib.suppress(OSError):
            return os.open(path, flags, 0o666)
    return None


def _lock(fd: int, operation: int, folder: str | Path, env_id: str, flag: str) -> bool:
    """Lock `fd` without waiting; False where the file system has no locks (UsageError if held)."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 300).decode(errors="replace").strip() or "unknown"
        raise UsageError(
            f"{flag} {str(folder)!r} is being written by another run of {env_id} (process "
            f"{holder}), which would write over this run's files and this run over its; stop "
            f"that run first, or give {flag} another folder"
        ) from None
    except OSError:
        return False
    return True


def release_run_locks() -> None:
    """Remove this process's run-lock files and let their locks go (at its exit)."""
    while _held_run_locks:
        path, fd = _held_run_locks.popitem()
        with contextlib.suppress(OSError):
            path.unlink()  # removed while still locked
        os.close(fd)


atexit.register(release_run_locks)
