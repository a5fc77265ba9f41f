"""A3G launcher: parse the configuration once, build and share the model, start the processes."""

from __future__ import annotations

import argparse
import logging
import math
import os
import queue
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from environment import frames_per_step, make_env
from model import build_model
from test import cpu_state_dict, log_file, test
from train import make_optimizer, train
from utils import (
    FATAL_EXIT,
    STATE_FORMAT,
    OneLineParser,
    ProcessContext,
    RunMonitor,
    UsageError,
    check_state_dict,
    checkpoint_path,
    env_file_stem,
    format_elapsed,
    load_training_state,
    load_weights,
    read_config,
    require_at_least,
    save_atomic,
)
from visualize import plot_curve

DEFAULT_ENV = "PongNoFrameskip-v4"


def build_parser() -> argparse.ArgumentParser:
    """The training command line: the original A3G's flags (same names and defaults) and ours."""
    p = OneLineParser(
        description="A3G: train an A3C-LSTM agent with Hogwild workers on CPUs and GPUs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--lr", "-l", type=float, default=0.0001, help="learning rate")
    p.add_argument("--entropy-coef", "-ec", type=float, default=0.01, help="entropy bonus weight")
    p.add_argument(
        "--value-coef",
        "-vc",
        type=float,
        default=0.5,
        help="value loss weight (0.5 reproduces the original)",
    )
    p.add_argument("--gamma", "-g", type=float, default=0.99, help="discount factor")
    p.add_argument("--tau", "-t", type=float, default=1.00, help="GAE lambda")
    p.add_argument(
        "--seed", "-s", type=int, default=1, help="random seed; worker RANK uses seed + RANK"
    )
    p.add_argument("--workers", "-w", type=int, default=32, help="training processes")
    p.add_argument(
        "--num-steps", "-ns", type=int, default=20, help="forward steps per update (n-step)"
    )
    p.add_argument(
        "--max-episode-length",
        "-mel",
        type=int,
        default=10000,
        help="agent steps before an episode is cut",
    )
    p.add_argument("--env", "-ev", default=DEFAULT_ENV, help="gymnasium environment id")
    p.add_argument(
        "--shared-optimizer",
        "-so",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="optimizer statistics shared by all workers (--no-shared-optimizer: one per worker)",
    )
    p.add_argument(
        "--load", "-ld", action="store_true", help="start from <load-model-dir><env>.dat"
    )
    p.add_argument(
        "--save-max",
        "-sm",
        action="store_true",
        help="save only when a test score matches or beats the best so far",
    )
    p.add_argument(
        "--optimizer", "-o", default="Adam", choices=["Adam", "RMSprop"], help="optimizer"
    )
    p.add_argument(
        "--load-model-dir", "-lmd", default="trained_models/", help="folder --load reads from"
    )
    p.add_argument(
        "--save-model-dir",
        "-smd",
        default="trained_models/",
        help="folder the test process saves <env>.dat to",
    )
    p.add_argument("--log-dir", "-lg", default="logs/", help="folder of <env>_log")
    p.add_argument(
        "--gpu-ids",
        "-gp",
        type=int,
        nargs="+",
        default=[-1],
        help="GPU ids to spread workers over; -1 = CPU only",
    )
    p.add_argument("--amsgrad", "-a", action="store_true", help="AMSGrad variant of Adam")
    p.add_argument("--skip-rate", type=int, default=4, help="frame skip (NoFrameskip ids)")
    p.add_argument("--hidden-size", "-hs", type=int, default=512, help="LSTM hidden size")
    p.add_argument("--tensorboard-logger", "-tl", action="store_true", help="log to TensorBoard")
    p.add_argument(
        "--env-config", "-evc", default="config.json", help="per-game crop settings (JSON)"
    )
    p.add_argument(
        "--distributed-step-size",
        "-dss",
        type=int,
        nargs="+",
        default=[],
        help="n-step sizes dealt round-robin to workers (overrides --num-steps)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many agent steps summed over workers (0 = until Ctrl-C)",
    )
    p.add_argument(
        "--test-interval",
        type=float,
        default=60.0,
        help="seconds the test process waits between evaluation games",
    )
    p.add_argument(
        "--test-niceness",
        type=int,
        default=10,
        help="scheduling niceness of the test process (0-19): with every core busy, higher "
        "leaves more CPU to the workers and plays test games more slowly; 0 when test games "
        "must keep up (e.g. --save-max with a short --test-interval)",
    )
    p.add_argument(
        "--status-interval",
        type=float,
        default=20.0,
        help="seconds between status lines and TensorBoard training scalars (0 = no lines)",
    )
    p.add_argument(
        "--reward-scale",
        type=float,
        default=1.0,
        help="multiply the clipped training rewards by this; below 1 keeps values small "
        "on dense-reward envs (CartPole: 0.1)",
    )
    p.add_argument(
        "--fast-path",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="act without autograd in channels_last, recording the conv activations, then "
        "backpropagate the rollout at once with the fused LSTM op (same losses and gradients); "
        "--no-fast-path computes the original's way",
    )
    p.add_argument(
        "--state-interval",
        type=float,
        default=300.0,
        help="seconds between writes of the training-state file <env>_state.pt (optimizer "
        "statistics, counters, normalisers; what --load resumes from); 0 = only at shutdown",
    )
    p.add_argument(
        "--vector-obs-norm",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="standardise vector observations (CartPole-like envs) with running statistics",
    )
    return p


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Reject values that cannot work, naming the value and the fix.

    Raises:
        UsageError: on the first bad value.
    """
    positive_ints = {
        "--workers": args.workers,
        "--num-steps": args.num_steps,
        "--max-episode-length": args.max_episode_length,
        "--skip-rate": args.skip_rate,
        "--hidden-size": args.hidden_size,
    }
    for flag, value in positive_ints.items():
        require_at_least(flag, value)
    if args.max_steps < 0:
        raise UsageError(f"--max-steps must be 0 (no limit) or more, got {args.max_steps}")
    if not (math.isfinite(args.test_interval) and args.test_interval >= 0):
        raise UsageError(f"--test-interval must be 0 or more seconds, got {args.test_interval}")
    if not 0 <= args.test_niceness <= 19:
        raise UsageError(f"--test-niceness must be in 0..19, got {args.test_niceness}")
    for size in args.distributed_step_size:
        if size < 1:
            raise UsageError(f"--distributed-step-size values must be at least 1, got {size}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    for flag, value in (("--gamma", args.gamma), ("--tau", args.tau)):
        if not 0 < value <= 1:
            raise UsageError(f"{flag} must be in (0, 1], got {value}")
    for flag, value in (("--entropy-coef", args.entropy_coef), ("--value-coef", args.value_coef)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} must be a non-negative number, got {value}")
    if not (math.isfinite(args.state_interval) and args.state_interval >= 0):
        raise UsageError(f"--state-interval must be 0 or more seconds, got {args.state_interval}")
    if not (math.isfinite(args.status_interval) and args.status_interval >= 0):
        raise UsageError(f"--status-interval must be 0 or more seconds, got {args.status_interval}")
    if not (math.isfinite(args.reward_scale) and args.reward_scale > 0):
        raise UsageError(f"--reward-scale must be a positive number, got {args.reward_scale}")
    if -1 in args.gpu_ids and len(args.gpu_ids) > 1:
        raise UsageError(
            f"--gpu-ids mixes -1 (CPU) with GPU ids {args.gpu_ids}; give only GPU ids, or -1"
        )
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line."""
    return validate_args(build_parser().parse_args(argv))


def check_gpus(gpu_ids: list[int]) -> None:
    """Reject GPU ids that do not exist here.

    Raises:
        UsageError: CUDA is unavailable, or an id is out of range.
    """
    if gpu_ids == [-1]:
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


def check_writable(folder: str, flag: str) -> None:
    """Create `folder` if needed and make sure files can be written there."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UsageError(
            f"{flag} {folder!r} is not writable ({err.strerror}); choose a folder you can write"
        ) from None


# ----------------------------------------------------------------------------------------------
# Launch and supervision
# ----------------------------------------------------------------------------------------------


class Launcher:
    """Builds the shared model and optimizer, starts the processes and drives the shutdown."""

    JOIN_SECONDS = 10.0
    POLL_SECONDS = 0.25

    def __init__(self, args: argparse.Namespace):
        """Prepare everything that can fail on bad input, before any process starts."""
        self.args = args
        self.log = logging.getLogger("a3g.main")
        self.stop_reason = ""
        self.failed = False
        self.final_saved = True
        check_gpus(args.gpu_ids)
        config = read_config(args.env_config)
        env = make_env(args.env, config, args)
        self.observation_space, self.action_space = env.observation_space, env.action_space
        env.close()
        check_writable(args.save_model_dir, "--save-model-dir")
        check_writable(args.log_dir, "--log-dir")
        self.save_path = checkpoint_path(args.save_model_dir, args.env)
        self.final_path = (
            checkpoint_path(args.save_model_dir, args.env, "_last.dat")
            if args.save_max
            else self.save_path
        )
        args.tensorboard_dir = str(
            Path(args.log_dir)
            / "runs"
            / f"{env_file_stem(args.env)}_{time.strftime('%Y%m%d-%H%M%S')}"
        )

        self.state_path = checkpoint_path(args.save_model_dir, args.env, "_state.pt")

        torch.manual_seed(args.seed)
        self.shared_model = build_model(self.observation_space, self.action_space, args)
        self.optimizer = None
        if args.shared_optimizer:
            self.optimizer = make_optimizer(self.shared_model.parameters(), args)
        self.resumed: dict[str, Any] = {}
        if args.load:
            self.resumed = self._load()
        self.shared_model.share_memory()
        if self.optimizer is not None:
            self.optimizer.share_memory()

        self.mp = mp.get_context("spawn")  # always: CPU and GPU runs behave the same
        self.ctx = ProcessContext.create(
            self.mp,
            args.max_steps,
            steps=int(self.resumed.get("steps", 0)),
            elapsed=float(self.resumed.get("elapsed", 0.0)),
            skipped=int(self.resumed.get("skipped_updates", 0)),
        )
        self.processes: dict[str, mp.process.BaseProcess] = {}
        self.deaths: dict[str, list[float]] = {}
        self.pending_causes: dict[str, tuple[str, str]] = {}
        self._signals = 0
        self.next_state_save = time.monotonic() + args.state_interval
        self.monitor = RunMonitor(
            args,
            self.shared_model,
            self.observation_space.shape,
            frames_per_step(args.env, args),
            self.ctx,
            self.log,
            checkpoint_path(args.log_dir, args.env, "_run.json"),
            resumed_from=self.resumed.get("path"),
        )
        if self.resumed:
            self.monitor.restore(
                self.resumed.get("test_rewards", []), self.resumed.get("normalizers", {})
            )
        self.specs = self.child_specs(
            self.resumed.get("normalizers", {}), self.resumed.get("test", {})
        )

    def _load(self) -> dict[str, Any]:
        """``--load``: resume from the training state if there is one, else load the weights.

        Returns:
            The training state resumed from, or an empty dict when only weights were loaded.
        """
        args = self.args
        state_path = checkpoint_path(args.load_model_dir, args.env, "_state.pt")
        if not state_path.is_file():
            load_path = checkpoint_path(args.load_model_dir, args.env)
            load_weights(self.shared_model, load_path)
            self.log.info(
                f"loaded the weights alone from {load_path} (no training state {state_path}: "
                "optimizer statistics, step counts and normalisers start afresh)"
            )
            return {}
        state = load_training_state(state_path)
        saved = state.get("config", {})
        if saved.get("env") != args.env:
            raise UsageError(
                f"training state {str(state_path)!r} is for --env {saved.get('env')}, not "
                f"{args.env}; pass the same --env, or another --load-model-dir"
            )
        for flag, key in (("--optimizer", "optimizer"), ("--amsgrad", "amsgrad")):
            if self.optimizer is not None and key in saved and saved[key] != getattr(args, key):
                raise UsageError(
                    f"training state {str(state_path)!r} was saved with {flag} {saved[key]}, "
                    f"this run has {getattr(args, key)}: resume with the same {flag}"
                )
        self.shared_model.load_state_dict(
            check_state_dict(self.shared_model, state.get("model"), state_path)
        )
        if self.optimizer is not None and state.get("optimizer") is not None:
            try:
                changed = self.optimizer.load_statistics(state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise UsageError(
                    f"training state {str(state_path)!r}: optimizer statistics do not fit "
                    f"--optimizer {args.optimizer} ({err}); pass the optimizer it was saved with"
                ) from None
            for key, (saved_value, value) in changed.items():
                self.log.info(
                    f"resume: optimizer {key} was {saved_value} in the training state; "
                    f"this run uses {value} (from the command line)"
                )
        if state.get("tensorboard_dir"):
            args.tensorboard_dir = state["tensorboard_dir"]
        self.log.info(
            f"resumed from {state_path}: step {state.get('steps', 0):,}, "
            f"{format_elapsed(state.get('elapsed', 0.0))} trained, "
            f"{len(state.get('test_rewards', []))} test games"
            + ("" if self.optimizer is None else ", optimizer statistics restored")
        )
        return {**state, "path": str(state_path)}

    def save_state(self) -> None:
        """Write the training-state file atomically; a failure is logged and the old file kept."""
        self.monitor.drain()
        state = {
            "format": STATE_FORMAT,
            "model": cpu_state_dict(self.shared_model),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "steps": self.ctx.total_steps(),
            "frames": self.monitor.frames,
            "elapsed": time.time() - self.ctx.start_time,
            "skipped_updates": self.ctx.total_skipped(),
            "test_rewards": list(self.monitor.rewards),
            "test": dict(self.monitor.test_totals),
            "normalizers": dict(self.monitor.normalizers),
            "tensorboard_dir": self.args.tensorboard_dir,
            "config": {k: v for k, v in vars(self.args).items() if k != "tensorboard_dir"},
            "saved_at": time.time(),
        }
        try:
            save_atomic(state, self.state_path)
        except OSError as err:
            self.log.error(
                f"could not save the training state {self.state_path} ({err}); "
                "the previous file is kept"
            )

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        if self._signals == 1:
            self.stop_reason = f"{signal.Signals(signum).name} received"
            self.ctx.stop_event.set()

    def child_specs(
        self, normalizers: dict[str, Any], test_totals: dict[str, float]
    ) -> dict[str, tuple[Any, tuple]]:
        """Process name -> (entry point, arguments) for the test process and every worker.

        Args:
            normalizers: observation-normaliser statistics to continue from, by ``"test"``
                or the worker's rank as a string (empty for a fresh start).
            test_totals: the test process's ``games``, ``reward_total`` and ``best`` so far.
        """
        args = self.args
        specs: dict[str, tuple[Any, tuple]] = {
            "Test Agent": (
                test,
                (
                    args,
                    self.shared_model,
                    self.ctx,
                    {**test_totals, "normalizer": normalizers.get("test")},
                ),
            )
        }
        for rank in range(args.workers):
            specs[f"Train Agent: {rank}"] = (
                train,
                (
                    rank,
                    args,
                    self.shared_model,
                    self.optimizer,
                    self.ctx,
                    normalizers.get(str(rank)),
                ),
            )
        return specs

    def start(self) -> None:
        """Start the test process and the workers."""
        # Children inherit an ignored SIGINT, so a Ctrl-C during their start-up (before
        # their own setup runs) cannot raise KeyboardInterrupt in them either.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name in self.specs:
                self._start(name)
        finally:
            signal.signal(signal.SIGINT, previous)

    def _start(self, name: str) -> None:
        target, args = self.specs[name]
        proc = self.mp.Process(target=target, args=args, name=name, daemon=False)
        proc.start()
        self.processes[name] = proc

    RESTART_LIMIT = 3
    RESTART_WINDOW = 600.0

    def supervise(self) -> None:
        """Wait until a signal, the step budget, the workers' end or a failure; restart the dead.

        A child that dies is reported with its name, pid and cause, and started again (it
        takes the latest shared weights at its next rollout). A child that dies more than
        `RESTART_LIMIT` times within `RESTART_WINDOW` seconds, or fails with an error no
        restart can fix (exit code `FATAL_EXIT`), stops the run.
        """
        while not self.ctx.stop_event.is_set():
            for name, proc in list(self.processes.items()):
                if proc.exitcode not in (None, 0) and not self._handle_death(name, proc):
                    return
            workers = [p for n, p in self.processes.items() if n != "Test Agent"]
            if all(p.exitcode == 0 for p in workers):
                self.stop_reason = (
                    f"--max-steps {self.args.max_steps} reached"
                    if self.ctx.budget_reached()
                    else "all workers finished"
                )
                return
            if self.ctx.budget_reached() and not self.stop_reason:
                self.stop_reason = f"--max-steps {self.args.max_steps} reached"
            if self.args.state_interval > 0 and time.monotonic() >= self.next_state_save:
                self.save_state()
                self.next_state_save = time.monotonic() + self.args.state_interval
            self.monitor.tick()
            time.sleep(self.POLL_SECONDS)

    def _collect_errors(self) -> None:
        while True:
            try:
                title, cause, trace = self.ctx.errors.get(timeout=0.5)
            except queue.Empty:
                return
            self.pending_causes[title] = (cause, trace)

    def _handle_death(self, name: str, proc: mp.process.BaseProcess) -> bool:
        """Report a dead child and restart it; False when the run must stop instead."""
        self._collect_errors()
        code = proc.exitcode
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        cause, trace = self.pending_causes.pop(
            name, ("no error report (it died without raising)", "")
        )
        if trace:
            self.log.error(f"{name} traceback:\n{trace.rstrip()}")
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(name, []) if now - t < self.RESTART_WINDOW]
        deaths.append(now)
        self.deaths[name] = deaths
        what = f"{name} (pid {proc.pid}) died: {how}; {cause}"
        if code == FATAL_EXIT:
            self.failed = True
            self.stop_reason = what
            return False
        if len(deaths) > self.RESTART_LIMIT:
            self.failed = True
            self.stop_reason = (
                f"{what}; it died {len(deaths)} times in {self.RESTART_WINDOW / 60:.0f} minutes, "
                "so the run stops"
            )
            return False
        self.log.warning(f"{what}; restarting it with the latest weights")
        self.monitor.drain()  # its latest normaliser statistics, for the new process
        latest = self.child_specs(self.monitor.normalizers, self.monitor.test_totals)
        self.specs[name] = latest[name]
        self._start(name)
        return True

    def shutdown(self) -> None:
        """Stop every child, then save the latest weights and the training state."""
        self.ctx.stop_event.set()
        deadline = time.monotonic() + self.JOIN_SECONDS
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for name, proc in self.processes.items():
            if proc.is_alive():
                self.log.warning(f"{name} (pid {proc.pid}) did not stop in time; terminating it")
                proc.terminate()
                proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._collect_errors()
        for title, (cause, _) in self.pending_causes.items():
            self.log.error(f"{title} also failed: {cause}")
        try:
            save_atomic(cpu_state_dict(self.shared_model), self.final_path)
        except OSError as err:
            self.log.error(f"could not save {self.final_path} ({err}); the previous file is kept")
            self.final_saved = False
        self.save_state()

    def write_curve(self) -> None:
        """The training curve PNG beside the log, when the run had test games."""
        if not self.monitor.rewards:
            return
        out = checkpoint_path(self.args.log_dir, self.args.env, "_curve.png")
        try:
            plot_curve(log_file(self.args), out)
        except (UsageError, OSError) as err:
            self.log.warning(f"no training curve: {err}")
        else:
            self.log.info(f"training curve in {out}")

    def run(self) -> int:
        """Start, supervise, shut down; returns the exit code (0, or 1 if a child failed)."""
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        cores = os.cpu_count() or 1
        if self.args.workers > cores:
            self.log.warning(
                f"{self.args.workers} workers on {cores} CPU cores: they will share cores and "
                f"each run slower; --workers {cores} is usually faster"
            )
        try:
            self.start()
            self.log.info(
                f"training {self.args.env} with {self.args.workers} workers on "
                f"{describe_devices(self.args.gpu_ids)}; Ctrl-C stops and saves"
            )
            self.supervise()
        finally:
            self.shutdown()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        exit_code = 1 if self.failed else 0
        self.monitor.close(self.stop_reason or "done", exit_code)
        self.write_curve()
        steps = self.ctx.total_steps()
        message = (
            f"stopped: {self.stop_reason or 'done'}; {steps} steps in "
            f"{format_elapsed(time.time() - self.ctx.start_time)}; "
            + (
                f"model saved to {self.final_path}"
                if self.final_saved
                else f"model NOT saved to {self.final_path} (see the error above)"
            )
        )
        if self.failed:
            self.log.error(message)
        else:
            self.log.info(message)
        return exit_code


def describe_devices(gpu_ids: list[int]) -> str:
    """``CPU`` or ``GPU 0, 1``."""
    return "CPU" if gpu_ids == [-1] else "GPU " + ", ".join(map(str, gpu_ids))


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code (0 ok, 1 a process failed, 2 bad input)."""
    logging.basicConfig(format="%(asctime)s : %(message)s", level=logging.INFO)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        args = parse_args(argv)
        launcher = Launcher(args)
    except UsageError as err:
        print(f"main.py: error: {err}", file=sys.stderr)
        return 2
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
