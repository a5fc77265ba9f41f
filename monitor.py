"""The launcher's view of a run: TensorBoard, the status line, the run's counters."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint import RunPaths, TrainingState, file_sha256, write_json_atomic
from cli import TrainConfig
from run_folder import start_record
from shared_optim import scheduled_lr
from utils import ProcessContext, format_elapsed

TENSORBOARD_SECONDS = 20.0  # --status-interval 0's; not every poll: histograms would take GBs


class RunMonitor:
    """The launcher's view of a run, written here from the reports: no worker waits on a disk."""

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
        """Prepare; nothing is written until `open`."""
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
        """Open TensorBoard and write the run record, chained to the earlier sittings' records."""
        if self.config.tensorboard_logger:
            from torch.utils.tensorboard import SummaryWriter

            # A resume drops the events of a stretch it trains again, as the curve drops the games.
            purge = self.frames if resumed_from is not None else None
            self.writer = SummaryWriter(log_dir=self.tensorboard_dir, purge_step=purge)
            hx, cx = self.model.initial_state(1)
            dummy = torch.zeros(1, *self.observation_shape)
            self.writer.add_graph(self.model, (dummy, hx, cx))
        record = start_record(
            self.config,
            self.tensorboard_dir,
            Path(self.record_path),
            self.log,
            resumed_from,
            weights_from,
            earlier_record,
        )
        self.record = record  # only once written: `Launcher.open_record` reads it so

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
        """`write(writer)` to TensorBoard, if on; a failed write turns it off, not the run."""
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
        """Every ``--status-interval`` seconds (`force`: now): training scalars, a status line."""
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
        """``status 00h 05m 12s | steps 1,234 | frames 4,936 | 2,345 frames/s | test ...``."""
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
        """Final scalars, close TensorBoard, complete the run record (with `weights`' SHA-256)."""
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
