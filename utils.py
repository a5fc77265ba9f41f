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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch


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

    Args:
        main: the script's entry point.
        interrupted: the SIGINTs the script noted while it imported (its handler is set
            before its imports: raised inside torch's, a Ctrl-C could be lost or leave numpy
            half-loaded). Any: `message` and `INTERRUPTED_EXIT`, before `main` runs.
        message: the one line a Ctrl-C before the start prints.
    """
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored by whoever started it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        print(message, file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    code = main()
    # All is saved: a Ctrl-C now would only interrupt Python's exit handlers (a traceback) or
    # its teardown after them (killed by the signal, a failure to a shell), so it is ignored
    # (SIG_IGN, which Python keeps to the end, unlike a handler of its own); SIGTERM ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


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


def count_of(count: int, noun: str) -> str:
    """``1 worker``, ``2 workers``: `count` and `noun`, plural but for 1."""
    return f"{count} {noun}{'s' * (count != 1)}"


def require_at_least(flag: str, value: int, minimum: int = 1) -> None:
    """Raise UsageError ``"<flag> must be at least <minimum>, got <value>"`` when too small."""
    if value < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {value}")


# ----------------------------------------------------------------------------------------------
# Seeds
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessStart:
    """Which start of a run's child process this is, for its seeds.

    A fresh run's first start of each child seeds as the original does (``--seed`` plus the
    worker's rank); every later one, a resumed sitting's or a restart after a crash, draws
    seeds of its own (`seeds`), so it does not replay the no-op counts, sticky repeats and
    action draws the run began with. A state resumed twice draws the same seeds both times.

    Attributes:
        resumed_steps: the agent steps this sitting resumed from (0: a fresh run, or one from
            a ``.dat`` alone).
        count: the child's earlier starts in this sitting (0: its first).
    """

    resumed_steps: int = 0
    count: int = 0

    @property
    def first(self) -> bool:
        """A fresh run's first start: the plain seeds."""
        return self.resumed_steps == 0 and self.count == 0

    def seeds(self, seed: int, rank: int | None, number: int) -> list[int]:
        """`number` seeds in 0..2**32-1, drawn from `seed`, the process and this start.

        Args:
            seed: the run's ``--seed`` (a cluster node's, offset by its start).
            rank: the training worker's rank; None for the test process.
            number: how many seeds.
        """
        process = 0 if rank is None else rank + 1
        spawn_key = (process, self.resumed_steps, self.count)
        words = np.random.SeedSequence(seed, spawn_key=spawn_key).generate_state(number)
        return [int(word) for word in words]


FIRST_START = ProcessStart()
"""A fresh run's first start of a child: the plain seeds."""


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------


@dataclass
class ProcessContext:
    """What the launcher shares with every child: the stop flag, counters, a report pipe.

    Nothing in it takes a lock. A process SIGKILLed (an OOM kill, a user's ``kill -9``) while
    holding a lock shared with the others leaves it held for good: every other process, the
    launcher too, would then block on it and the run would hang. So the stop request is a
    shared flag children poll, each counter has one slot per worker that only its owner
    writes (readers sum the slots), and each child reports through a pipe of its own, which
    a killed child can break only for itself.

    Attributes:
        stop_flag: a shared byte the launcher sets to 1 when the run must end.
        steps: agent steps, one shared slot per worker rank; their sum plus `base_steps` is
            the run's total.
        skipped: updates skipped for a NaN or inf loss or gradient, one slot per rank.
        base_steps: steps of the run before this launcher started (a resumed run).
        base_skipped: skipped updates before this launcher started.
        max_steps: stop once the total steps reach it (0 = no limit).
        start_time: when the run started (``time.time()``), earlier by the saved training
            time in a resumed run, for elapsed time and frames/s.
        parent_pid: the launcher's pid; a child whose parent changes was orphaned (the
            launcher was killed) and stops by itself.
        slot: the counter slot this process writes (a worker's rank); -1 for a process that
            counts nothing (the test process).
        reports: this child's end of its report pipe to the launcher (`ReportChannels`);
            None where no launcher listens (a worker loop run in-process by a test or a
            benchmark), and then reports are dropped.
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
        steps: int = 0,
        elapsed: float = 0.0,
        skipped: int = 0,
        slots: int = 1,
    ) -> ProcessContext:
        """Make the shared objects from a multiprocessing context; the clock starts now.

        The context returned counts in slot 0 and reports nowhere: what a worker loop run
        in-process needs. The launcher gives each child its own with `for_child`.

        Args:
            mp_context: the multiprocessing context the children are started with.
            max_steps: the step budget (0 = none).
            steps: steps already taken (a resumed run).
            elapsed: seconds already trained (a resumed run).
            skipped: non-finite updates already skipped (a resumed run).
            slots: counter slots, one per worker rank (``--workers``).
        """
        require_at_least("slots", slots)
        return cls(
            stop_flag=mp_context.RawValue("b", 0),
            steps=mp_context.RawArray("q", slots),
            skipped=mp_context.RawArray("q", slots),
            base_steps=steps,
            base_skipped=skipped,
            max_steps=max_steps,
            start_time=time.time() - elapsed,
            parent_pid=os.getpid(),
        )

    def for_child(self, slot: int, reports: Any) -> ProcessContext:
        """The context a child gets: its counter slot (-1: none) and its end of a report pipe."""
        if not -1 <= slot < len(self.steps):
            raise ValueError(f"expected slot in -1..{len(self.steps) - 1}, got {slot}")
        return dataclasses.replace(self, slot=slot, reports=reports)

    def report(self, kind: str, payload: dict[str, Any]) -> None:
        """Send a summary to the launcher (dropped where none listens, or it is gone)."""
        if self.reports is None:
            return
        with contextlib.suppress(OSError):  # the launcher is gone: stopping() says so next
            self.reports.send((kind, payload))

    def total_steps(self) -> int:
        """Agent steps taken by all workers so far (a sum of slots: no lock)."""
        return self.base_steps + sum(self.steps)

    def _own_slot(self) -> int:
        if self.slot < 0:
            raise RuntimeError("this process has no counter slot (the test process counts none)")
        return self.slot

    def add_steps(self, n: int) -> None:
        """Count `n` more agent steps in this process's own slot."""
        self.steps[self._own_slot()] += n

    def count_skipped(self) -> None:
        """Count one update skipped for a non-finite loss or gradient."""
        self.skipped[self._own_slot()] += 1

    def total_skipped(self) -> int:
        """Updates skipped by all workers so far."""
        return self.base_skipped + sum(self.skipped)

    def budget_reached(self) -> bool:
        """``--max-steps`` is set and reached."""
        return self.max_steps > 0 and self.total_steps() >= self.max_steps

    def request_stop(self) -> None:
        """Ask every process of the run to stop (the launcher's shutdown)."""
        self.stop_flag.value = 1

    def orphaned(self) -> bool:
        """The launcher is gone (killed without its shutdown): this child must end too."""
        return os.getpid() != self.parent_pid and os.getppid() != self.parent_pid

    def stopping(self) -> bool:
        """The launcher asked to stop, or it is gone."""
        return bool(self.stop_flag.value) or self.orphaned()

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

    A pipe shared by every child (a ``multiprocessing.Queue``) has one writer lock: a child
    killed while its feeder thread holds it silences every other child for the rest of the
    run. With a pipe each, a child killed mid-message breaks only its own pipe; its reader
    sees the end of the pipe (the launcher keeps no copy of the child's end), and the child's
    replacement gets a new pipe.
    """

    # Reports read from one pipe per `receive` call. A child that writes as fast as the
    # launcher reads would otherwise keep `receive` (and with it the launcher's whole loop:
    # restarts, checkpoints, Ctrl-C) reading forever. A dead child's pipe holds at most its
    # 64 KiB buffer, fewer reports than this, so it is still read to its end in one call.
    MAX_REPORTS_PER_CALL = 4096

    def __init__(self, mp_context: Any):
        """No pipe yet; `open` makes one per child start."""
        self.mp = mp_context
        self.readers: dict[Any, Any] = {}

    def open(self, key: Any, ctx: ProcessContext, slot: int) -> ProcessContext:
        """A new pipe for the child `key` (replacing a dead one's); returns the child's context.

        Call `started` with that context once the child has started.
        """
        self.close(key)
        reader, writer = self.mp.Pipe(duplex=False)
        self.readers[key] = reader
        return ctx.for_child(slot, writer)

    @staticmethod
    def started(child_ctx: ProcessContext) -> None:
        """Close the launcher's copy of the child's end: the child now holds the only one.

        Then the reader sees the end of the pipe when the child dies, even mid-message.
        """
        child_ctx.reports.close()

    def receive(self, key: Any | None = None) -> list[tuple[Any, str, dict[str, Any]]]:
        """The reports that have arrived, as ``(key, kind, payload)``; never waits for more.

        Every report that has arrived, up to `MAX_REPORTS_PER_CALL` from each pipe. A pipe
        whose child has died is read to its end and closed.

        Args:
            key: read only this child's pipe (default: every child's).
        """
        if key is None:
            readers = self.readers
        else:
            readers = {key: self.readers[key]} if key in self.readers else {}
        received = []
        ready = mp_connection.wait(list(readers.values()), timeout=0)
        for child, reader in list(readers.items()):
            if reader not in ready:
                continue
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
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so what is done is kept.

    `timeout`, schedulers and ``docker stop`` send SIGTERM, to the process alone: its own
    clean-up then stops its children. Spawned children start with SIGTERM's default (a handler
    does not survive ``exec``). Outside the main thread, or where SIGTERM was ignored by
    whoever started the process, the block does nothing.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    ):
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Start a child in the block: it inherits an ignored SIGINT.

    A spawned child keeps an ignored disposition across ``exec``; a handler would become the
    default there, and Python's default raises KeyboardInterrupt (a traceback on the
    terminal) in a child still starting up, before `child_process` ignores SIGINT itself.
    A Ctrl-C inside the block (the milliseconds of one ``Process.start``) is lost: blocking
    it instead would not hold it, since Linux gives a process's signal to any thread that
    does not block it. Outside the main thread (a cluster node's launcher, in a Ray actor's
    thread, where no terminal sends Ctrl-C) handlers cannot be set, and the block does
    nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def child_process(title: str, ctx: ProcessContext) -> Iterator[None]:
    """Set up a spawned child and turn its failure into a report for the launcher.

    One thread per process (with several processes per core, more threads only fight),
    SIGINT ignored (the launcher drives shutdown, so Ctrl-C prints no tracebacks from
    children), the process title set. An exception is sent to the launcher as one line plus
    its traceback (an ``"error"`` report), and the process exits with code 1 (the launcher
    restarts it), or `FATAL_EXIT` for a `FatalRunError` or `UsageError` (the launcher stops
    the run).
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
        cause = f"{type(err).__name__}: {err}"
        ctx.report("error", {"title": title, "cause": cause, "traceback": traceback.format_exc()})
        sys.exit(FATAL_EXIT if isinstance(err, FatalRunError | UsageError) else 1)


def check_gpus(gpu_ids: Sequence[int], flag: str = "--gpu-ids") -> None:
    """Reject GPU ids that do not exist here (-1 alone means the CPU).

    Args:
        gpu_ids: the ids asked for.
        flag: the flag that named them, for the message (``--gpu-id`` in ``gym_eval.py``).

    Raises:
        UsageError: CUDA is unavailable, or an id is out of range.
    """
    if list(gpu_ids) == [-1]:
        return
    if any(gpu_id < 0 for gpu_id in gpu_ids):
        raise UsageError(
            f"{flag} {' '.join(map(str, gpu_ids))}: GPU ids are 0 and up, and -1 (alone) means "
            "the CPU; pass one or the other"
        )
    if not torch.cuda.is_available():
        raise UsageError(
            f"{flag} {' '.join(map(str, gpu_ids))} asks for a GPU but CUDA is not available "
            f"here; drop {flag} (or pass -1) to run on the CPU"
        )
    count = torch.cuda.device_count()
    for gpu_id in gpu_ids:
        if not 0 <= gpu_id < count:
            raise UsageError(
                f"{flag} names GPU {gpu_id}, but this machine has {count} "
                f"(ids 0..{count - 1}); pass ids from that range"
            )


def refuse_folders_named_as(*files: tuple[Path, str]) -> None:
    """Refuse a command where a folder has the name of a file it saves.

    The save would fail only at the end (a run's weights, an evaluation's summary), so the
    command is refused before it starts.

    Args:
        files: ``(file, flag)``: each file the command saves and the flag naming its folder.

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

    A refusal removes the folders this call made for the others (only those: each level is
    made on its own, so one another process made meanwhile is not taken for ours): a refused
    command leaves no folder behind.

    Raises:
        UsageError: one cannot be created or written, naming its flag and the folder.
    """
    made: list[Path] = []  # in the order made
    try:
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
                raise UsageError(
                    f"{flag} {str(folder)!r} is not writable ({err.strerror}); choose a folder "
                    "you can write"
                ) from None
    except UsageError:
        for level in reversed(made):  # innermost first
            with contextlib.suppress(OSError):
                level.rmdir()  # only if still empty
        raise


def cpu_has_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX512-BF16 or AMX on x86)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def check_precision(precision: str, gpu_ids: Sequence[int]) -> None:
    """Reject ``--precision bf16`` where the hardware lacks bfloat16 arithmetic.

    On the CPU that means oneDNN's bfloat16 kernels (AVX512-BF16 or AMX on x86); on GPUs,
    compute capability 8.0 or later (`gpu_has_bf16`). Call after `check_gpus`.

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
        if not gpu_has_bf16(gpu_id):
            raise UsageError(
                f"--precision bf16 needs bfloat16 on GPU {gpu_id} "
                f"({torch.cuda.get_device_name(gpu_id)}), which lacks it; use --precision fp32"
            )


def gpu_has_bf16(gpu_id: int) -> bool:
    """Native bfloat16 arithmetic (compute capability 8.0+: Ampere, Hopper, ...) on `gpu_id`.

    Reads the device's properties, which creates no CUDA context: the launcher checks every
    GPU of the run and must not hold ~0.3-0.5 GB on each for the whole run, as a
    ``torch.cuda.device(gpu_id)`` block around ``is_bf16_supported`` would. T4 (7.5) and
    V100 (7.0) emulate bf16 slowly and are refused.
    """
    return torch.cuda.get_device_capability(gpu_id) >= (8, 0)


def worker_device(gpu_id: int) -> torch.device:
    """The device for `gpu_id` (-1 = CPU), made current before any other CUDA call.

    Setting the device first keeps a process from creating a CUDA context (and holding
    memory) on GPU 0 when it works on another GPU. A GPU also gets `set_fp32_policy`.
    """
    if gpu_id < 0:
        return torch.device("cpu")
    torch.cuda.set_device(gpu_id)
    device = torch.device("cuda", gpu_id)
    set_fp32_policy(device)
    return device


def set_fp32_policy(device: torch.device) -> None:
    """fp32 means fp32 on a GPU: no TF32 in matmuls or cuDNN convolutions and RNNs.

    PyTorch leaves TF32 on for cuDNN by default on Ampere and later, so the fast path's fused
    ``torch.lstm`` (cuDNN) would run with 10-bit mantissas while the acting ``LSTMCell``
    (cuBLAS matmuls, TF32 off by default) runs full fp32: the loss would differentiate a
    slightly different policy from the one that acted. Both off makes the two paths agree.
    The CPU has no TF32: nothing to set.
    """
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
