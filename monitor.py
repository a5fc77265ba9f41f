"""The launcher's view of a run: TensorBoard, the status line, the run record (with versions)."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint import RunPaths, TrainingState, file_sha256, write_json_atomic
from cli import TrainConfig, as_dict
from environment import protocol
from shared_optim import scheduled_lr
from utils import ProcessContext, format_elapsed

TENSORBOARD_SECONDS = 20.0
"""How often TensorBoard gets the training figures when ``--status-interval 0`` prints none."""


def versions() -> dict[str, str]:
    """Versions of Python and the libraries a result depends on."""
    import platform

    import cv2
    import gymnasium
    import numpy

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__,
        "opencv": cv2.__version__,
    }
    try:
        import ale_py

        out["ale_py"] = ale_py.__version__
    except ImportError:
        out["ale_py"] = "not installed"
    return out


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
    import subprocess

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


SET_ASIDE = ("earlier_run", "another_run", "whole")
"""The suffixes of run records a run set aside rather than write over (`RunMonitor.open`)."""


def has_finished(sitting: dict[str, Any]) -> bool:
    """Whether a run record's sitting ended with its figures written (frames at least)."""
    finished = sitting.get("finished")
    return isinstance(finished, dict) and finished.get("frames") is not None


def counted_sittings(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The sittings of a run record, oldest first, up to the last one that finished.

    A record is read while its run goes on (an evaluation of the last weights, say): the
    sitting still running, and any that crashed after the last finished one, left nothing in
    those weights. Where no sitting finished, all of them.
    """
    sittings = [*(record.get("previous_runs") or []), record]
    sittings = [sitting for sitting in sittings if isinstance(sitting, dict)]
    ends = [i for i, sitting in enumerate(sittings) if has_finished(sitting)]
    return sittings[: ends[-1] + 1] if ends else sittings


def up_to_weights(record: dict[str, Any], digest: str | None) -> dict[str, Any] | None:
    """The record as it stood when its run left the weights of SHA-256 `digest`.

    The first sitting whose ``weights_sha256`` holds `digest` (the one that wrote those bytes:
    a ``--save-max`` run's ``<env>.dat`` may stay the same over later sittings), with the
    sittings before it as its ``previous_runs``, so `run_totals` counts the training in those
    weights only; a ``--save-max`` ``<env>.dat`` counts that sitting up to where its weights
    were taken (``finished.training_in``, set as the sitting's ``counted_to``), not to its
    end. The record itself where no sitting names its weights (an older record) or where the
    last sitting has not finished (still running, or killed: the weights on disk may be its
    own, which it has not named yet). Weights no sitting names in a record whose first
    sittings name none (older ones, the later ones newer) may be theirs: the record up to the
    last of those. None where every sitting
    finished and none could have left `digest`: other weights.
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
            taken = [
                training_in.get(name) if isinstance(training_in, dict) else None for name in names
            ]
            if all(isinstance(at, dict) for at in taken):  # a --save-max <env>.dat
                sitting["counted_to"] = taken[0]
            return {**sitting, "previous_runs": sittings[:i]}
    if not has_finished(record):
        return record
    unnamed = [i for i in range(named[0][0]) if has_finished(sittings[i])]
    return {**sittings[unnamed[-1]], "previous_runs": sittings[: unnamed[-1]]} if unnamed else None


def run_totals(record: dict[str, Any]) -> dict[str, Any]:
    """Frames and seconds of a whole run from its record, every sitting in `previous_runs` too.

    A sitting resumed from its training state (``resumed_from`` set) goes on counting, so its
    figures include the sittings before it; one started afresh (the first, or one started from
    a ``.dat`` alone on a new machine) counts from 0. The run's totals are the sum of the last
    figures of each such chain of sittings. A sitting that never finished adds nothing, and
    those after the last one that finished (a sitting still running while an evaluation reads
    the record) are not counted at all: their training is not in the weights being described.

    Returns:
        ``frames`` and ``seconds`` (None where no sitting finished), ``sittings`` (counted
        from the first to the last that finished; all of them where none did) and
        ``restarts`` (sittings among those that started afresh after the first).
    """
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


class RunMonitor:
    """The launcher's view of a run: TensorBoard, the terminal status line, the run record.

    Workers and the test process send small summaries through their report pipes; the
    launcher hands each to `take`, and this one place averages them and writes, so no worker
    ever waits on a disk.
    """

    def __init__(
        self,
        config: TrainConfig,
        model: nn.Module,
        observation_shape: tuple[int, ...],
        frames_per_step: float,
        ctx: ProcessContext,
        log: logging.Logger,
        paths: RunPaths,
        tensorboard_dir: str,
    ):
        """Prepare; nothing is written until `open`.

        Args:
            config: the run's configuration (all of it goes in the run record).
            model: the shared model (its graph and weight histograms go to TensorBoard).
            observation_shape: one observation's shape, for the model graph.
            frames_per_step: raw frames per agent step (a random skip's mean).
            ctx: the counters and report queue shared with the children.
            log: where status lines go.
            paths: the run's files (the run record).
            tensorboard_dir: the run's TensorBoard folder (used with ``--tensorboard-logger``).
        """
        self.config = config
        self.model = model
        self.observation_shape = observation_shape
        self.frames_per_step = frames_per_step
        self.ctx = ctx
        self.log = log
        self.record_path = paths.record
        self.model_name = paths.model.name
        self.tensorboard_dir = tensorboard_dir
        self.interval = config.status_interval
        self.rewards: list[float] = []
        self.best = -math.inf
        self.dat_score: float | None = None  # the score of the weights in <env>.dat
        # --save-max: how far the run was when the weights in <env>.dat were taken
        self.dat_trained: dict[str, float] | None = None
        self.worker_normalizers: dict[int, Any] = {}
        self.test_normalizer: Any = None
        self.train_window: list[dict[str, Any]] = []
        # Every training game of the run: [frames, seconds, score, steps] at its report.
        self.training_games: list[list[float]] = []
        self.last_tick = time.time()
        self.last_steps = self.first_steps = ctx.total_steps()
        self.fps = 0.0
        self.writer = None
        self.record: dict[str, Any] = {}

    def open(
        self,
        resumed_from: str | None = None,
        weights_from: str | None = None,
        earlier_record: Path | None = None,
    ) -> None:
        """Open the TensorBoard run (with the model graph) and write the run record.

        A resumed run (`resumed_from` names the training-state file) keeps the records of the
        runs before it under ``previous_runs``; so does a run that went on from a ``.dat``
        alone (`weights_from`, e.g. on a new machine), whose counts start afresh
        (`run_totals` starts a new chain there). They are read from this ``--log-dir``'s
        record, or where it has none, from `earlier_record` (the state's run wrote its record
        in another ``--log-dir``; read, never moved).
        """
        if self.config.tensorboard_logger:
            from torch.utils.tensorboard import SummaryWriter

            # A run resumed from a state older than its last events (it was killed between
            # two state saves) drops the events of the stretch it trains again, as the
            # curve drops those games (`visualize.parse_log`).
            purge = self.frames if resumed_from is not None else None
            self.writer = SummaryWriter(log_dir=self.tensorboard_dir, purge_step=purge)
            hx, cx = self.model.initial_state(1)
            dummy = torch.zeros(1, *self.observation_shape)
            self.writer.add_graph(self.model, (dummy, hx, cx))
        record: dict[str, Any] = {
            "env": self.config.env,
            "command": shlex.join(["python", *sys.argv]),
            "config": {**as_dict(self.config), "tensorboard_dir": self.tensorboard_dir},
            "versions": versions(),
            "hardware": hardware(self.config.gpu_ids),
            "protocol": protocol(
                self.config.env,
                self.config.frame_skip,
                self.config.max_episode_length,
                self.config.repeat_action_probability,
            ),
            "git_commit": git_commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if resumed_from is not None:
            record["resumed_from"] = resumed_from
        elif weights_from is not None:
            record["loaded_weights_from"] = weights_from
        previous = None
        if resumed_from is not None:
            previous = self._this_runs_record(earlier_record)
        elif weights_from is not None and Path(self.record_path).exists():
            previous = self._record_of_weights(Path(weights_from))  # copied here by the user
        elif Path(self.record_path).exists():  # a run afresh in an earlier run's --log-dir
            where = self._set_aside(Path(self.record_path), ".earlier_run")
            self.log.warning(
                f"{self.record_path} held an earlier run's record (its test games stay in the "
                f"log); {where}"
            )
        if previous is not None:
            history = previous.pop("previous_runs", None) or []
            record["previous_runs"] = [*history, previous]
        write_json_atomic(record, self.record_path)
        self.record = record  # only once written: `Launcher.open_record` reads it so

    def _this_runs_record(self, earlier_record: Path | None) -> dict[str, Any] | None:
        """The record of a run resumed from its state: this ``--log-dir``'s, else `earlier_record`.

        Only a record of this run: one naming the same TensorBoard folder (the run's name, which
        a resume keeps; a record that names none is taken as before). Where both are,
        `earlier_record`: the state's sitting wrote it, so it is the latest (this folder's is
        older where the run went on elsewhere and came back). Another run's record here (the
        folder held one) is kept aside, not chained in nor written over; this run's, kept aside
        when another run started afresh here, is found there.
        """
        own = Path(self.record_path)
        run = Path(self.tensorboard_dir).name
        found = []
        for path in (earlier_record, own):
            if path is None or not path.exists():
                continue
            previous = self._earlier_record(path)
            if previous is None:
                continue
            named = Path(str((previous.get("config") or {}).get("tensorboard_dir") or "")).name
            if not named or named == run:
                found.append(previous)
            elif path == own:
                where = self._set_aside(own, ".another_run")
                self.log.warning(
                    f"{own} is the record of another run (TensorBoard folder {named}, this run's "
                    f"is {run}); {where}"
                )
        if found:
            return found[0]
        folders = [own.parent, *([] if earlier_record is None else [earlier_record.parent])]
        kept = self._set_aside_record(run, folders)
        if kept is None:
            where = " or ".join(str(folder) for folder in folders)
            self.log.warning(
                f"resume: no run record of the earlier sittings in {where}, so this sitting's "
                f"record starts without them (copy {own.name} into {own.parent} to keep them)"
            )
        return kept

    def _set_aside_record(self, run: str, folders: list[Path]) -> dict[str, Any] | None:
        """The latest record of the run named `run` set aside in `folders` (`_set_aside`).

        Where another run started or resumed in this run's ``--log-dir`` it moved this run's
        record aside (``.earlier_run``, ``.another_run``; ``.whole`` by a start from a
        ``.dat`` alone); the one written last is the latest.
        """
        latest: tuple[float, Path, dict[str, Any]] | None = None
        name = Path(self.record_path).name
        for folder in folders:
            for path in folder.glob(f"{name}.*"):
                if not path.name.startswith(tuple(f"{name}.{kind}" for kind in SET_ASIDE)):
                    continue
                try:
                    written = path.stat().st_mtime
                    previous = json.loads(path.read_text())
                    named = Path(str(previous["config"]["tensorboard_dir"])).name
                except (OSError, ValueError, TypeError, KeyError):
                    continue
                if named != run or not isinstance(previous.get("previous_runs") or [], list):
                    continue
                if latest is None or written > latest[0]:
                    latest = (written, path, previous)
        if latest is None:
            return None
        self.log.warning(f"the earlier sittings' run record is taken from {latest[1]}")
        return latest[2]

    def _record_of_weights(self, weights: Path) -> dict[str, Any] | None:
        """This ``--log-dir``'s record as it stood when its run left `weights` (`up_to_weights`).

        A run started from a ``.dat`` alone goes on from the record found here (copied over
        with the file, from another machine), but only from the sittings behind those
        weights: a record that names other weights (another run's) is kept aside, not
        chained in; one whose later sittings trained on past them is chained up to the
        sitting that wrote them, the whole file kept aside (both said).
        """
        own = Path(self.record_path)
        previous = self._earlier_record(own)
        if previous is None:
            return None
        lineage = up_to_weights(previous, file_sha256(weights))
        if lineage is None:
            where = self._set_aside(own, ".another_run")
            self.log.warning(
                f"{own} is the record of other weights (no sitting in it left {weights}), so "
                f"this run's record starts afresh; {where}"
            )
            return None
        later = len(counted_sittings(previous)) - len(counted_sittings(lineage))
        if later:
            where = self._set_aside(own, ".whole")
            self.log.warning(
                f"{own}: {weights} is of its sitting {len(counted_sittings(lineage))}, so this "
                f"run's record goes on from there without the {later} later sitting(s) (their "
                f"training is not in those weights); {where}"
            )
        return lineage

    def _earlier_record(self, path: Path) -> dict[str, Any] | None:
        """The sittings so far, or None if unfit (said; this run's own file is kept aside)."""
        try:
            previous = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            reason = str(err)
        else:
            if (
                isinstance(previous, dict)
                and isinstance(previous.get("previous_runs") or [], list)
                and isinstance(previous.get("config") or {}, dict)
            ):
                return previous
            reason = "not a run record"
        where = (
            self._set_aside(path, ".unreadable")
            if path == Path(self.record_path)
            else "the file is left as it is"  # another folder's
        )
        self.log.warning(
            f"run record {path} cannot be read ({reason}); this sitting's record starts without "
            f"the earlier sittings ({where})"
        )
        return None

    def _set_aside(self, path: Path, suffix: str) -> str:
        """Rename `path` to a free name, to keep it from being written over; say where it went."""
        kept = path.with_name(path.name + suffix)
        for n in itertools.count(1):
            if not kept.exists():
                break
            kept = path.with_name(f"{path.name}{suffix}.{n}")  # one kept before: keep both
        try:
            os.replace(path, kept)
        except OSError as err:
            return f"it could not be kept aside: {err.strerror}"
        return f"the file is kept as {kept}"

    @property
    def frames(self) -> int:
        """Raw frames played by all workers so far."""
        return int(self.ctx.total_steps() * self.frames_per_step)

    def take(self, kind: str, payload: dict[str, Any]) -> None:
        """One report from a child: ``"test"`` (a test game) or ``"train"`` (a worker's numbers)."""
        normalizer = payload.pop("normalizer", None)
        if kind == "test":
            self.test_normalizer = normalizer
            self._test_game(payload)
        elif kind == "train":
            if normalizer is not None:  # a cluster's reports carry none: keep what was saved
                self.worker_normalizers[int(payload["rank"])] = normalizer
            self._training_games(payload.get("games", ()))
            self.train_window.append(payload)  # with its games: a cluster node passes it on

    def restore(self, state: TrainingState) -> None:
        """Continue from a resumed run's test rewards and normaliser statistics."""
        self.rewards = list(state.test_rewards)
        self.best = max(self.rewards, default=-math.inf)
        self.dat_score = state.dat_score
        # Without --save-max every test game and the shutdown write <env>.dat: its end's.
        self.dat_trained = state.dat_trained if self.config.save_max else None
        self.worker_normalizers = dict(state.worker_normalizers)
        self.test_normalizer = state.test_normalizer
        self.training_games = [list(game) for game in state.training_games]

    def _training_games(self, games: Sequence[Sequence[float]]) -> None:
        """A worker's finished games (score, steps), stamped with the run's frames and seconds."""
        if not games:
            return
        frames, seconds = self.frames, round(time.time() - self.ctx.start_time, 1)
        for score, steps in games:
            self.training_games.append([frames, seconds, float(score), int(steps)])

        def write(writer: Any) -> None:
            for score, _ in games:
                writer.add_scalar("train/episode_score", float(score), frames)

        self._to_tensorboard(write)

    @property
    def training_mean_100(self) -> float | None:
        """Mean score of the last 100 training games (None before the first)."""
        recent = [game[2] for game in self.training_games[-100:]]
        return sum(recent) / len(recent) if recent else None

    def _test_game(self, game: dict[str, float]) -> None:
        self.rewards.append(game["reward"])
        self.best = max(self.best, game["reward"])
        if game.get("saved"):  # its weights are <env>.dat now
            self.dat_score = game["reward"]
            if self.config.save_max:  # kept past the sitting's end: say how far it was
                taken = game.get("weights_taken_at") or {
                    "steps": game["steps"], "seconds": time.time() - self.ctx.start_time
                }  # fmt: skip
                self.dat_trained = {
                    "steps": int(taken["steps"]),
                    "frames": int(int(taken["steps"]) * self.frames_per_step),
                    "seconds": round(float(taken["seconds"]), 1),
                }
        frames = int(game["frames"])

        def write(writer: Any) -> None:
            writer.add_scalar("test/episode_reward", game["reward"], frames)
            writer.add_scalar("test/episode_length", game["length"], frames)
            writer.add_scalar("test/reward_mean_100", self.mean_100, frames)

        self._to_tensorboard(write)

    def _to_tensorboard(self, write: Callable[[Any], None]) -> None:
        """`write(writer)` to TensorBoard, if on; a failed write (disk full) turns it off.

        TensorBoard is a view of the run: losing it must not stop the training or the saves.
        """
        if self.writer is None:
            return
        try:
            write(self.writer)
        except OSError as err:
            self.writer = None
            self.log.error(
                f"TensorBoard: could not write to {self.tensorboard_dir} ({err}); the run goes "
                "on without it"
            )

    @property
    def mean_100(self) -> float:
        """Mean test reward of the last 100 games (NaN before the first)."""
        recent = self.rewards[-100:]
        return sum(recent) / len(recent) if recent else math.nan

    def tick(self, force: bool = False, final: bool = False) -> None:
        """Every ``--status-interval`` seconds: training scalars, histograms, a status line.

        `force`: now, whenever the last was; `final`: the run's closing line.

        With ``--status-interval 0`` (no status lines) TensorBoard still gets its training
        figures, every `TENSORBOARD_SECONDS` (histograms of every weight at each poll would
        keep the launcher busy and grow the event file by gigabytes).
        """
        now = time.time()
        if not force and now - self.last_tick < (self.interval or TENSORBOARD_SECONDS):
            return
        steps = self.ctx.total_steps()
        frames_done = (steps - self.last_steps) * self.frames_per_step
        self.fps = frames_done / max(now - self.last_tick, 1e-9)
        self.last_tick, self.last_steps = now, steps
        self._to_tensorboard(lambda writer: self._write_training(writer, steps))
        self.train_window = []
        if self.interval > 0:
            self.log.info(self.status_line(now, steps, final))

    def _write_training(self, writer: Any, steps: int) -> None:
        frames = int(steps * self.frames_per_step)
        writer.add_scalar("train/fps", self.fps, frames)
        lr = scheduled_lr(self.config.lr, self.config.lr_schedule, steps, self.config.max_steps)
        writer.add_scalar("train/lr", lr, frames)
        if self.train_window:
            updates = sum(r["updates"] for r in self.train_window) or 1
            keys = [k for k in self.train_window[0] if k not in ("rank", "updates", "games")]
            for key in keys:
                value = sum(r[key] * r["updates"] for r in self.train_window) / updates
                writer.add_scalar(f"train/{key}", value, frames)
        for name, param in self.model.named_parameters():
            writer.add_histogram(name, param.detach(), frames)
        writer.flush()

    def status_line(self, now: float, steps: int, final: bool = False) -> str:
        """``status 00h 05m 12s | steps 1,234 | frames 4,936 | 2,345 frames/s | test ...``.

        Until the first rollout is counted it says the workers are starting (except on the
        `final` line).
        """
        clock = format_elapsed(now - self.ctx.start_time)
        if self.rewards:
            test = (
                f"test reward {self.rewards[-1]:g} (mean of last {min(len(self.rewards), 100)} "
                f"{self.mean_100:.2f}, best {self.best:g}, {len(self.rewards)} games)"
            )
        else:
            test = "no test game finished yet"
        skipped = self.ctx.total_skipped()
        skipped_text = f" | {skipped} non-finite updates skipped" if skipped else ""
        # Many workers on few cores take minutes to build their envs and networks.
        starting = " | the workers are starting" if steps == self.first_steps and not final else ""
        return (
            f"status {clock} | steps {steps:,} | frames {int(steps * self.frames_per_step):,} | "
            f"{self.fps:,.0f} frames/s | {test}{skipped_text}{starting}"
        )

    def close(self, stop_reason: str, exit_code: int, weights: Sequence[Path] = ()) -> None:
        """Final scalars, close TensorBoard, complete the run record.

        The record keeps the SHA-256 of each of the `weights` files the run leaves (those
        that exist), so an evaluation can tell this run's weights from others of that name.
        """
        self.tick(force=True, final=True)
        self._to_tensorboard(lambda writer: writer.close())
        elapsed = time.time() - self.ctx.start_time
        self.record["finished"] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(elapsed, 1),
            "steps": self.ctx.total_steps(),
            "frames": self.frames,
            "test_games": len(self.rewards),
            "best_test_reward": None if not self.rewards else self.best,
            "test_reward_mean_100": None if not self.rewards else self.mean_100,
            "training_games": len(self.training_games),
            "training_score_mean_100": self.training_mean_100,
            "skipped_updates": self.ctx.total_skipped(),
            "stop_reason": stop_reason,
            "exit_code": exit_code,
            "weights_sha256": {
                path.name: digest for path in weights if (digest := file_sha256(path)) is not None
            },
        }
        if self.dat_trained is not None:  # the training in --save-max's <env>.dat
            self.record["finished"]["training_in"] = {self.model_name: self.dat_trained}
        # The run's training games so far, those of the sittings it resumed from too.
        self.record["training_games"] = {
            "columns": ["frames", "seconds", "score", "steps"],
            "games": self.training_games,
        }
        write_json_atomic(self.record, self.record_path)
