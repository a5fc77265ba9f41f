"""What every process shares: error types, the CLI's one-line errors, logging, process hygiene."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

if TYPE_CHECKING:
    from checkpoint import TrainingState


class UsageError(ValueError):
    """Bad user input: the CLI prints the message as one line and exits with code 2."""


def say_error(script: str, err: BaseException) -> None:
    """``<script>: error: <line>`` on stderr for each line of `err` (every problem found)."""
    for line in str(err).splitlines():
        print(f"{script}: error: {line}", file=sys.stderr)


class FatalRunError(RuntimeError):
    """A child's error that restarting the child cannot fix; the launcher stops the run."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit with code 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>; see <prog> --help`` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


FATAL_EXIT = 3
"""Exit code of a child that failed with `FatalRunError` or `UsageError` (not restarted)."""

INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C (128 + SIGINT, what a shell reports for a process it interrupted)."""


def run_script(main: Callable[[], int], interrupted: list[int], message: str) -> NoReturn:
    """Exit with `main`'s code, as ``python <script>`` ends.

    `interrupted` holds the SIGINTs noted while the script imported: any prints `message` and
    exits with `INTERRUPTED_EXIT` before `main` runs.
    """
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored by whoever started it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        print(message, file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    code = main()
    # All is saved: a Ctrl-C now would only interrupt Python's exit handlers or teardown, so it
    # is ignored (SIG_IGN, which Python keeps to the end); SIGTERM still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


# Logging and formatting


def setup_logger(name: str, log_file: str | Path, level: int = logging.INFO) -> logging.Logger:
    """Return a logger writing ``%(asctime)s : %(message)s`` to `log_file` and the terminal.

    Old handlers of the same name are replaced, so a second call duplicates no lines.
    """
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter("%(asctime)s : %(message)s")
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    for handler in (logging.FileHandler(log_file, mode="a"), logging.StreamHandler()):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def format_elapsed(seconds: float) -> str:
    """``00h 02m 13s`` (hours keep counting past a day)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}h {minutes:02d}m {secs:02d}s"


def count_of(count: int, noun: str) -> str:
    """``1 worker``, ``2 workers``: `count` and `noun`, plural but for 1."""
    return f"{count} {noun}{'s' * (count != 1)}"


def require_at_least(flag: str, value: int, minimum: int = 1) -> None:
    """Raise UsageError ``"<flag> must be at least <minimum>, got <value>"`` when too small."""
    if value < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {value}")


# Seeds


@dataclass(frozen=True)
class ProcessStart:
    """Which start of a run's child process this is, for its seeds.

    A fresh run's first start seeds as the original does (``--seed`` plus the rank); every
    later one (a resume, a restart) draws seeds of its own, so it does not replay the draws
    the run began with. `count` is the child's earlier starts in this sitting.
    """

    resumed_steps: int = 0
    count: int = 0

    @property
    def first(self) -> bool:
        """A fresh run's first start: the plain seeds."""
        return self.resumed_steps == 0 and self.count == 0

    def seeds(self, seed: int, rank: int | None, number: int) -> list[int]:
        """`number` seeds in 0..2**32-1, drawn from `seed`, the process and this start.

        `rank` is the training worker's; None for the test process.
        """
        process = 0 if rank is None else rank + 1
        spawn_key = (process, self.resumed_steps, self.count)
        words = np.random.SeedSequence(seed, spawn_key=spawn_key).generate_state(number)
        return [int(word) for word in words]


FIRST_START = ProcessStart()
"""A fresh run's first start of a child: the plain seeds."""


# Processes


@dataclass
class ProcessContext:
    """What the launcher shares with every child: the stop flag, counters, a report pipe.

    Nothing in it takes a lock: a process SIGKILLed while holding a shared lock would hang
    the run. So the stop request is a flag children poll, each counter has one slot per worker
    that only its owner writes (readers sum them), and each child reports through its own
    pipe (`reports`; None where no launcher listens). `slot` is -1 in the test process.
    """

    stop_flag: Any
    steps: Any
    skipped: Any
    base_steps: int = 0
    base_skipped: int = 0
    max_steps: int = 0
    start_time: float = 0.0
    parent_pid: int = 0
    slot: int = 0
    reports: Any = None

    POLL_SECONDS = 0.1
    """How often `wait` looks at the stop flag."""

    @classmethod
    def create(
        cls,
        mp_context: Any,
        max_steps: int = 0,
        slots: int = 1,
        resumed: TrainingState | None = None,
    ) -> ProcessContext:
        """Make the shared objects from a multiprocessing context; the clock starts now.

        Counts and time go on from `resumed`'s. The context returned counts in slot 0 and
        reports nowhere; children get theirs from `for_child`.
        """
        return cls(
            stop_flag=mp_context.RawValue("b", 0),
            steps=mp_context.RawArray("q", slots),
            skipped=mp_context.RawArray("q", slots),
            base_steps=0 if resumed is None else resumed.steps,
            base_skipped=0 if resumed is None else resumed.skipped_updates,
            max_steps=max_steps,
            start_time=time.time() - (0.0 if resumed is None else resumed.elapsed),
            parent_pid=os.getpid(),
        )

    def for_child(self, slot: int, reports: Any) -> ProcessContext:
        """The context a child gets: its counter slot (-1: none) and its end of a report pipe."""
        return dataclasses.replace(self, slot=slot, reports=reports)

    def report(self, kind: str, payload: dict[str, Any]) -> None:
        """Send a summary to the launcher (dropped where none listens, or it is gone)."""
        if self.reports is not None:
            with contextlib.suppress(OSError):  # the launcher is gone: stopping() says so next
                self.reports.send((kind, payload))

    def total_steps(self) -> int:
        """Agent steps taken by all workers so far (a sum of slots: no lock)."""
        return self.base_steps + sum(self.steps)

    def add_steps(self, n: int) -> None:
        """Count `n` more agent steps in this process's own slot."""
        self.steps[self.slot] += n

    def count_skipped(self) -> None:
        """Count one update skipped for a non-finite loss or gradient."""
        self.skipped[self.slot] += 1

    def total_skipped(self) -> int:
        """Updates skipped by all workers so far."""
        return self.base_skipped + sum(self.skipped)

    def budget_reached(self) -> bool:
        """``--max-steps`` is set and reached."""
        return self.max_steps > 0 and self.total_steps() >= self.max_steps

    def request_stop(self) -> None:
        """Ask every process of the run to stop (the launcher's shutdown)."""
        self.stop_flag.value = 1

    def stopping(self) -> bool:
        """The launcher asked to stop, or it is gone (killed without its shutdown)."""
        orphaned = os.getpid() != self.parent_pid and os.getppid() != self.parent_pid
        return bool(self.stop_flag.value) or orphaned

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
            time.sleep(min(left, self.POLL_SECONDS))
        return True


class ReportChannels:
    """The launcher's ends of the children's report pipes: one pipe per child.

    A shared ``multiprocessing.Queue`` has one writer lock, which a killed child can hold for
    good. With a pipe each, a child killed mid-message breaks only its own pipe.
    """

    # Reports read from one pipe per `receive` call, so a fast writer cannot hold the
    # launcher's loop; a dead child's 64 KiB pipe buffer still fits in one call.
    MAX_REPORTS_PER_CALL = 4096

    def __init__(self, mp_context: Any):
        """No pipe yet; `open` makes one per child start."""
        self.mp = mp_context
        self.readers: dict[Any, Any] = {}

    def open(self, key: Any, ctx: ProcessContext, slot: int) -> ProcessContext:
        """A new pipe for child `key`, replacing a dead one's; returns the child's context."""
        self.close(key)
        reader, writer = self.mp.Pipe(duplex=False)
        self.readers[key] = reader
        return ctx.for_child(slot, writer)

    @staticmethod
    def started(child_ctx: ProcessContext) -> None:
        """Close the launcher's copy of a started child's end, so its death ends the pipe."""
        child_ctx.reports.close()

    def receive(self, key: Any | None = None) -> list[tuple[Any, str, dict[str, Any]]]:
        """The reports that have arrived, as ``(key, kind, payload)``; never waits for more.

        A `key` reads only that child's pipe. A dead child's pipe is read to its end and closed.
        """
        readers = [(k, r) for k, r in self.readers.items() if key is None or k == key]
        ready = mp_connection.wait([reader for _, reader in readers], timeout=0)
        received = []
        for child, reader in [(k, r) for k, r in readers if r in ready]:
            try:
                for _ in range(self.MAX_REPORTS_PER_CALL):
                    if not reader.poll():
                        break
                    kind, payload = reader.recv()
                    received.append((child, kind, payload))
            except (EOFError, OSError, pickle.UnpicklingError):
                # The child is gone; a message cut off by its death is dropped with it.
                self.close(child)
        return received

    def close(self, key: Any) -> None:
        """Forget the pipe of child `key` (nothing if it has none)."""
        reader = self.readers.pop(key, None)
        if reader is not None:
            reader.close()


@contextlib.contextmanager
def signal_handled(handler: Any, *signums: int) -> Iterator[None]:
    """Inside, `handler` takes the signals `signums`; after, the handlers they had again.

    Outside the main thread (a Ray actor's) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, current in previous.items():
            signal.signal(signum, current)


def sigterm_interrupts(exits: bool = False) -> contextlib.AbstractContextManager[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so what is done is kept.

    `timeout`, schedulers and ``docker stop`` send SIGTERM to the process alone: its clean-up
    then stops its children. With `exits`, it raises ``SystemExit(143)`` instead, and only
    where SIGTERM would kill the process at once: a handler of the process's own stays.
    Where SIGTERM is ignored, it does nothing.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum) if exits else KeyboardInterrupt

    current = signal.getsignal(signal.SIGTERM)
    if current is signal.SIG_IGN or (exits and current is not signal.SIG_DFL):
        return contextlib.nullcontext()
    return signal_handled(interrupt, signal.SIGTERM)


def sigint_ignored() -> contextlib.AbstractContextManager[None]:
    """Start a child in the block: it inherits an ignored SIGINT.

    An ignored disposition survives ``exec``; a handler would become Python's default, whose
    KeyboardInterrupt prints a traceback from a child still starting up. A Ctrl-C inside the
    block is lost.
    """
    return signal_handled(signal.SIG_IGN, signal.SIGINT)


@contextlib.contextmanager
def child_process(title: str, ctx: ProcessContext) -> Iterator[None]:
    """Set up a spawned child and turn its failure into a report for the launcher.

    One thread per process, SIGINT ignored (the launcher drives shutdown), the title set. An
    exception is reported as an ``"error"`` and the process exits with code 1 (restarted), or
    `FATAL_EXIT` for a `FatalRunError` or `UsageError` (the run stops).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    with contextlib.suppress(ImportError):  # a nicety only: titles show in ps/top
        import setproctitle

        setproctitle.setproctitle(title)
    try:
        yield
    except Exception as err:  # reported, then the process exits non-zero
        cause = f"{type(err).__name__}: {err}"
        ctx.report("error", {"title": title, "cause": cause, "traceback": traceback.format_exc()})
        sys.exit(FATAL_EXIT if isinstance(err, FatalRunError | UsageError) else 1)


def refuse_folders_named_as(*files: tuple[Path, str]) -> None:
    """Refuse a command where a folder has the name of a file it saves (``(file, flag)`` pairs).

    The save would fail only at the end, so the command is refused before it starts.

    Raises:
        UsageError: naming the folder, its flag and the fix.
    """
    for path, flag in files:
        if path.is_dir():
            raise UsageError(
                f"{path} is a folder where a file of that name is to be saved; rename or "
                f"remove the folder, or give {flag} another folder"
            )


def check_writable(*folders: tuple[str | Path, str]) -> None:
    """Create each ``(folder, flag)``'s folder if needed and make sure files can be written there.

    A refused command leaves no folder behind: the folders this call made are removed.

    Raises:
        UsageError: one cannot be created or written, naming its flag and the folder.
    """
    made: list[Path] = []  # in the order made
    for folder, flag in folders:
        path = Path(folder).absolute()
        try:
            for level in reversed([path, *path.parents]):  # outermost first
                with contextlib.suppress(FileExistsError):
                    level.mkdir()
                    made.append(level)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as err:
            for level in reversed(made):  # innermost first
                with contextlib.suppress(OSError):
                    level.rmdir()  # only if still empty
            raise UsageError(
                f"{flag} {str(folder)!r} is not writable ({err.strerror}); choose a folder you "
                "can write"
            ) from None


def cpu_has_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX512-BF16 or AMX on x86)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def worker_device(gpu_id: int) -> torch.device:
    """The device for `gpu_id` (-1 = CPU), made current before any other CUDA call.

    Setting the device first keeps a process from holding a CUDA context on GPU 0. On a GPU,
    fp32 means fp32: no TF32 in matmuls or cuDNN convolutions and RNNs. PyTorch leaves TF32 on
    for cuDNN, so the fast path's fused ``torch.lstm`` would differ from the acting
    ``LSTMCell`` (cuBLAS, full fp32): the loss would differentiate another policy than the one
    that acted. The CPU has no TF32.
    """
    if gpu_id < 0:
        return torch.device("cpu")
    torch.cuda.set_device(gpu_id)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", gpu_id)
