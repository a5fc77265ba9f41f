"""What every process shares: error types, the CLI's one-line errors, logging, process hygiene."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch


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
# Logging and formatting
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


def check_gpus(gpu_ids: Sequence[int]) -> None:
    """Reject GPU ids that do not exist here (-1 alone means the CPU).

    Raises:
        UsageError: CUDA is unavailable, or an id is out of range.
    """
    if list(gpu_ids) == [-1]:
        return
    if not torch.cuda.is_available():
        raise UsageError(
            f"--gpu-ids {' '.join(map(str, gpu_ids))} asks for GPUs but CUDA is not available "
            "here; drop --gpu-ids (or pass -1) to train on the CPU"
        )
    count = torch.cuda.device_count()
    for gpu_id in gpu_ids:
        if not 0 <= gpu_id < count:
            raise UsageError(
                f"--gpu-ids names GPU {gpu_id}, but this machine has {count} "
                f"(ids 0..{count - 1}); pass ids from that range"
            )


def cpu_has_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX512-BF16 or AMX on x86)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def check_precision(precision: str, gpu_ids: Sequence[int]) -> None:
    """Reject ``--precision bf16`` where the hardware lacks bfloat16 arithmetic.

    On the CPU that means oneDNN's bfloat16 kernels (AVX512-BF16 or AMX on x86); on GPUs,
    ``torch.cuda.is_bf16_supported``. Call after `check_gpus`.

    Raises:
        UsageError: bf16 asked for and not supported here.
    """
    if precision != "bf16":
        return
    if list(gpu_ids) == [-1]:
        if not cpu_has_bf16():
            raise UsageError(
                "--precision bf16 needs a CPU with bfloat16 instructions (AVX512-BF16 or AMX), "
                "and this one has none; use --precision fp32"
            )
        return
    for gpu_id in gpu_ids:
        with torch.cuda.device(gpu_id):
            if not torch.cuda.is_bf16_supported(including_emulation=False):
                raise UsageError(
                    f"--precision bf16 needs bfloat16 on GPU {gpu_id} "
                    f"({torch.cuda.get_device_name(gpu_id)}), which lacks it; use --precision fp32"
                )


def worker_device(gpu_id: int) -> torch.device:
    """The device for `gpu_id` (-1 = CPU), made current before any other CUDA call.

    Setting the device first keeps a process from creating a CUDA context (and holding
    memory) on GPU 0 when it works on another GPU.
    """
    if gpu_id < 0:
        return torch.device("cpu")
    torch.cuda.set_device(gpu_id)
    return torch.device("cuda", gpu_id)
