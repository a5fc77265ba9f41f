"""Steady-state training throughput of main.py: each training mode against the reference path.

For each worker count, runs ``main.py`` once per mode and once on the reference path
(``--no-fast-path``: the original's computation, one env per worker, fp32), one after the other,
each for ``--seconds`` seconds, then stops it with SIGINT. A mode is ``fast`` or ``reference``,
then optionally ``,kN`` (``--envs-per-worker N``) and ``,bf16`` (``--precision bf16``), as in
``bench_step.py``. Frames per second are read from the launcher's status lines after
``--warmup`` seconds, so start-up is excluded. Peak memory (RSS) of every process is sampled once
a second, and GPU memory with ``nvidia-smi`` when there is a GPU.

    python benchmarks/bench_training.py --workers 2 --seconds 120
    python benchmarks/bench_training.py --workers 2 --modes fast fast,k16 fast,k16,bf16
    python benchmarks/bench_training.py --workers 16 --gpu-ids 0 --modes fast,k1 fast,k4 fast,k16
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_step import at_least, main_py_refusal, mode_flags, positive  # noqa: E402

from checkpoint import write_json_atomic  # noqa: E402
from launcher import STOPPING  # noqa: E402
from utils import UsageError  # noqa: E402

STATUS = re.compile(
    r"(?:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) : )?"
    r"status (\d+)h (\d\d)m (\d\d)s \| steps [\d,]+ \| frames ([\d,]+)"
)
"""A status line: its log time stamp (to the millisecond), the run's elapsed time (to the
second), and the frames so far."""


def processes() -> Iterator[tuple[int, list[str], str]]:
    """Every process on the machine: pid, ``/proc/<pid>/stat``'s fields, title.

    The fields are those after the process name (its state first); the title is
    setproctitle's, or the command. A process gone while being read is skipped.
    """
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError):
            continue
        yield int(stat.parent.name), fields, cmd


def group_processes(pgid: int) -> dict[int, str]:
    """Live processes of a process group: pid -> title (setproctitle's, or the command)."""
    return {
        pid: cmd for pid, fields, cmd in processes() if int(fields[2]) == pgid and fields[0] != "Z"
    }


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def gpu_memory_mib() -> dict[int, float]:
    """GPU memory per pid from nvidia-smi (empty without one)."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if result.returncode != 0:  # installed, but no driver answers: its message, not a table
        return {}
    usage = {}
    for line in result.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = float(parts[1])
            except ValueError:  # "[N/A]" where the driver cannot say
                usage[int(parts[0])] = 0.0
    return usage


def role(cmd: str) -> str:
    """``Train Agent: 3`` -> ``worker``; the test process; the launcher; helpers."""
    if "Train Agent" in cmd:
        return "worker"
    if "Test Agent" in cmd:
        return "test"
    if "main.py" in cmd:
        return "launcher"
    return "helper"


def steady_frames_per_s(stderr: str, warmup: float) -> tuple[float, float] | None:
    """Frames/s from the first status line after `warmup` seconds to the last, and its seconds.

    Only the lines before main.py's shutdown began count (`launcher.STOPPING`): the status line
    it prints as it closes counts the shutdown's seconds (the children's exit, the saves),
    when no frames are made. The window is timed by the lines' time stamps (milliseconds),
    not their elapsed times (whole seconds: +-1 s in a window of 16-25 s was +-4-6%).
    None with fewer than two such lines.
    """
    running = stderr.split(f" : {STOPPING}", 1)[0]
    points = [
        (int(h) * 3600 + int(m) * 60 + int(s), _stamp_seconds(stamp), int(f.replace(",", "")))
        for stamp, h, m, s, f in STATUS.findall(running)
    ]
    steady = [p for p in points if p[0] >= warmup]
    if len(steady) < 2:
        return None
    (e0, s0, f0), (e1, s1, f1) = steady[0], steady[-1]
    seconds = float(e1 - e0)
    # The stamps, where they agree with the elapsed seconds: local times, they do not across
    # the hour repeated when daylight saving ends.
    if s0 is not None and s1 is not None and abs(s1 - s0 - seconds) <= 1.5:
        seconds = s1 - s0
    return (f1 - f0) / max(seconds, 1.0), round(seconds, 3)


def _stamp_seconds(stamp: str) -> float | None:
    """A log time stamp (``2026-11-28 07:00:05,250``) in seconds, or None where there is none."""
    if not stamp:
        return None
    when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
    return when.timestamp()


def frames_at_end(stderr: str) -> int | None:
    """The frames main.py's last status line counts (its closing one: how far it trained)."""
    found = STATUS.findall(stderr)
    return int(found[-1][4].replace(",", "")) if found else None


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def stopped_with(benchmark: int) -> Callable[[], None]:
    """A ``preexec_fn``: Linux sends the child Ctrl-C's SIGINT when `benchmark` dies.

    main.py runs in a process group of its own and has no step budget: a benchmark killed
    with SIGKILL, which no ``finally`` sees, would leave it training forever. With this it
    stops as on Ctrl-C, saving its files. A benchmark that died before the call leaves the
    child an orphan at once: it exits before it starts. prctl was looked up at import: the
    child of a fork must not take locks (the loader's) that another thread may hold.
    """

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGINT)
            if os.getppid() != benchmark:
                os._exit(1)

    return preexec


def read_in_background(proc: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    """Collect `proc`'s stderr lines as they come (a full pipe would block main.py)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    return lines, reader


def stop_group(proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Stop main.py and its process group as Ctrl-C would; SIGKILL if it does not end in time.

    Returns:
        Whether it had ended by itself (then nothing is signalled: its group may be gone).
    """
    if proc.poll() is not None:
        return True
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # deaf to Ctrl-C: no process left behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return False


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt, so a benchmark's ``finally`` stops main.py.

    Set here rather than left to Python's default: SIGTERM would end the benchmark at once,
    and a process started in the background by a shell without job control (a CI script,
    ``nohup ... &``) begins with SIGINT ignored.
    """

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_output_file(flag: str, path: str | Path | None) -> None:
    """Refuse an output file `path` that cannot be written, before any run.

    A folder, or a file in a folder that is missing or not writable, would otherwise fail
    only when the first results are written, after minutes of measuring.

    Raises:
        UsageError: naming `flag`, the path and why.
    """
    if not path:
        return
    path = Path(path)
    try:
        if path.is_dir():
            raise UsageError(f"{flag} {path} is a folder; give a file name (e.g. results.json)")
        writable = path.parent.is_dir() and os.access(path.parent, os.W_OK)
    except OSError as err:  # a folder on the way this user may not search
        raise UsageError(f"{flag} {path}: {err.strerror}") from None
    if not writable:
        raise UsageError(
            f"{flag} {path}: cannot write in {str(path.parent)!r}; make the folder or pick another"
        )


def output_file(parser: argparse.ArgumentParser, flag: str, path: str | Path | None) -> None:
    """`check_output_file` for a benchmark's flags: a refusal is ``parser.error`` (exit 2)."""
    try:
        check_output_file(flag, path)
    except UsageError as err:
        parser.error(str(err))


def output_folder(parser: argparse.ArgumentParser, flag: str, path: str | Path | None) -> None:
    """Refuse (``parser.error``) an output folder `path` that is a file or cannot be made."""
    if not path:
        return
    path = Path(path)
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())  # the root exists
        writable = existing.is_dir() and os.access(existing, os.W_OK)
    except OSError as err:
        parser.error(f"{flag} {path}: {err.strerror}")
    if not writable:
        parser.error(f"{flag} {path}: {str(existing)!r} is not a folder this user can write")


WRITTEN: set[str] = set()
"""The results files this benchmark has written (`write_results`)."""


def write_results(results: Any, path: str | Path) -> None:
    """Write the results so far as JSON, atomically, and note that this run wrote `path`."""
    write_json_atomic(results, path)
    WRITTEN.add(str(path))


def stopped(script: str, json_path: str | Path | None) -> int:
    """Say that `script` was stopped (Ctrl-C, SIGTERM) and where its figures are; exit 130."""
    # Written by this run (`write_results`), not a file an earlier one left under that name?
    kept = f"; what was measured is in {json_path}" if str(json_path) in WRITTEN else ""
    print(f"{script}: stopped{kept}", file=sys.stderr)
    return 130


def run_script(script: str, main: Callable[[], int]) -> int:
    """Run a benchmark's `main`; a Ctrl-C ends it with one line and exit 130, not a traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        return stopped(script, None)


def run_once(flags: list[str], seconds: float, warmup: float, status: float) -> dict:
    """One timed run of main.py; returns frames/s and peak memory per role.

    main.py is stopped however this ends (Ctrl-C, an error): it runs in a process group of
    its own, which a terminal's Ctrl-C does not reach.

    Raises:
        RuntimeError: main.py gave too few status lines (it failed, or the run was too short).
    """
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "main.py", *flags, "--status-interval", str(status),
            "--save-model-dir", tmp, "--log-dir", tmp,
        ]  # fmt: skip
        # A process group of its own (the stop below signals it), but this session: Linux's
        # autogroup shares the CPU fairly between sessions, so main.py in a session of its
        # own would hold its test process's share apart from the Ray workers' a cluster run
        # has (`bench_cluster_overhead.py` starts them from this session), and --test-niceness
        # would no longer weigh it against them.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            process_group=0, preexec_fn=stopped_with(os.getpid()),
        )  # fmt: skip
        lines, reader = read_in_background(proc)
        peak_rss: dict[str, float] = {}
        peak_gpu: dict[str, float] = {}
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                processes = group_processes(proc.pid)
                gpu = gpu_memory_mib()
                for pid, cmdline in processes.items():
                    who = role(cmdline)
                    peak_rss[who] = max(peak_rss.get(who, 0.0), rss_mib(pid))
                    if pid in gpu:
                        peak_gpu[who] = max(peak_gpu.get(who, 0.0), gpu[pid])
                time.sleep(1.0)
        finally:
            stopped_itself = stop_group(proc, timeout=60)
        reader.join(timeout=10)
    last = "".join(lines).strip().splitlines()[-1:] or ["(nothing on stderr)"]
    if stopped_itself:
        raise RuntimeError(
            f"main.py stopped by itself before the {seconds:g} s were over (exit code "
            f"{proc.returncode}; its last line: {last[0]})"
        )
    steady = steady_frames_per_s("".join(lines), warmup)
    if steady is None:
        raise RuntimeError(
            f"main.py gave too few status lines after the warm-up (exit code {proc.returncode}; "
            f"its last line: {last[0]})"
        )
    frames_per_s, window = steady
    return {
        "frames_per_s": frames_per_s,
        "window_s": window,
        "peak_rss_mib": {k: round(v) for k, v in sorted(peak_rss.items())},
        "peak_gpu_mib": {k: round(v) for k, v in sorted(peak_gpu.items())},
    }


def main_py_flags(env: str, workers: int, gpu_ids: list[int], flags: list[str]) -> list[str]:
    """The main.py command line of one timed run (without its output folders)."""
    return ["--env", env, "--workers", str(workers), "--gpu-ids", *map(str, gpu_ids), *flags]


def main(argv: list[str] | None = None) -> int:
    """Run fast and reference side by side for each worker count; print and save."""
    p = argparse.ArgumentParser(description="main.py training throughput, fast vs reference.")
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--gpu-ids", type=int, nargs="+", default=[-1])
    p.add_argument("--seconds", type=float, default=120, help="length of each run")
    p.add_argument("--warmup", type=float, default=30, help="seconds left out at the start")
    p.add_argument("--status-interval", type=float, default=5)
    p.add_argument(
        "--modes", nargs="+", default=["fast"], help="modes run besides the reference path"
    )
    p.add_argument(
        "--no-reference", action="store_true", help="skip the reference run (no ratios then)"
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    output_file(p, "--json", args.json)
    positive(p, seconds=args.seconds, status_interval=args.status_interval)
    at_least(p, 0, warmup=args.warmup)
    at_least(p, 1, workers=min(args.workers))
    if args.seconds <= args.warmup + 2 * args.status_interval:
        print(
            f"bench_training.py: error: --seconds {args.seconds:g} must exceed --warmup "
            f"{args.warmup:g} by two --status-interval ({args.status_interval:g} s each)",
            file=sys.stderr,
        )
        return 2

    modes: dict[str, list[str]] = {}
    for mode in [*args.modes, *([] if args.no_reference else ["reference"])]:
        try:
            modes[mode] = mode_flags(mode)
        except ValueError as err:
            print(f"bench_training.py: error: {err}", file=sys.stderr)
            return 2
        for workers in args.workers:
            refusal = main_py_refusal(main_py_flags(args.env, workers, args.gpu_ids, modes[mode]))
            if refusal is not None:
                print(f"bench_training.py: error: mode {mode}: {refusal}", file=sys.stderr)
                return 2
    with stop_signals():
        try:
            return measure(args, modes)
        except KeyboardInterrupt:
            return stopped("bench_training.py", args.json)


def measure(args: argparse.Namespace, modes: dict[str, list[str]]) -> int:
    """Every mode's run for each worker count, printed and saved as it goes."""
    results: list[dict] = []
    for workers in args.workers:
        row: dict = {"env": args.env, "workers": workers, "gpu_ids": args.gpu_ids, "modes": {}}
        results.append(row)
        for mode, flags in modes.items():
            command = main_py_flags(args.env, workers, args.gpu_ids, flags)
            try:
                run = run_once(command, args.seconds, args.warmup, args.status_interval)
            except RuntimeError as err:
                print(f"bench_training.py: error: mode {mode}: {err}", file=sys.stderr)
                return 1
            row["modes"][mode] = {**run, "flags": " ".join(flags)}
            if args.json:  # after every run: a failure later keeps what was measured
                write_results(results, args.json)
        reference = row["modes"].get("reference")
        for result in row["modes"].values():
            if reference is not None:
                result["speedup"] = result["frames_per_s"] / reference["frames_per_s"]
        if args.json:  # with the speed-ups: a later worker count may fail
            write_results(results, args.json)
        for mode, result in row["modes"].items():
            ratio = f", {result['speedup']:.2f}x the reference" if "speedup" in result else ""
            print(
                f"{args.env} workers {workers} {mode}: {result['frames_per_s']:.0f} frames/s"
                f"{ratio}; peak RSS {result['peak_rss_mib']} MiB; "
                f"GPU {result['peak_gpu_mib'] or '-'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
