"""The run folder: what a run may do with ``--save-model-dir`` and ``--log-dir``, decided once.

`plan` decides and writes nothing (refusals, warnings, the state to resume, the TensorBoard
folder); `load` fills the built model; `apply` makes the folders and takes their locks. The run
record's chain of sittings lives here too (`start_record`, `run_totals`, `training_record`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint import (
    LAST_SAVE_SUFFIX,
    STATE_SUFFIX,
    RunPaths,
    TrainingState,
    check_state_dict,
    env_file_stem,
    file_sha256,
    hold_run_lock,
    load_weights,
    lstm_width,
    refuse_another_run,
    saved_hidden_size,
    write_json_atomic,
)
from cli import TrainConfig, as_dict
from environment import protocol, saved_frame_skip, skip_bounds, skip_flags, skip_text
from model import HIDDEN_SIZE
from shared_optim import scheduled_lr
from utils import UsageError, check_writable, format_elapsed, refuse_folders_named_as
from visualize import RUN_ID


@dataclass(frozen=True)
class RunPlan:
    """What a run does with its folders, decided before anything is written."""

    env: str
    hidden_size: int
    folders: tuple[tuple[str, str], ...]
    paths: RunPaths
    state: TrainingState | None  # what --load resumes, read; dat_score None if not this .dat's
    tensorboard_dir: str
    earlier_logs: Path | None  # the resumed sittings' --log-dir, where it is another
    warnings: tuple[str, ...]


def plan(config: TrainConfig, cluster: bool = False) -> RunPlan:
    """Decide what the run does with its folders; reads files, writes none.

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
        # A forgotten --load would write a fresh model over a long run's weights within seconds.
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
        state = read_state(paths.load_state, config, config.shared_optimizer and not cluster)
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
    # A resume's TensorBoard folder, by name here: the saved path may be relative to another cwd.
    if state is not None and state.tensorboard_dir:
        tensorboard_dir = str(paths.runs / Path(state.tensorboard_dir).name)
    else:
        tensorboard_dir = str(paths.runs / new_run_name(env_file_stem(config.env), paths))
    # The LSTM width: --hidden-size, else that of what --load reads, else the original's.
    width = config.hidden_size
    if width is None and state is not None:
        width = lstm_width(state.model)
    elif width is None and config.load:  # a .dat alone
        width = saved_hidden_size(paths.load_model)
    return RunPlan(
        config.env, width or HIDDEN_SIZE, folders, paths, state, tensorboard_dir, earlier_logs,
        tuple(warnings),
    )  # fmt: skip


def read_state(path: Path, config: TrainConfig, statistics: bool) -> TrainingState:
    """The training state at `path`, checked to fit this run; `statistics`: they are restored.

    Raises:
        UsageError: an unreadable file, or one that does not fit this run.
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
    # --amsgrad is Adam's: RMSprop's states ignored it.
    keys = ("optimizer", "amsgrad") if saved.get("optimizer") == "Adam" else ("optimizer",)
    restored = statistics and state.optimizer is not None  # else they start afresh
    for key in keys:
        if restored and key in saved and saved[key] != getattr(config, key):
            raise UsageError(
                f"training state {where!r} was saved with --{key} {saved[key]}, this run has "
                f"{getattr(config, key)}: resume with the same --{key}"
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
        # Weights alone carry no score, nor does a run without --save-max: any game beats it.
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

    Without a state, the ``.dat`` alone. The optimizer keeps this command line's settings.

    Raises:
        UsageError: a missing or unfit file.
    """
    if not config.load:
        return
    paths, state = run.paths, run.state
    if state is None:
        hint = f"or its {paths.load_state.name}, which --load resumes from"
        load_weights(model, paths.load_model, hint)
        log.info(
            f"loaded the weights alone from {paths.load_model} (no training state "
            f"{paths.load_state}: optimizer statistics, step counts and normalisers start afresh)"
        )
        return
    where = str(paths.load_state)
    model.load_state_dict(check_state_dict(model, state.model, where))
    changed: dict[str, Any] = {}  # settings the optimizer's resume logs itself
    if optimizer is not None and state.optimizer is not None:
        try:
            changed = optimizer.load_statistics(state.optimizer)
        except (ValueError, KeyError, RuntimeError) as err:
            raise UsageError(
                f"training state {where!r}: optimizer statistics do not fit --optimizer "
                f"{config.optimizer} ({err}); pass the optimizer it was saved with"
            ) from None
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
    log_changed_settings(state.config, config, state.steps, log, changed)


def apply(run: RunPlan, log: logging.Logger) -> None:
    """Make the run's folders, take their locks, say the warnings: once every check has passed.

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
    """Log each flag this sitting changes from the state's (but `said`), and the lr if it moves."""
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
    """The ``--log-dir`` of the sittings a resumed state comes from, where it is another."""
    if resumed is None:
        return None
    # As saved (absolute) and as typed (a folder moved whole): the first that exists, if another.
    saved = [Path(path) for path in (resumed.log_dir, resumed.config.get("log_dir")) if path]
    if not saved or any(same_file(path, Path(log_dir)) for path in saved):
        return None
    return next((path for path in saved if path.exists()), saved[0])


def new_run_name(stem: str, paths: RunPaths) -> str:
    """A fresh run's name: env and start time, ``-2`` ... if taken (one name reads as one run)."""
    name = f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    taken = {p.name for p in paths.runs.glob(f"{name}*")}
    with contextlib.suppress(OSError):  # an unreadable log is said when the run opens it
        taken |= {
            Path(match["run"].strip()).name
            for line in paths.log.read_text(errors="replace").splitlines()
            if name in line and (match := RUN_ID.search(line))
        }
    with contextlib.suppress(OSError, ValueError):  # no record, or one the run will set aside
        taken.add(run_of(read_record(paths.record)))
    unique, count = name, 1
    while unique in taken:
        count += 1
        unique = f"{name}-{count}"
    return unique


# The run record's chain of sittings


SET_ASIDE = ("earlier_run", "another_run", "whole")  # suffixes of the records set aside
_LOG = logging.getLogger("a3g.run_folder")


def read_record(path: Path) -> dict[str, Any]:
    """The run record at `path`; OSError where it cannot be read, ValueError where it is not one."""
    record = json.loads(path.read_text())
    if not (
        isinstance(record, dict)
        and isinstance(record.get("previous_runs") or [], list)
        and isinstance(record.get("config") or {}, dict)
    ):
        raise ValueError("not the shape of a run record")
    return record


def run_of(record: dict[str, Any]) -> str:
    """A record's run, by the name of its TensorBoard folder ("" where it names none)."""
    return Path(str((record.get("config") or {}).get("tensorboard_dir") or "")).name


def has_finished(sitting: dict[str, Any]) -> bool:
    """Whether a run record's sitting ended with its figures written (frames at least)."""
    finished = sitting.get("finished")
    return isinstance(finished, dict) and finished.get("frames") is not None


def counted_sittings(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's sittings, oldest first, to the last that finished (later ones left no weights)."""
    sittings = [*(record.get("previous_runs") or []), record]
    sittings = [sitting for sitting in sittings if isinstance(sitting, dict)]
    ends = [i for i, sitting in enumerate(sittings) if has_finished(sitting)]
    return sittings[: ends[-1] + 1] if ends else sittings


def up_to_weights(record: dict[str, Any], digest: str | None) -> dict[str, Any] | None:
    """The record as it stood when its run left the weights of SHA-256 `digest`.

    The first sitting that names `digest`, with those before it, so `run_totals` counts only
    the training in those weights (a ``--save-max`` ``<env>.dat`` up to ``training_in``). The
    record itself where no sitting names weights or the last has not finished; None where no
    sitting could have left `digest`.
    """
    sittings = counted_sittings(record)
    named = [
        (i, digests)
        for i, sitting in enumerate(sittings)
        if has_finished(sitting)
        and isinstance(digests := sitting["finished"].get("weights_sha256"), dict)
    ]
    if not named:
        return record
    for i, digests in named:
        names = [name for name, value in digests.items() if value == digest]
        if names:
            sitting = {key: value for key, value in sittings[i].items() if key != "counted_to"}
            training_in = sitting["finished"].get("training_in")
            taken = [training_in.get(n) for n in names] if isinstance(training_in, dict) else [None]
            if all(isinstance(at, dict) for at in taken):  # a --save-max <env>.dat
                sitting["counted_to"] = taken[0]
            return {**sitting, "previous_runs": sittings[:i]}
    if not has_finished(record):
        return record
    unnamed = [i for i in range(named[0][0]) if has_finished(sittings[i])]
    return {**sittings[unnamed[-1]], "previous_runs": sittings[: unnamed[-1]]} if unnamed else None


def run_totals(record: dict[str, Any]) -> dict[str, Any]:
    """Frames and seconds of a whole run: the last figures of each chain of resumed sittings."""
    sittings = counted_sittings(record)
    chains: list[dict[str, Any]] = []
    for sitting in sittings:
        if sitting.get("resumed_from") is None or not chains:
            chains.append({})
        if has_finished(sitting):  # up to where later weights were taken, if they were
            counted_to = sitting.get("counted_to")
            chains[-1] = counted_to if isinstance(counted_to, dict) else sitting["finished"]
    done = [chain for chain in chains if chain]
    seconds = [chain["seconds"] for chain in done if chain.get("seconds") is not None]
    return {
        "frames": sum(chain["frames"] for chain in done) if done else None,
        "seconds": sum(seconds) if seconds else None,
        "sittings": len(sittings),
        "restarts": max(0, len(chains) - 1),
    }


def versions() -> dict[str, str]:
    """Versions of Python and the libraries a result depends on."""
    import platform

    import ale_py
    import cv2
    import gymnasium
    import numpy

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__,
        "opencv": cv2.__version__,
        "ale_py": ale_py.__version__,
    }


def hardware(gpu_ids: Sequence[int]) -> str:
    """``"2 CPU cores"`` or ``"1x NVIDIA H100 + 16 CPU cores"``: what a run ran on."""
    cores = f"{os.cpu_count()} CPU cores"
    if list(gpu_ids) == [-1] or not torch.cuda.is_available():
        return cores
    names = [torch.cuda.get_device_name(i) for i in sorted(set(gpu_ids))]
    grouped = {name: names.count(name) for name in names}
    return " + ".join([f"{n}x {name}" for name, n in grouped.items()] + [cores])


def git_commit() -> str | None:
    """The checkout's commit, if this is a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def start_record(
    config: TrainConfig,
    tensorboard_dir: str,
    record_path: Path,
    log: logging.Logger,
    resumed_from: str | None = None,
    weights_from: str | None = None,
    earlier_record: Path | None = None,
) -> dict[str, Any]:
    """Write a sitting's run record at its start, chained to the earlier sittings'; return it."""
    record: dict[str, Any] = {
        "env": config.env,
        "command": shlex.join(["python", *sys.argv]),
        "config": {**as_dict(config), "tensorboard_dir": tensorboard_dir},
        "versions": versions(),
        "hardware": hardware(config.gpu_ids),
        "protocol": protocol(
            config.env,
            config.frame_skip,
            config.max_episode_length,
            config.repeat_action_probability,
        ),
        "git_commit": git_commit(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    previous = None
    if resumed_from is not None:
        record["resumed_from"] = resumed_from
        previous = _this_runs_record(record_path, Path(tensorboard_dir).name, earlier_record, log)
    elif weights_from is not None:
        record["loaded_weights_from"] = weights_from
        if record_path.exists():  # copied here by the user
            previous = _record_of_weights(record_path, Path(weights_from), log)
    elif record_path.exists():  # a run afresh in an earlier run's --log-dir
        where = set_aside(record_path, ".earlier_run")
        log.warning(
            f"{record_path} held an earlier run's record (its test games stay in the log); {where}"
        )
    if previous is not None:
        history = previous.pop("previous_runs", None) or []
        record["previous_runs"] = [*history, previous]
    write_json_atomic(record, record_path)
    return record


def _this_runs_record(
    record_path: Path, run: str, earlier_record: Path | None, log: logging.Logger
) -> dict[str, Any] | None:
    """A resumed run's own record: `earlier_record`, else this one, else one set aside."""
    found = []
    for path in (earlier_record, record_path):
        if path is None or not path.exists():
            continue
        previous = _earlier_record(path, record_path, log)
        if previous is not None and run_of(previous) in ("", run):
            found.append(previous)
        elif previous is not None and path == record_path:
            where = set_aside(record_path, ".another_run")
            log.warning(
                f"{record_path} is the record of another run (TensorBoard folder "
                f"{run_of(previous)}, this run's is {run}); {where}"
            )
    if found:
        return found[0]
    folders = [record_path.parent, *([] if earlier_record is None else [earlier_record.parent])]
    kept = []  # the records of this run that another run set aside
    for folder, kind in itertools.product(folders, SET_ASIDE):
        for path in folder.glob(f"{record_path.name}.{kind}*"):
            with contextlib.suppress(OSError, ValueError):
                if run_of(previous := read_record(path)) == run:
                    kept.append((path.stat().st_mtime, path, previous))
    if kept:
        _, path, previous = max(kept, key=lambda found: found[0])
        log.warning(f"the earlier sittings' run record is taken from {path}")
        return previous
    log.warning(
        f"resume: no run record of the earlier sittings in "
        f"{' or '.join(str(folder) for folder in folders)}, so this sitting's record starts "
        f"without them (copy {record_path.name} into {record_path.parent} to keep them)"
    )
    return None


def _record_of_weights(own: Path, weights: Path, log: logging.Logger) -> dict[str, Any] | None:
    """This ``--log-dir``'s record up to the sitting that left `weights` (others' aside)."""
    previous = _earlier_record(own, own, log)
    if previous is None:
        return None
    lineage = up_to_weights(previous, file_sha256(weights))
    if lineage is None:
        where = set_aside(own, ".another_run")
        log.warning(
            f"{own} is the record of other weights (no sitting in it left {weights}), "
            f"so this run's record starts afresh; {where}"
        )
        return None
    later = len(counted_sittings(previous)) - len(counted_sittings(lineage))
    if later:
        where = set_aside(own, ".whole")
        log.warning(
            f"{own}: {weights} is of its sitting {len(counted_sittings(lineage))}, so "
            f"this run's record goes on from there without the {later} later sitting(s) (their "
            f"training is not in those weights); {where}"
        )
    return lineage


def _earlier_record(path: Path, record_path: Path, log: logging.Logger) -> dict[str, Any] | None:
    """The sittings so far, or None if unfit (said; this run's own file is kept aside)."""
    try:
        return read_record(path)
    except (OSError, ValueError) as err:
        reason = str(err)
    where = set_aside(path, ".unreadable") if path == record_path else "the file is left as it is"
    log.warning(
        f"run record {path} cannot be read ({reason}); this sitting's record starts without "
        f"the earlier sittings ({where})"
    )
    return None


def set_aside(path: Path, suffix: str) -> str:
    """Rename `path` to a free name, to keep it from being written over; say where it went."""
    kept, n = path.with_name(path.name + suffix), 0
    while kept.exists():  # one kept before: keep both
        n += 1
        kept = path.with_name(f"{path.name}{suffix}.{n}")
    try:
        os.replace(path, kept)
    except OSError as err:
        return f"it could not be kept aside: {err.strerror}"
    return f"the file is kept as {kept}"


def training_record(
    log_dir: str, model_path: Path, digest: str | None, log: logging.Logger = _LOG
) -> dict | None:
    """How the model of SHA-256 `digest` was trained, from its run's record (bad: None, warned)."""
    path = Path(log_dir) / f"{model_path.stem}_run.json"
    for suffix in (LAST_SAVE_SUFFIX, STATE_SUFFIX):
        if not path.exists() and model_path.stem.endswith(suffix):
            path = Path(log_dir) / f"{model_path.stem.removesuffix(suffix)}_run.json"
    try:
        record = up_to_weights(read_record(path), digest)
        if record is None:
            log.warning(
                f"{path} is the record of other weights (no sitting of its run left a file with "
                f"{model_path.name}'s SHA-256); the summary's training entry is left empty"
            )
            return None
        commands = [s.get("command") for s in counted_sittings(record)]
        if not all(command is None or isinstance(command, str) for command in commands):
            raise TypeError("a command that is not text")
        for key, kind in (("hardware", str), ("protocol", dict)):
            if record.get(key) is not None and not isinstance(record[key], kind):
                raise TypeError(f"its {key} is not a {kind.__name__}")
        totals = run_totals(record)
    except (OSError, UnicodeError, json.JSONDecodeError):  # none, or not JSON: nothing to say
        return None
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        log.warning(
            f"{path} is not a run record this version reads ({err}); the summary's training "
            "entry is left empty"
        )
        return None
    return {
        **totals,  # frames, seconds, sittings, restarts
        "hardware": record.get("hardware"),
        "command": next((command for command in commands if command), None),
        "commands": commands,
        "protocol": record.get("protocol"),
        "record": str(path),
    }
