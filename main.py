"""A3G launcher: parse the configuration once, build and share the model, start the processes."""

from __future__ import annotations

import signal
import sys

_INTERRUPTED_WHILE_IMPORTING: list[int] = []
# A Ctrl-C in the second or two the imports below take is noted, not raised inside them (where
# it could be lost, or leave numpy half-loaded); an inherited ignored SIGINT stays ignored.
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: _INTERRUPTED_WHILE_IMPORTING.append(signum))

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from checkpoint import (
    RunPaths,
    TrainingState,
    check_state_dict,
    cpu_state_dict,
    env_file_stem,
    hold_run_lock,
    load_weights,
    release_run_locks,
    save_atomic,
    untrained,
)
from cli import TrainConfig, as_dict, parse_train_args
from environment import (
    crop_settings,
    frames_per_step,
    make_env,
    protocol,
    saved_frame_skip,
    short_episode_warning,
    skip_bounds,
    skip_flags,
    skip_text,
)
from model import build_model
from monitor import RunMonitor
from shared_optim import make_optimizer, scheduled_lr
from test import test
from train import train
from utils import (
    FATAL_EXIT,
    INTERRUPTED_EXIT,
    ProcessContext,
    ProcessStart,
    ReportChannels,
    UsageError,
    check_gpus,
    check_precision,
    check_writable,
    count_of,
    format_elapsed,
    refuse_folders_named_as,
    run_script,
    sigint_ignored,
    sigterm_interrupts,
)
from visualize import RUN_ID, plot_curve

# ----------------------------------------------------------------------------------------------
# Wiring: check, build and share the model and optimizer, load, hand over to the launcher
# ----------------------------------------------------------------------------------------------


def resume_from(
    paths: RunPaths,
    config: TrainConfig,
    shared_model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    log: logging.Logger,
    cluster: bool = False,
) -> TrainingState | None:
    """``--load``: resume from the training state if there is one, else load the weights alone.

    With a state: the weights and the optimizer's statistics go into `shared_model` and
    `optimizer`, which keeps this command line's settings (a new ``--lr`` is used, and said).
    `cluster`: the driver of a cluster run, whose nodes keep their own statistics (the log
    says so).

    Returns:
        The training state resumed from, or None when only weights were loaded.

    Raises:
        UsageError: a missing or unfit file, or a state saved for another game or optimizer.
    """
    if not paths.load_state.is_file():
        load_weights(
            shared_model,
            paths.load_model,
            hint=f"or its {paths.load_state.name}, which --load resumes from",
        )
        log.info(
            f"loaded the weights alone from {paths.load_model} (no training state "
            f"{paths.load_state}: optimizer statistics, step counts and normalisers start afresh)"
        )
        return None
    state = TrainingState.load(paths.load_state)
    where = str(paths.load_state)
    saved = state.config
    if saved.get("env") != config.env:
        raise UsageError(
            f"training state {where!r} is for --env {saved.get('env')}, not {config.env}; pass "
            "the same --env, or another --load-model-dir"
        )
    saved_skip = saved_frame_skip(saved, config.skip_rate)
    if skip_bounds(saved_skip) != skip_bounds(config.frame_skip):
        random_now = isinstance(config.frame_skip, tuple) and isinstance(saved_skip, int)
        without_min = " and without --skip-rate-min" if random_now else ""
        raise UsageError(
            f"training state {where!r} was saved with a frame skip of {skip_text(saved_skip)}, "
            f"this run has {skip_text(config.frame_skip)}: resume with {skip_flags(saved_skip)}"
            f"{without_min} (its frames count on from the saved steps)"
        )
    if config.max_steps and state.steps >= config.max_steps:
        raise UsageError(
            f"training state {where!r} is at step {state.steps:,}, at or past --max-steps "
            f"{config.max_steps}: give a larger --max-steps"
            f"{'' if config.lr_schedule == 'linear' else ' (or 0, no limit)'} to train on"
        )
    compared = (("--optimizer", "optimizer"), ("--amsgrad", "amsgrad"))
    if saved.get("optimizer") != "Adam":  # --amsgrad is Adam's: RMSprop's states ignored it
        compared = compared[:1]
    for flag, key in compared:
        restored = optimizer is not None and state.optimizer is not None  # else start afresh
        if restored and key in saved and saved[key] != getattr(config, key):
            raise UsageError(
                f"training state {where!r} was saved with {flag} {saved[key]}, this run has "
                f"{getattr(config, key)}: resume with the same {flag}"
            )
    shared_model.load_state_dict(check_state_dict(shared_model, state.model, where))
    said: set[str] = set()  # settings the optimizer's resume logs itself
    if optimizer is not None and state.optimizer is not None:
        try:
            changed = optimizer.load_statistics(state.optimizer)
        except (ValueError, KeyError, RuntimeError) as err:
            raise UsageError(
                f"training state {where!r}: optimizer statistics do not fit --optimizer "
                f"{config.optimizer} ({err}); pass the optimizer it was saved with"
            ) from None
        said = set(changed)
        for key, (saved_value, value) in changed.items():
            log.info(
                f"resume: optimizer {key} was {saved_value} in the training state; "
                f"this run uses {value} (from the command line)"
            )
    if cluster and config.exchange_statistics:
        statistics = (
            "optimizer statistics start afresh on the nodes and the server "
            "(--exchange-statistics: the server's are not saved)"
        )
    elif cluster:
        statistics = "optimizer statistics start afresh on each node (they stay on the nodes)"
    elif optimizer is None:
        statistics = "optimizer statistics start afresh in each worker (--no-shared-optimizer)"
    elif state.optimizer is None:
        statistics = (
            "optimizer statistics start afresh (the state holds none: it was saved by a "
            "--no-shared-optimizer run or a cluster run, whose statistics stay on its nodes)"
        )
    else:
        statistics = "optimizer statistics restored"
    log.info(
        f"resumed from {where}: step {state.steps:,}, {format_elapsed(state.elapsed)} trained, "
        f"{len(state.test_rewards)} test games; {statistics}"
    )
    log_changed_settings(saved, config, state.steps, log, said)
    return state


def log_changed_settings(
    saved: dict[str, Any],
    config: TrainConfig,
    steps: int,
    log: logging.Logger,
    said: Iterable[str] = (),
) -> None:
    """Log each flag this sitting sets otherwise than the state's, and the lr where it moves.

    A resumed run takes this command line's settings. Some change the training without a
    flag saying so: a larger ``--max-steps`` under ``--lr-schedule linear`` raises the lr
    from where the schedule stood (0.1x ``--lr`` at 9M of 10M steps, 0.55x with 20M).

    Args:
        saved: the configuration the training state was saved with.
        config: this sitting's.
        steps: the step the state was saved at.
        log: where to say it.
        said: settings already logged (the optimizer's), left out here.
    """
    left_out = {"load", "load_model_dir", *said}  # how it resumed, not what it trains
    changed = [
        f"--{key.replace('_', '-')} {saved[key]} -> {value}"
        for key, value in as_dict(config).items()
        if key not in left_out
        and key in saved
        and saved[key] != value
        and not (saved[key] in ("", None) and value in ("", None))  # unset, old and new
    ]
    if changed:
        log.info(f"resume: this sitting changes {', '.join(changed)}")
    try:
        lr_then = scheduled_lr(saved["lr"], saved["lr_schedule"], steps, saved["max_steps"])
    except (KeyError, TypeError, ValueError):  # an older state's config: nothing to compare
        return
    lr_now = scheduled_lr(config.lr, config.lr_schedule, steps, config.max_steps)
    if lr_now != lr_then:
        log.info(
            f"resume: the lr at step {steps:,} is {lr_now:.4g}; it was {lr_then:.4g} when the "
            "state was saved"
        )


def same_file(path: Path, other: Path) -> bool:
    """Whether two paths name one file (relative or absolute, through links)."""
    return path.resolve() == other.resolve()


def earlier_log_dir(resumed: TrainingState | None, log_dir: str) -> Path | None:
    """The ``--log-dir`` of the sittings a resumed state comes from, where it is another.

    The state keeps the path absolute and as typed (older states: as typed only).
    """
    if resumed is None:
        return None
    # As saved (absolute) and as typed (relative to the working directory: a run folder moved
    # or copied whole is resumed with the same relative flags): either names this one, or
    # the first that exists is the other (the first, which is not there, where none does).
    saved = [Path(path) for path in (resumed.log_dir, resumed.config.get("log_dir")) if path]
    if not saved or any(same_file(path, Path(log_dir)) for path in saved):
        return None
    return next((path for path in saved if path.exists()), saved[0])


def prepare(config: TrainConfig, part: str = "all") -> Launcher:
    """Everything before the first process starts; all that can fail on bad input fails here.

    Args:
        config: the run's configuration.
        part: what the launcher runs (`PARTS`): a cluster's driver (``test``) has no workers
            and so no optimizer (each node keeps its own statistics).

    Raises:
        UsageError: a bad GPU id, an unwritable folder, a bad ``config.json`` or env id, an
            unfit file to ``--load``, an earlier run's training state that this run would not
            resume from (no ``--load``, or one from another folder).
    """
    log = logging.getLogger("a3g.main")
    check_gpus(config.gpu_ids)
    check_precision(config.precision, config.gpu_ids)
    paths = RunPaths.of(
        config.env, config.log_dir, config.save_model_dir, config.load_model_dir, config.save_max
    )
    run_folders = ((config.save_model_dir, "--save-model-dir"), (config.log_dir, "--log-dir"))
    for folder, flag in run_folders:  # first: another live run there is what to say, if any
        hold_run_lock(folder, config.env, flag)
    refuse_folders_named_as(
        *[(path, "--save-model-dir") for path in (paths.model, paths.final_model, paths.state)],
        *[(path, "--log-dir") for path in (paths.log, paths.record, paths.curve)],
    )
    resumes_it = same_file(paths.state, paths.load_state)  # the state --load would read
    # os.path.exists: False for a folder that cannot be read, which check_writable names below.
    if os.path.exists(paths.state) and not (config.load and resumes_it):
        # A forgotten --load (or one that reads another folder) would write a fresh model over
        # a long run's weights and its training state within seconds: the one thing a resume
        # cannot come back from.
        resume = f"--load-model-dir {config.save_model_dir}"
        if not config.load:
            resume = "--load" if resumes_it else f"--load {resume}"
        raise UsageError(
            f"{paths.state} holds an earlier run's training state, which this run would write "
            f"over; add {resume} to continue that run, or give --save-model-dir another folder "
            "(or delete the file) to start afresh"
        )
    env_conf = crop_settings(config.env_config, config.env)  # read once, here
    env = make_env(
        config.env, env_conf, config.max_episode_length, config.frame_skip,
        config.vector_obs_norm, repeat_action_probability=config.repeat_action_probability,
    )  # fmt: skip
    observation_space, action_space = env.observation_space, env.action_space
    env.close()

    torch.manual_seed(config.seed)
    shared_model = build_model(observation_space, action_space, config.hidden_size)
    optimizer = None
    if config.shared_optimizer and part != "test":
        optimizer = make_optimizer(
            shared_model.parameters(), config.optimizer, config.lr, config.amsgrad, config.workers
        )
    resumed = (
        resume_from(paths, config, shared_model, optimizer, log, cluster=part == "test")
        if config.load
        else None
    )
    loads_own_model = paths.model.exists() and same_file(paths.model, paths.load_model)
    if resumed is not None and not loads_own_model:
        # the state's score of <env>.dat was of the file it loaded, not of this folder's
        resumed = dataclasses.replace(resumed, dat_score=None, dat_trained=None)
    shared_model.share_memory()
    if optimizer is not None:
        optimizer.share_memory()

    # Only once every check has passed: a bad input stays one line and leaves no folder behind.
    check_writable(*run_folders)
    for folder, flag in run_folders:  # those it made
        hold_run_lock(folder, config.env, flag)
    played = protocol(config.env, config.frame_skip, config.max_episode_length)
    short = short_episode_warning(played)
    if short is not None:
        log.warning(short)
    # Resumed from this folder's training state: its <env>_last.dat is the run's own.
    continued_here = resumed is not None and same_file(paths.load_state, paths.state)
    if config.save_max and paths.final_model.exists() and not continued_here:
        log.warning(
            f"{paths.final_model} exists and this run will write over it at its end; another "
            "--save-model-dir keeps it"
        )
    if paths.model.exists() and not (config.load and loads_own_model):
        log.warning(
            f"{paths.model} exists and this run will write over it; --load with --load-model-dir "
            f"{config.save_model_dir} continues from it, another --save-model-dir keeps it"
        )
    elif (
        config.save_max
        and config.load
        and paths.model.exists()
        and (resumed is None or resumed.dat_score is None)
    ):
        # Weights alone carry no test games, and a run without --save-max keeps no score of
        # its file: the best to beat starts at nothing.
        if resumed is None:
            why = "no training state"
        elif not resumed.config.get("save_max"):
            why = "its run saved it without --save-max"
        else:
            why = "the training state does not record it"
        log.warning(
            f"--save-max: the score behind {paths.model} is not known ({why}), so the first "
            "test game's weights replace it; copy it elsewhere to keep it"
        )
    elif not config.save_max and resumed is not None and resumed.dat_score is not None:
        log.warning(
            f"{paths.model} holds the best test game's weights so far (a score of "
            f"{resumed.dat_score:g}, --save-max) and without --save-max every test game writes "
            "over it; add --save-max to keep the best, or copy it elsewhere"
        )
    earlier_logs = earlier_log_dir(resumed, config.log_dir)
    if earlier_logs is not None and not paths.log.exists():
        log.warning(
            f"resume: the earlier sittings logged to {earlier_logs}; this sitting's log "
            f"{paths.log} starts without their test games (copy {paths.log.name} from there "
            "first for one curve)"
        )
    elif earlier_logs is not None:
        log.warning(
            f"resume: the sitting before logged to {earlier_logs}; {paths.log} goes on without "
            "its test games (they stay in that folder's log)"
        )

    # A resumed run goes on in its TensorBoard folder, found by name under this run's
    # --log-dir (the saved path may be relative to another working directory, or another
    # --log-dir's, where the log and the run record no longer are).
    tensorboard_dir = str(
        paths.runs / Path(resumed.tensorboard_dir).name
        if resumed is not None and resumed.tensorboard_dir
        else paths.runs / new_run_name(env_file_stem(config.env), paths)
    )
    return Launcher(
        config, paths, env_conf, shared_model, optimizer, observation_space.shape,
        tensorboard_dir, resumed, part=part, earlier_logs=earlier_logs,
    )  # fmt: skip


def new_run_name(stem: str, paths: RunPaths) -> str:
    """A fresh run's name: its TensorBoard folder, and its identity in the log and the record.

    The env and the start time to the second, with ``-2``, ``-3`` ... where a run in the same
    ``--log-dir`` already has that name (started in the same second): two runs of one name
    would be read as one in the log (the curve) and in the records (a resume's sittings).
    """
    name = f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    taken = {p.name for p in paths.runs.glob(f"{name}*")}
    with contextlib.suppress(OSError):  # an unreadable log is said when the run opens it
        taken |= {
            Path(match["run"].strip()).name
            for line in paths.log.read_text(errors="replace").splitlines()
            if name in line and (match := RUN_ID.search(line))
        }
    with contextlib.suppress(OSError, ValueError):  # no record, or one the run will set aside
        record = json.loads(paths.record.read_text())
        config = record.get("config") if isinstance(record, dict) else None
        if isinstance(config, dict) and isinstance(config.get("tensorboard_dir"), str):
            taken.add(Path(config["tensorboard_dir"]).name)
    unique, count = name, 1
    while unique in taken:
        count += 1
        unique = f"{name}-{count}"
    return unique


# ----------------------------------------------------------------------------------------------
# Launch and supervision
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Child:
    """One process the launcher starts and supervises: a training worker, or the test process.

    Attributes:
        rank: the training worker's rank; None for the test process.
    """

    rank: int | None = None

    @property
    def is_test(self) -> bool:
        """This is the test process."""
        return self.rank is None

    @property
    def title(self) -> str:
        """The process title (``Train Agent: <rank>`` or ``Test Agent``, as the original)."""
        return "Test Agent" if self.rank is None else f"Train Agent: {self.rank}"


PARTS = ("all", "workers", "test")
"""What a launcher runs: ``all`` (one machine: the test process and the workers);
``workers`` (a cluster node: its Hogwild pool, no files written); ``test`` (the cluster's head:
the test process and the run's files, with the weights the parameter server sends)."""


class Launcher:
    """Starts the test process and the workers, supervises them, restarts the dead, shuts down.

    The same class runs a cluster's parts (`PARTS`); `cluster.py` adds the synchronisation
    through `on_poll`, called on every supervision round.
    """

    JOIN_SECONDS = 10.0
    POLL_SECONDS = 0.25
    RESTART_LIMIT = 3
    RESTART_WINDOW = 600.0

    def __init__(
        self,
        config: TrainConfig,
        paths: RunPaths,
        env_conf: dict[str, int],
        shared_model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        observation_shape: tuple[int, ...],
        tensorboard_dir: str,
        resumed: TrainingState | None = None,
        part: str = "all",
        extra_slots: int = 0,
        earlier_logs: Path | None = None,
        resumed_steps: int | None = None,
    ):
        """Hold what the children get; nothing starts and no file is written until `run`.

        Args:
            config: the run's configuration.
            paths: the run's files.
            env_conf: the game's ``config.json`` entry.
            shared_model: the shared-memory model.
            optimizer: the shared optimizer (None: each worker has its own).
            observation_shape: one observation's shape (for the TensorBoard graph).
            tensorboard_dir: the run's TensorBoard folder, also its name in the log.
            resumed: the training state this run continues, if any.
            part: which processes to run (`PARTS`).
            extra_slots: step-counter slots beyond the workers' (a cluster node writes the
                other nodes' steps there, so its workers see the cluster's total).
            earlier_logs: the resumed sittings' ``--log-dir``, where it is another
                (`earlier_log_dir`): the run record goes on from theirs.
            resumed_steps: the steps this sitting resumed from, for the children's seeds
                (`ProcessStart`; default: those of `resumed`, else 0).
        """
        if part not in PARTS:
            raise ValueError(f"expected part in {PARTS}, got {part!r}")
        self.part = part
        self.on_poll: Callable[[], None] | None = None
        self.before_shutdown: Callable[[], None] | None = None
        self.config = config
        self.paths = paths
        self.env_conf = env_conf
        self.shared_model = shared_model
        self.optimizer = optimizer
        self.tensorboard_dir = tensorboard_dir
        self.resumed = resumed
        self.earlier_logs = earlier_logs
        self.log_dir = str(Path(config.log_dir).resolve())  # for the state (once: the working
        # directory may be gone by a later save)
        self.log = logging.getLogger("a3g.main")
        self.stop_reason = ""
        self.failed = False
        self.final_saved = True
        self.state_saved = True
        self.stopped_untrained: bool | None = None  # `trained_nothing`, fixed when the stop came

        self.mp = mp.get_context("spawn")  # always: CPU and GPU runs behave the same
        self.ctx = ProcessContext.create(
            self.mp,
            config.max_steps,
            steps=0 if resumed is None else resumed.steps,
            elapsed=0.0 if resumed is None else resumed.elapsed,
            skipped=0 if resumed is None else resumed.skipped_updates,
            slots=(1 if part == "test" else config.workers) + extra_slots,
        )
        self.channels = ReportChannels(self.mp)
        self.children = [
            *([Child(None)] if part != "workers" else []),
            *(Child(rank) for rank in range(config.workers if part != "test" else 0)),
        ]
        self.processes: dict[Child, mp.process.BaseProcess] = {}
        if resumed_steps is None:
            resumed_steps = 0 if resumed is None else resumed.steps
        self.resumed_steps = resumed_steps
        self.starts: dict[Child, int] = {}  # each child's starts so far, for its seeds
        self.deaths: dict[Child, list[float]] = {}
        self.pending_causes: dict[str, tuple[str, str]] = {}
        self._signals = 0
        self.next_state_save = time.monotonic() + config.state_interval
        self.monitor = RunMonitor(
            config,
            shared_model,
            observation_shape,
            frames_per_step(config.env, config.frame_skip),
            self.ctx,
            self.log,
            paths,
            tensorboard_dir,
        )
        if resumed is not None:
            self.monitor.restore(resumed)
        # The score of <env>.dat the last state save wrote (or tried to: a failed one waits
        # for the next --state-interval, not the next poll).
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
            # Without --save-max every game replaces <env>.dat: a score saved here would be
            # stale by the next game, and a resume with --save-max would trust it.
            dat_score=self.monitor.dat_score if self.config.save_max else None,
            dat_trained=self.monitor.dat_trained if self.config.save_max else None,
            log_dir=self.log_dir,
        )

    def save_state(self) -> bool:
        """Write the training-state file atomically; a failure is logged and the old file kept.

        Returns:
            Whether it was written.
        """
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
        """Whether to write the training state now.

        Every ``--state-interval`` seconds, and at once after a ``--save-max`` run saved a new
        best test game's weights: a resume takes the score a game must match to replace
        ``<env>.dat`` from the state, and one written before (a crash in between) would let
        a worse game replace the best weights.
        """
        if self.config.state_interval <= 0 or self.trained_nothing():
            return False
        new_best = self.config.save_max and self.monitor.dat_score != self.state_dat_score
        return new_best or time.monotonic() >= self.next_state_save

    def process_target(self, child: Child, ctx: ProcessContext) -> tuple[Any, tuple]:
        """The entry point and arguments of `child`, with the latest normaliser statistics.

        Its `ProcessStart` is the next of its starts: a restart's or a resumed sitting's
        draws seeds of its own.
        """
        monitor = self.monitor
        start = ProcessStart(self.resumed_steps, self.starts.get(child, 0))
        if child.is_test:
            return test, (
                self.config, self.env_conf, self.paths, self.tensorboard_dir, self.shared_model,
                ctx, list(monitor.rewards), monitor.test_normalizer, monitor.dat_score,
                self.ctx.total_steps(), start,
            )  # fmt: skip
        return train, (
            child.rank, self.config, self.env_conf, self.shared_model, self.optimizer, ctx,
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
        """Wait until a signal, the step budget, the workers' end or a failure; restart the dead.

        A child that dies is reported with its name, pid and cause, and started again (it
        takes the latest shared weights at its next rollout). A child that dies more than
        `RESTART_LIMIT` times within `RESTART_WINDOW` seconds, or fails with an error no
        restart can fix (exit code `FATAL_EXIT`), stops the run.
        """
        while not self.ctx.stopping():
            for child, proc in list(self.processes.items()):
                if proc.exitcode not in (None, 0) and not self._handle_death(child, proc):
                    return
            workers = [p for child, p in self.processes.items() if not child.is_test]
            if workers and all(p.exitcode == 0 for p in workers):
                self.stop_reason = (
                    f"--max-steps {self.config.max_steps} reached"
                    if self.ctx.budget_reached()
                    else "all workers finished"
                )
                return
            if self.ctx.budget_reached() and not self.stop_reason:
                self.stop_reason = f"--max-steps {self.config.max_steps} reached"
            if self.on_poll is not None:
                self.on_poll()
            if self.ctx.budget_reached() and self.part == "test":
                self.stop_reason = f"--max-steps {self.config.max_steps} reached"
                return
            if self.part != "workers":
                self.drain_reports()
                if self.state_due():
                    self.save_state()
                    self.next_state_save = time.monotonic() + self.config.state_interval
                self.monitor.tick()
            else:
                self.drain_reports()
            time.sleep(self.POLL_SECONDS)

    def _handle_death(self, child: Child, proc: mp.process.BaseProcess) -> bool:
        """Report a dead child and restart it; False when the run must stop instead."""
        self.drain_reports(child)  # to the end of its pipe: its error report, its last numbers
        code = proc.exitcode
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        cause, trace = self.pending_causes.pop(
            child.title, ("no error report (it died without raising)", "")
        )
        if trace:
            self.log.error(f"{child.title} traceback:\n{trace.rstrip()}")
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(child, []) if now - t < self.RESTART_WINDOW]
        deaths.append(now)
        self.deaths[child] = deaths
        what = f"{child.title} (pid {proc.pid}) died: {how}; {cause}"
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
        self._start(child)
        return True

    def trained_nothing(self) -> bool:
        """Whether this is a fresh run stopped before its first step: nothing to save.

        Its weights are the random ones it began with, which must not replace a ``<env>.dat``
        there (the shipped agent, in the default ``trained_models/``), and a training state of
        them would only refuse the next fresh run. A run that loaded weights, and a cluster's
        driver, save as ever. From the stop on, the answer the stop found: a rollout the
        workers count while they stop does not make its weights worth saving over a ``.dat``.
        """
        if self.stopped_untrained is not None:
            return self.stopped_untrained
        return self.part == "all" and untrained(self.config.load, self.ctx.total_steps())

    def latch_untrained(self) -> None:
        """Fix `trained_nothing`'s answer as the stop comes (the first signal, or shutdown)."""
        if self.stopped_untrained is None:
            self.stopped_untrained = self.trained_nothing()

    def shutdown(self) -> None:
        """Stop every child, then save the latest weights and the training state."""
        self.latch_untrained()
        self.ctx.request_stop()  # whatever ended supervision: all say the run is stopping
        if self.part != "workers":  # a cluster node's pool: its driver says it
            then = (
                "nothing trained to save" if self.trained_nothing() else "the files are saved next"
            )
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
        """Ask every child to stop and wait for it (terminate, then kill, the slow ones).

        The children's last reports are read while they are waited for: a child blocked on
        a full pipe would otherwise never exit.
        """
        self.ctx.request_stop()
        deadline = time.monotonic() + self.JOIN_SECONDS
        while time.monotonic() < deadline:
            self.drain_reports()
            if not any(proc.is_alive() for proc in self.processes.values()):
                break
            time.sleep(0.05)
        # The slow ones all at once: a few seconds in all, not a few per child.
        slow = {child: proc for child, proc in self.processes.items() if proc.is_alive()}
        if slow:  # one line: 32 children still starting when a Ctrl-C came are one event
            named = ", ".join(f"{child.title} (pid {proc.pid})" for child, proc in slow.items())
            them = "it" if len(slow) == 1 else "them"
            self.log.warning(f"{named} did not stop in time; terminating {them}")
        for proc in slow.values():
            proc.terminate()
        self._join_all(slow.values(), 3.0)
        for proc in slow.values():
            if proc.is_alive():
                proc.kill()
        # 10 s: one stuck in the kernel (a hung GPU driver) may not go even then.
        self._join_all(slow.values(), 10.0)
        for child, proc in slow.items():
            if proc.is_alive():
                self.log.error(
                    f"{child.title} (pid {proc.pid}) did not exit after SIGKILL; saving anyway"
                )
        self.drain_reports()
        for title, (cause, _) in self.pending_causes.items():
            self.log.error(f"{title} also failed: {cause}")

    @staticmethod
    def _join_all(processes: Iterable[mp.process.BaseProcess], seconds: float) -> None:
        """Wait for `processes` to exit, `seconds` at most in all."""
        deadline = time.monotonic() + seconds
        for proc in processes:
            proc.join(max(0.0, deadline - time.monotonic()))

    def weights_left(self) -> set[Path]:
        """The files of weights this run left, for its record to name (`RunMonitor.close`).

        Under ``--save-max`` only the test games write ``<env>.dat``: it is this run's where
        its score is known (a game of this sitting or of the sittings resumed saved it), else
        another's found in the folder (no game saved yet), which the record must not claim.
        """
        if self.trained_nothing():  # nothing saved: no test game saves untrained weights
            return set()
        left = {self.paths.final_model, self.paths.state}
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

    @contextlib.contextmanager
    def signals_caught(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the run (`_on_signal`) inside, as they did before outside."""
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def run(self) -> int:
        """Start, supervise, shut down; returns the exit code (`main`'s)."""
        with self.signals_caught():  # from the first moment: a Ctrl-C always stops and saves
            return self._run()

    def open_record(self) -> None:
        """Start the run record and TensorBoard (`RunMonitor.open`), once, before any child.

        Raises:
            UsageError: they cannot be written (a full disk): nothing has started, and the
                record of the sittings before is as it was.
        """
        if self.monitor.record:
            return
        try:
            self.monitor.open(
                resumed_from=None if self.resumed is None else str(self.paths.load_state),
                weights_from=str(self.paths.load_model)
                if self.config.load and self.resumed is None
                else None,
                earlier_record=None
                if self.earlier_logs is None
                else self.earlier_logs / self.paths.record.name,
            )
        except OSError as err:
            raise UsageError(
                f"cannot start the run record {self.paths.record} or TensorBoard under "
                f"{self.config.log_dir} ({err}); free space there or pick another --log-dir"
            ) from None

    def _run(self) -> int:
        self.open_record()
        cores = os.cpu_count() or 1
        if self.part == "all" and self.config.workers > cores:
            self.log.warning(
                f"{self.config.workers} workers on {cores} CPU cores: they will share cores and "
                f"each run slower; --workers {cores} is usually faster"
            )
        try:
            if not self.ctx.stopping():  # a cluster's nodes started, then a signal: none here
                self.start()
            where = describe_devices(self.config.gpu_ids)
            self.log.info(
                f"training {self.config.env} with {count_of(self.config.workers, 'worker')}"
                + (" per node" if self.part == "test" else "")
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
            self.monitor.close(
                self.stop_reason or "done",
                exit_code,
                weights=sorted(self.weights_left()),
            )
        except OSError as err:
            self.log.error(f"could not complete the run record {self.paths.record} ({err})")
            exit_code = 1
        self.write_curve()
        steps = self.ctx.total_steps()
        message = (
            f"stopped: {self.stop_reason or 'done'}; {steps} steps in "
            f"{format_elapsed(time.time() - self.ctx.start_time)}; "
            + (
                "nothing saved (untrained when the stop came)"
                if self.trained_nothing()
                else f"model saved to {self.paths.final_model}"
                if self.final_saved
                else f"model NOT saved to {self.paths.final_model} (see the error above)"
            )
            + (
                ""
                if self.state_saved
                else f"; training state NOT saved to {self.paths.state} (see the error above)"
            )
        )
        if exit_code:
            self.log.error(message)
        else:
            self.log.info(message)
        return exit_code


STOPPING = "stopping: "
"""How the line that starts a run's shutdown begins: status lines after it count the
shutdown's seconds, when no frames are made (the benchmarks read frames/s before it)."""

STOPPED_BEFORE_TRAINING = "main.py: stopped before training started"
"""What a Ctrl-C before any child started prints (exit 130): torch importing, a state loading."""


def describe_devices(gpu_ids: tuple[int, ...]) -> str:
    """``CPU`` or ``GPU 0, 1``."""
    return "CPU" if list(gpu_ids) == [-1] else "GPU " + ", ".join(map(str, gpu_ids))


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code.

    0 ok (also a run stopped by Ctrl-C or SIGTERM); 1 a process failed or a final save
    (weights, training state, run record) did not happen; 2 bad input; 130 stopped before
    any process started.
    """
    logging.basicConfig(format="%(asctime)s : %(message)s", level=logging.INFO)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        try:
            with sigterm_interrupts():  # SIGTERM until the launcher catches it: as a Ctrl-C
                config = parse_train_args(argv)
                launcher = None if config.ray_address else prepare(config)
                if launcher is not None:
                    launcher.open_record()
            if launcher is None:  # a cluster's driver: it catches signals from its start
                from cluster import run_cluster

                return run_cluster(config)
        except UsageError as err:
            print(f"main.py: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # while a state loads, say: no child started, nothing trained
            print(STOPPED_BEFORE_TRAINING, file=sys.stderr)
            return INTERRUPTED_EXIT
        return launcher.run()
    finally:  # the run's folders are free for the next (the process may go on: tests)
        release_run_locks()


if __name__ == "__main__":
    run_script(main, _INTERRUPTED_WHILE_IMPORTING, STOPPED_BEFORE_TRAINING)
