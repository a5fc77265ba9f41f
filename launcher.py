"""The launcher: starts the test process and the workers, supervises them, saves at the stop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from checkpoint import RunPaths, TrainingState, cpu_state_dict, save_atomic, untrained
from cli import TrainConfig, as_dict
from environment import EnvSpec, frames_per_step, make_env
from model import build_model
from monitor import RunMonitor
from run_folder import RunPlan
from shared_optim import make_optimizer
from test import TestStart, test
from train import train
from utils import (
    FATAL_EXIT,
    ProcessContext,
    ProcessStart,
    ReportChannels,
    UsageError,
    count_of,
    format_elapsed,
    sigint_ignored,
    signal_handled,
)
from visualize import plot_curve


@dataclass(frozen=True)
class SharedModel:
    """The model and optimizer that every process of the run updates, in shared memory."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None  # None: each worker steps an optimizer of its own
    observation_shape: tuple[int, ...]


def share_model(
    config: TrainConfig,
    spec: EnvSpec,
    slots: int,
    load: Callable[[nn.Module, torch.optim.Optimizer | None], None] | None = None,
) -> SharedModel:
    """Build the model (seeded by ``--seed``) and the optimizer, `load` them, share their memory.

    `slots` are the optimizer's step slots; 0 builds none (a cluster's driver). `load` runs
    before the sharing, since loading optimizer statistics replaces its tensors.
    """
    env = make_env(spec)
    observation_space, action_space = env.observation_space, env.action_space
    env.close()
    torch.manual_seed(config.seed)
    model = build_model(observation_space, action_space, config.hidden_size)
    optimizer = None
    if config.shared_optimizer and slots:
        optimizer = make_optimizer(
            model.parameters(), config.optimizer, config.lr, config.amsgrad, slots
        )
    if load is not None:
        load(model, optimizer)
    model.share_memory()
    if optimizer is not None:
        optimizer.share_memory()
    return SharedModel(model, optimizer, observation_space.shape)


@dataclass(frozen=True)
class Child:
    """One process the launcher supervises: training worker `rank`, or the test process (None)."""

    rank: int | None = None

    @property
    def title(self) -> str:
        """The process title (``Train Agent: <rank>`` or ``Test Agent``, as the original)."""
        return "Test Agent" if self.rank is None else f"Train Agent: {self.rank}"


class Launcher:
    """Starts the test process and the workers, supervises them, restarts the dead, shuts down."""

    JOIN_SECONDS = 10.0
    POLL_SECONDS = 0.25
    RESTART_LIMIT = 3
    RESTART_WINDOW = 600.0

    def __init__(
        self,
        config: TrainConfig,
        spec: EnvSpec,
        shared: SharedModel,
        plan: RunPlan | None,
        workers: int | None = None,
        extra_slots: int = 0,
    ):
        """Hold what the children get; nothing starts and no file is written until `run`.

        Without a `plan` (a cluster node's pool) it writes no file and starts no test process.
        `workers` defaults to ``--workers``; `extra_slots` count steps taken elsewhere.
        """
        self.test_process = plan is not None
        self.workers = config.workers if workers is None else workers
        self.on_poll: Callable[[], None] | None = None  # cluster.py's hooks
        self.before_shutdown: Callable[[], None] | None = None
        self.config = config
        self.spec = spec
        self.shared_model, self.optimizer = shared.model, shared.optimizer
        self.resumed = resumed = None if plan is None else plan.state
        self.tensorboard_dir = "" if plan is None else plan.tensorboard_dir
        self.earlier_logs = None if plan is None else plan.earlier_logs
        # A cluster node's paths only name, in its monitor, files that it never writes.
        self.paths = plan.paths if plan else RunPaths.of(config.env, config.log_dir, "", "", False)
        self.log_dir = str(Path(config.log_dir).resolve())  # now: the cwd may be gone by a save
        self.log = logging.getLogger("a3g.main")
        self.stop_reason = ""
        self.failed = False
        self.final_saved = True
        self.state_saved = True
        self.stopped_untrained: bool | None = None  # `trained_nothing`, fixed when the stop came

        self.mp = mp.get_context("spawn")  # always: CPU and GPU runs behave the same
        slots = max(self.workers, 1) + extra_slots  # extra: a cluster's other nodes' steps
        self.ctx = ProcessContext.create(self.mp, config.max_steps, slots, resumed)
        self.channels = ReportChannels(self.mp)
        self.children = [
            *([Child(None)] if self.test_process else []),
            *(Child(rank) for rank in range(self.workers)),
        ]
        self.processes: dict[Child, BaseProcess] = {}
        self.resumed_steps = 0 if resumed is None else resumed.steps  # a cluster node sets its own
        self.starts: dict[Child, int] = {}  # each child's starts so far, for its seeds
        self.deaths: dict[Child, list[float]] = {}
        self.pending_causes: dict[str, tuple[str, str]] = {}
        self._signals = 0
        self.next_state_save = time.monotonic() + config.state_interval
        self.monitor = RunMonitor(
            config,
            self.shared_model,
            shared.observation_shape,
            frames_per_step(config.env, config.frame_skip),
            self.ctx,
            self.log,
            self.paths,
            self.tensorboard_dir,
        )
        if resumed is not None:
            self.monitor.restore(resumed)
        # <env>.dat's score as the last state save wrote it (or tried to: no retry every poll).
        self.state_dat_score = self.monitor.dat_score

    def drain_reports(self, child: Child | None = None) -> None:
        """Take the reports that have arrived (all, or `child`'s): errors kept, others monitored."""
        for sender, kind, payload in self.channels.receive(child):
            if kind == "error":
                self.pending_causes[sender.title] = (payload["cause"], payload["traceback"])
            else:
                self.monitor.take(kind, payload)

    def training_state(self) -> TrainingState:
        """The run as it stands, for the state file."""
        self.drain_reports()
        return TrainingState(
            model=cpu_state_dict(self.shared_model),
            optimizer=None if self.optimizer is None else self.optimizer.state_dict(),
            steps=self.ctx.total_steps(),
            frames=self.monitor.frames,
            elapsed=time.time() - self.ctx.start_time,
            skipped_updates=self.ctx.total_skipped(),
            test_rewards=list(self.monitor.rewards),
            training_games=list(self.monitor.training_games),
            worker_normalizers=dict(self.monitor.worker_normalizers),
            test_normalizer=self.monitor.test_normalizer,
            tensorboard_dir=self.tensorboard_dir,
            config=as_dict(self.config),
            saved_at=time.time(),
            # Without --save-max every game replaces <env>.dat: a score saved here goes stale.
            dat_score=self.monitor.dat_score if self.config.save_max else None,
            dat_trained=self.monitor.dat_trained if self.config.save_max else None,
            log_dir=self.log_dir,
        )

    def save_state(self) -> bool:
        """Write the training-state file atomically (a failure is logged); whether it was."""
        state = self.training_state()
        self.state_dat_score = state.dat_score
        try:
            state.save(self.paths.state)
        except OSError as err:
            self.log.error(
                f"could not save the training state {self.paths.state} ({err}); "
                "the previous file is kept"
            )
            return False
        return True

    def state_due(self) -> bool:
        """Whether to write the training state: every ``--state-interval``, and at a new best."""
        if self.config.state_interval <= 0 or self.trained_nothing():
            return False
        # A resume's --save-max bar comes from the state: a stale one lets a worse game win.
        new_best = self.config.save_max and self.monitor.dat_score != self.state_dat_score
        return new_best or time.monotonic() >= self.next_state_save

    def process_target(self, child: Child, ctx: ProcessContext) -> tuple[Any, tuple]:
        """The entry point and arguments of `child`'s next start, with the latest normalisers."""
        monitor = self.monitor
        start = ProcessStart(self.resumed_steps, self.starts.get(child, 0))
        if child.rank is None:
            begin = TestStart(
                self.config, self.spec, self.paths, self.tensorboard_dir, tuple(monitor.rewards),
                monitor.test_normalizer, monitor.dat_score, self.ctx.total_steps(), start,
            )  # fmt: skip
            return test, (begin, self.shared_model, ctx)
        return train, (
            child.rank, self.config, self.spec, self.shared_model, self.optimizer, ctx,
            monitor.worker_normalizers.get(child.rank), start,
        )  # fmt: skip

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        if self._signals == 1:  # a run already stopping (its budget reached) keeps its reason
            self.stop_reason = self.stop_reason or f"{signal.Signals(signum).name} received"
            self.latch_untrained()  # before the workers hear of it
            self.ctx.request_stop()

    def start(self) -> None:
        """Start the test process and the workers."""
        for child in self.children:
            self._start(child)

    def _start(self, child: Child) -> None:
        """Start (or restart) one child, SIGINT ignored in it from the start (`sigint_ignored`)."""
        ctx = self.channels.open(child, self.ctx, -1 if child.rank is None else child.rank)
        target, args = self.process_target(child, ctx)
        proc = self.mp.Process(target=target, args=args, name=child.title, daemon=False)
        with sigint_ignored():
            proc.start()
        self.starts[child] = self.starts.get(child, 0) + 1
        self.channels.started(ctx)
        self.processes[child] = proc

    def supervise(self) -> None:
        """Wait until a signal, the step budget, the workers' end or a failure; restart the dead."""
        budget = f"--max-steps {self.config.max_steps} reached"
        while not self.ctx.stopping():
            for child, proc in list(self.processes.items()):
                if proc.exitcode not in (None, 0) and not self._handle_death(child, proc):
                    return
            workers = [p for child, p in self.processes.items() if child.rank is not None]
            if workers and all(p.exitcode == 0 for p in workers):
                self.stop_reason = budget if self.ctx.budget_reached() else "all workers finished"
                return
            if self.ctx.budget_reached() and not self.stop_reason:
                self.stop_reason = budget
            if self.on_poll is not None:
                self.on_poll()
            if self.ctx.budget_reached() and not self.workers:  # none here to finish it
                self.stop_reason = budget
                return
            self.drain_reports()
            if self.test_process:
                if self.state_due():
                    self.save_state()
                    self.next_state_save = time.monotonic() + self.config.state_interval
                self.monitor.tick()
            time.sleep(self.POLL_SECONDS)

    def _handle_death(self, child: Child, proc: BaseProcess) -> bool:
        """Report a dead child and restart it; False when the run must stop instead."""
        self.drain_reports(child)  # to the end of its pipe: its error report, its last numbers
        code = proc.exitcode or 0
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        cause, trace = self.pending_causes.pop(
            child.title, ("no error report (it died without raising)", "")
        )
        if trace:
            self.log.error(f"{child.title} traceback:\n{trace.rstrip()}")
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(child, []) if now - t < self.RESTART_WINDOW] + [now]
        self.deaths[child] = deaths
        what = f"{child.title} (pid {proc.pid}) died: {how}; {cause}"
        if code == FATAL_EXIT:
            self.stop_reason = what
        elif len(deaths) > self.RESTART_LIMIT:
            self.stop_reason = (
                f"{what}; it died {len(deaths)} times in {self.RESTART_WINDOW / 60:.0f} minutes, "
                "so the run stops"
            )
        else:
            self.log.warning(f"{what}; restarting it with the latest weights")
            self._start(child)
            return True
        self.failed = True
        return False

    def trained_nothing(self) -> bool:
        """Whether this is a fresh run stopped before its first step: no random weights saved."""
        if self.stopped_untrained is not None:
            return self.stopped_untrained
        trains_here = self.test_process and self.workers > 0
        return trains_here and untrained(self.config.load, self.ctx.total_steps())

    def latch_untrained(self) -> None:
        """Fix `trained_nothing`'s answer as the stop comes (the first signal, or shutdown)."""
        if self.stopped_untrained is None:
            self.stopped_untrained = self.trained_nothing()

    def shutdown(self) -> None:
        """Stop every child, then save the latest weights and the training state."""
        self.latch_untrained()
        self.ctx.request_stop()  # whatever ended supervision: all say the run is stopping
        then = "nothing trained to save" if self.trained_nothing() else "the files are saved next"
        self.log.info(f"{STOPPING}{self.stop_reason or 'done'}; {then}")
        if self.before_shutdown is not None:
            try:
                self.before_shutdown()  # a cluster's driver: the nodes' last exchanges
            except Exception as err:  # the weights already pulled are still saved
                self.log.error(f"stopping the cluster failed: {type(err).__name__}: {err}")
        self.stop_children()
        if self.trained_nothing():
            self.log.info(
                "nothing was trained before the stop: no weights or training state written to "
                f"{self.config.save_model_dir}"
            )
            return
        try:
            save_atomic(cpu_state_dict(self.shared_model), self.paths.final_model)
        except OSError as err:
            self.log.error(
                f"could not save {self.paths.final_model} ({err}); the previous file is kept"
            )
            self.final_saved = False
        self.state_saved = self.save_state()

    def stop_children(self) -> None:
        """Ask every child to stop and wait for it (terminate, then kill, the slow ones)."""
        self.ctx.request_stop()
        deadline = time.monotonic() + self.JOIN_SECONDS
        while time.monotonic() < deadline and any(p.is_alive() for p in self.processes.values()):
            self.drain_reports()  # a child blocked on a full pipe would never exit
            time.sleep(0.05)
        # The slow ones all at once: a few seconds in all, not a few per child.
        slow = {child: proc for child, proc in self.processes.items() if proc.is_alive()}
        if slow:  # one line: 32 children still starting when a Ctrl-C came are one event
            named = ", ".join(f"{child.title} (pid {proc.pid})" for child, proc in slow.items())
            them = "it" if len(slow) == 1 else "them"
            self.log.warning(f"{named} did not stop in time; terminating {them}")
        # SIGTERM, then SIGKILL. 10 s: one stuck in the kernel (a hung GPU driver) may not go.
        for end, seconds in ((BaseProcess.terminate, 3.0), (BaseProcess.kill, 10.0)):
            for proc in slow.values():
                if proc.is_alive():
                    end(proc)
            deadline = time.monotonic() + seconds
            for proc in slow.values():
                proc.join(max(0.0, deadline - time.monotonic()))
        for child, proc in slow.items():
            if proc.is_alive():
                self.log.error(
                    f"{child.title} (pid {proc.pid}) did not exit after SIGKILL; saving anyway"
                )
        self.drain_reports()
        for title, (cause, _) in self.pending_causes.items():
            self.log.error(f"{title} also failed: {cause}")

    def weights_left(self) -> set[Path]:
        """The files of weights this run left, for its record to name (`RunMonitor.close`)."""
        if self.trained_nothing():  # nothing saved: no test game saves untrained weights
            return set()
        left = {self.paths.final_model, self.paths.state}
        # Under --save-max, <env>.dat is this run's only where its score is known.
        if not self.config.save_max or self.monitor.dat_score is not None:
            left.add(self.paths.model)
        return left

    def write_curve(self) -> None:
        """The training curve PNG beside the log, when the run had test games."""
        if not self.monitor.rewards:
            return
        try:
            plot_curve(self.paths.log, self.paths.curve)
        except (UsageError, OSError) as err:
            self.log.warning(f"no training curve: {err}")
        else:
            self.log.info(f"training curve in {self.paths.curve}")

    def signals_caught(self) -> contextlib.AbstractContextManager[None]:
        """SIGINT and SIGTERM stop the run (`_on_signal`) inside, as they did before outside."""
        return signal_handled(self._on_signal, signal.SIGINT, signal.SIGTERM)

    def run(self) -> int:
        """Start, supervise, shut down; returns the exit code (`main`'s)."""
        with self.signals_caught():  # from the first moment: a Ctrl-C always stops and saves
            return self._run()

    def open_record(self) -> None:
        """Start the run record and TensorBoard (`RunMonitor.open`), once, before any child.

        Raises:
            UsageError: they cannot be written (a full disk); nothing has started.
        """
        if self.monitor.record:
            return
        paths, resumed, earlier = self.paths, self.resumed is not None, self.earlier_logs
        try:
            self.monitor.open(
                resumed_from=str(paths.load_state) if resumed else None,
                weights_from=str(paths.load_model) if self.config.load and not resumed else None,
                earlier_record=None if earlier is None else earlier / paths.record.name,
            )
        except OSError as err:
            raise UsageError(
                f"cannot start the run record {self.paths.record} or TensorBoard under "
                f"{self.config.log_dir} ({err}); free space there or pick another --log-dir"
            ) from None

    def _run(self) -> int:
        self.open_record()
        cores = os.cpu_count() or 1
        if self.workers > cores:
            self.log.warning(
                f"{self.config.workers} workers on {cores} CPU cores: they will share cores and "
                f"each run slower; --workers {cores} is usually faster"
            )
        try:
            if not self.ctx.stopping():  # a cluster's nodes started, then a signal: none here
                self.start()
            gpu_ids = self.config.gpu_ids
            where = "CPU" if list(gpu_ids) == [-1] else "GPU " + ", ".join(map(str, gpu_ids))
            self.log.info(
                f"training {self.config.env} with {count_of(self.config.workers, 'worker')}"
                + ("" if self.workers else " per node")
                + f" on {where}; Ctrl-C stops and saves"
            )
            self.supervise()
        except Exception as err:  # a bug, or an engine's error (Ray's): saved and recorded still
            self.log.exception(f"the launcher failed: {type(err).__name__}: {err}; stopping")
            self.failed = True
            self.stop_reason = f"the launcher failed: {type(err).__name__}: {err}"
        finally:
            self.shutdown()
        # A final save that failed lost data: scripts must see it, though nothing crashed.
        exit_code = 1 if self.failed or not (self.final_saved and self.state_saved) else 0
        try:
            self.monitor.close(self.stop_reason or "done", exit_code, sorted(self.weights_left()))
        except OSError as err:
            self.log.error(f"could not complete the run record {self.paths.record} ({err})")
            exit_code = 1
        self.write_curve()
        if self.trained_nothing():
            saved = "nothing saved (untrained when the stop came)"
        elif self.final_saved:
            saved = f"model saved to {self.paths.final_model}"
        else:
            saved = f"model NOT saved to {self.paths.final_model} (see the error above)"
        if not self.state_saved:
            saved += f"; training state NOT saved to {self.paths.state} (see the error above)"
        elapsed = format_elapsed(time.time() - self.ctx.start_time)
        self.log.log(
            logging.ERROR if exit_code else logging.INFO,
            f"stopped: {self.stop_reason or 'done'}; {self.ctx.total_steps()} steps in "
            f"{elapsed}; {saved}",
        )
        return exit_code


# Begins the shutdown's line: later status lines make no frames (the benchmarks stop there).
STOPPING = "stopping: "
