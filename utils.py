"""Helpers shared by every process: configuration, logging, weight init, gradient hand-off."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

CONFIG_KEYS = ("crop1", "crop2", "dimension2")
"""Fields every `config.json` entry must hold (rows crop1:crop2+160 are kept)."""


class UsageError(ValueError):
    """Bad user input: the CLI prints the message as one line and exits with code 2."""


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
    ``.grad`` is per process, so workers never see each other's). From a GPU the gradients
    are copied into a CPU buffer kept on the shared parameter and reused across updates.

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
            if shared_param.grad is None or shared_param.grad.shape != grad.shape:
                shared_param.grad = torch.empty_like(shared_param)
            shared_param.grad.copy_(grad)
