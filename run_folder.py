"""The run folder: what a run may do with ``--save-model-dir`` and ``--log-dir``, decided once.

`plan` reads the folders and the file ``--load`` resumes from and decides, writing nothing:
the refusals (another live run there, an earlier run's state this run would write over, a
state that does not fit), the warnings, the training state to resume, the TensorBoard folder.
`load` puts the state's weights and optimizer statistics (or the ``.dat`` alone) into the
built model; `apply` makes the folders, takes their locks and says the warnings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint import (
    RunPaths,
    TrainingState,
    check_state_dict,
    env_file_stem,
    hold_run_lock,
    load_weights,
    loaded_hidden_size,
    refuse_another_run,
)
from cli import TrainConfig, as_dict
from environment import saved_frame_skip, skip_bounds, skip_flags, skip_text
from model import HIDDEN_SIZE
from shared_optim import scheduled_lr
from utils import UsageError, check_writable, format_elapsed, refuse_folders_named_as
from visualize import RUN_ID


@dataclass(frozen=True)
class RunPlan:
    """What a run does with its folders, decided before anything is written.

    Attributes:
        env: the run's env id (its files' and locks' name).
        hidden_size: the LSTM width the run builds (`hidden_size`).
        folders: ``--save-model-dir`` and ``--log-dir`` as typed, each with its flag.
        paths: the run's files.
        state: the training state ``--load`` resumes from (read, not yet loaded); None for
            a fresh run or one that loads the ``.dat`` alone. Its ``dat_score`` is None
            where the ``<env>.dat`` it scored is not this folder's.
        tensorboard_dir: the run's TensorBoard folder (a resumed run's own), also its name.
        earlier_logs: the resumed sittings' ``--log-dir``, where it is another.
        warnings: what `apply` logs: files this run writes over, a score not known.
    """

    env: str
    hidden_size: int
    folders: tuple[tuple[str, str], ...]
    paths: RunPaths
    state: TrainingState | None
    tensorboard_dir: str
    earlier_logs: Path | None
    warnings: tuple[str, ...]


def plan(config: TrainConfig, cluster: bool = False) -> RunPlan:
    """Decide what the run does with its folders; reads files, writes none.

    Args:
        config: the run's configuration.
        cluster: a cluster's driver, which keeps no optimizer (the nodes keep theirs).

    Raises:
        UsageError: another live run in a folder, a folder where a file is saved, an earlier
            run's state that this run would write over, or a state ``--load`` cannot resume.
    """
    paths = RunPaths.of(
        config.env, config.log_dir, config.save_model_dir, config.load_model_dir, config.save_max
    )
    folders = ((config.save_model_dir, "--save-model-dir"), (config.log_dir, "--log-dir"))
    for folder, flag in folders:
        refuse_another_run(folder, config.env, flag)  # first: what to say, if it is so
    refuse_folders_named_as(
        *[(path, "--save-model-dir") for path in (paths.model, paths.final_model, paths.state)],
        *[(path, "--log-dir") for path in (paths.log, paths.record, paths.curve)],
    )
    resumes_it = same_file(paths.state, paths.load_state)  # the state --load would read
    # os.path.exists: False for a folder that cannot be read, which check_writable names.
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
    state = None
    if config.load and paths.load_state.is_file():
        statistics = config.shared_optimizer and not cluster
        state = read_state(paths.load_state, config, statistics)
    loads_own_model = paths.model.exists() and same_file(paths.model, paths.load_model)
    if state is not None and not loads_own_model:
        # the state's score of <env>.dat was of the file it loaded, not of this folder's
        state = dataclasses.replace(state, dat_score=None, dat_trained=None)
    earlier_logs = earlier_log_dir(state, config.log_dir)
    warnings = [*overwrite_warnings(config, paths, state, loads_own_model)]
    if earlier_logs is not None and not paths.log.exists():
        warnings.append(
            f"resume: the earlier sittings logged to {earlier_logs}; this sitting's log "
            f"{paths.log} starts without their test games (copy {paths.log.name} from there "
            "first for one curve)"
        )
    elif earlier_logs is not None:
        warnings.append(
            f"resume: the sitting before logged to {earlier_logs}; {paths.log} goes on without "
            "its test games (they stay in that folder's log)"
        )
    # A resumed run goes on in its TensorBoard folder, found by name under this run's
    # --log-dir (the saved path may be relative to another working directory, or another
    # --log-dir's, where the log and the run record no longer are).
    tensorboard_dir = str(
        paths.runs / Path(state.tensorboard_dir).name
        if state is not None and state.tensorboard_dir
        else paths.runs / new_run_name(env_file_stem(config.env), paths)
    )
    return RunPlan(
        config.env, hidden_size(config, paths), folders, paths, state, tensorboard_dir,
        earlier_logs, tuple(warnings),
    )  # fmt: skip


def hidden_size(config: TrainConfig, paths: RunPaths) -> int:
    """The LSTM width: ``--hidden-size``, else that of what ``--load`` reads, else the original's.

    Raises:
        UsageError: the file ``--load`` reads is damaged or not a training state.
    """
    if config.hidden_size is not None:
        return config.hidden_size
    return (loaded_hidden_size(paths) if config.load else None) or HIDDEN_SIZE


def read_state(path: Path, config: TrainConfig, statistics: bool) -> TrainingState:
    """The training state at `path`, checked to fit this run; `statistics`: they are restored.

    Raises:
        UsageError: an unreadable file, or one saved for another game, frame skip or
            optimizer, or at or past ``--max-steps``.
    """
    state = TrainingState.load(path)
    where = str(path)
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
    restored = statistics and state.optimizer is not None  # else they start afresh
    for flag, key in compared:
        if restored and key in saved and saved[key] != getattr(config, key):
            raise UsageError(
                f"training state {where!r} was saved with {flag} {saved[key]}, this run has "
                f"{getattr(config, key)}: resume with the same {flag}"
            )
    return state


def overwrite_warnings(
    config: TrainConfig, paths: RunPaths, state: TrainingState | None, loads_own_model: bool
) -> Iterable[str]:
    """What this run writes over that a user may want kept, and a best score not known."""
    # Resumed from this folder's training state: its <env>_last.dat is the run's own.
    continued_here = state is not None and same_file(paths.load_state, paths.state)
    if config.save_max and paths.final_model.exists() and not continued_here:
        yield (
            f"{paths.final_model} exists and this run will write over it at its end; another "
            "--save-model-dir keeps it"
        )
    if paths.model.exists() and not (config.load and loads_own_model):
        yield (
            f"{paths.model} exists and this run will write over it; --load with --load-model-dir "
            f"{config.save_model_dir} continues from it, another --save-model-dir keeps it"
        )
    elif config.save_max and config.load and paths.model.exists():
        # Weights alone carry no test games, and a run without --save-max keeps no score of
        # its file: the best to beat starts at nothing.
        if state is None:
            why = "no training state"
        elif not state.config.get("save_max"):
            why = "its run saved it without --save-max"
        elif state.dat_score is None:
            why = "the training state does not record it"
        else:
            return
        yield (
            f"--save-max: the score behind {paths.model} is not known ({why}), so the first "
            "test game's weights replace it; copy it elsewhere to keep it"
        )
    elif not config.save_max and state is not None and state.dat_score is not None:
        yield (
            f"{paths.model} holds the best test game's weights so far (a score of "
            f"{state.dat_score:g}, --save-max) and without --save-max every test game writes "
            "over it; add --save-max to keep the best, or copy it elsewhere"
        )


def load(
    run: RunPlan,
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    log: logging.Logger,
    cluster: bool = False,
) -> None:
    """``--load``: the state's weights and optimizer statistics into `model` and `optimizer`.

    Without a state, the ``.dat`` alone. The optimizer keeps this command line's settings (a
    new ``--lr`` is used, and said). `cluster`: the driver of a cluster run, whose nodes keep
    their own statistics (the log says so).

    Raises:
        UsageError: a missing or unfit file.
    """
    if not config.load:
        return
    paths, state = run.paths, run.state
    if state is None:
        load_weights(
            model,
            paths.load_model,
            hint=f"or its {paths.load_state.name}, which --load resumes from",
        )
        log.info(
            f"loaded the weights alone from {paths.load_model} (no training state "
            f"{paths.load_state}: optimizer statistics, step counts and normalisers start afresh)"
        )
        return
    where = str(paths.load_state)
    model.load_state_dict(check_state_dict(model, state.model, where))
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
    log_changed_settings(state.config, config, state.steps, log, said)


def apply(run: RunPlan, log: logging.Logger) -> None:
    """Make the run's folders, take their locks, say the plan's warnings.

    Only once every check has passed: a bad input stays one line and leaves no folder behind.

    Raises:
        UsageError: a folder that cannot be made or written, or another run took it meanwhile.
    """
    check_writable(*run.folders)
    for folder, flag in run.folders:
        hold_run_lock(folder, run.env, flag)
    for warning in run.warnings:
        log.warning(warning)


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
