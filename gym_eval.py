"""Evaluate a saved model: greedy full games, per-game log lines, a summary and a JSON record."""

from __future__ import annotations

import signal
import sys

_INTERRUPTED_WHILE_IMPORTING: list[int] = []
# A Ctrl-C during the imports is noted, not raised inside them (it could leave numpy half-loaded).
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: _INTERRUPTED_WHILE_IMPORTING.append(signum))

import json
import logging
import multiprocessing as mp
import os
import queue
import shlex
import statistics
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import gymnasium as gym
import numpy as np
import torch

from checkpoint import (
    checkpoint_path,
    env_file_stem,
    file_sha256,
    load_weights,
    saved_hidden_size,
    write_json_atomic,
)
from cli import EvalConfig, parse_eval_args
from environment import (
    EnvSpec,
    FrameSkip,
    frames_per_step,
    is_atari,
    make_env,
    protocol,
    register_games,
    short_episode_warning,
    skip_text,
)
from model import HIDDEN_SIZE, ActorCriticLSTM, build_model
from player_util import GAME_OVER, STOPPED, TIME_LIMIT, GameResult, GreedyPlayer
from run_folder import training_record
from utils import (
    INTERRUPTED_EXIT,
    UsageError,
    check_writable,
    refuse_folders_named_as,
    run_script,
    say_error,
    setup_logger,
    sigint_ignored,
    sigterm_interrupts,
    worker_device,
)
from validate import check_gpus
from visualize import write_gif

ATARI_HZ = 60  # emulator frames a second of an Atari game
DEMO_MAX_FRAMES = 1500  # a demo's frames at most (a few MB of GIF)
QUIET_TAIL_STEPS = 2000  # a time-limit game with no reward in this many last steps has stalled


class EvaluationProcessError(RuntimeError):
    """A process of a parallel evaluation died or failed; `details` is its traceback, if any."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class NoGameEnded(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped an evaluation before any game ended (its log has said so)."""


class VideoRecorder:
    """Writes one game's MP4 as ``<name>.partial.mp4``, renamed by `close`: no cut-short video."""

    def __init__(self, path: Path, fps: float):
        self.path = path
        self.partial = path.with_name(f"{path.stem}.partial{path.suffix}")
        self.fps = fps
        self.writer: cv2.VideoWriter | None = None

    def add(self, frame: np.ndarray) -> None:
        """Append an RGB frame."""
        if self.writer is None:
            height, width = frame.shape[:2]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fourcc = cv2.VideoWriter_fourcc(*"mp4v")
            self.writer = cv2.VideoWriter(str(self.partial), fourcc, self.fps, (width, height))
            if not self.writer.isOpened():
                raise UsageError(f"cannot write video {str(self.path)!r}; check --video-dir")
        self.writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))

    def close(self) -> None:
        """Finish the file and give it its name."""
        if self.writer is not None:
            self.writer.release()
            os.replace(self.partial, self.path)
            self.writer = None  # after the rename: a stop before it still discards the file

    def discard(self) -> None:
        """Drop the frames written so far (a game that did not end)."""
        if self.writer is not None:
            self.writer.release()
            self.writer = None
        # Also where the writer made the file and a stop came before it was kept.
        self.partial.unlink(missing_ok=True)


class DemoFrames:
    """One whole game's screens in at most `cap` frames, at an even pace (see `add`)."""

    def __init__(self, steps_per_second: float, cap: int = DEMO_MAX_FRAMES):
        self.steps_per_second = steps_per_second
        self.cap = cap
        self.frames: list[np.ndarray] = []
        self.stride = 1
        self.seen = 0

    def add(self, frame: np.ndarray) -> None:
        """Offer the next screen; past the cap every other frame goes and the stride doubles."""
        if self.seen % self.stride == 0:
            self.frames.append(frame)
            if len(self.frames) > self.cap:
                self.frames = self.frames[::2]
                self.stride *= 2
        self.seen += 1

    @property
    def fps(self) -> float:
        """Playback rate that keeps the game's own speed."""
        return self.steps_per_second / self.stride


def real_time_fps(env_id: str, skip_rate: FrameSkip, env: gym.Env) -> float:
    """Agent steps per second of the game's own time: a video at this rate plays in real time."""
    if is_atari(env_id):
        return ATARI_HZ / frames_per_step(env_id, skip_rate)
    return float(env.metadata.get("render_fps") or 30)


def cut_short(results: list[GameResult]) -> str:
    """The summary's note of games not ended by a game over, stalled ones apart ("" if none)."""
    endings = Counter(r.ending for r in results if r.ending != GAME_OVER)
    if not endings:
        return ""
    parts = []
    for ending, count in endings.items():
        if ending != TIME_LIMIT:
            parts.append(f"{count} {ending}")
            continue
        quiet = sum(
            r.ending == TIME_LIMIT and r.steps_without_reward >= QUIET_TAIL_STEPS for r in results
        )
        tail = f" ({quiet} with no reward in their last {QUIET_TAIL_STEPS:,}+ steps)"
        parts.append(f"{count} by the time limit" + (tail if quiet else ""))
    return f" ({sum(endings.values())} cut short: {', '.join(parts)})"


def demo_paths(folder: Path, stem: str) -> tuple[Path, Path]:
    """Where ``--demo`` writes: ``<demo-dir><env>.gif`` and ``.mp4``."""
    return folder / f"{stem}.gif", folder / f"{stem}.mp4"


def write_demo(demo: DemoFrames, folder: Path, stem: str) -> str:
    """Write `demo_paths`, a GIF and an MP4 of one game; the line that says so."""
    gif_path, video_path = demo_paths(folder, stem)
    gif = write_gif(demo.frames, gif_path, fps=demo.fps)
    video = VideoRecorder(video_path, fps=demo.fps)
    try:
        for frame in demo.frames:
            video.add(frame)
        video.close()
    finally:
        video.discard()  # stopped or failed part-way: no partial file left in the demo folder
    nth = {1: "", 2: "2nd "}.get(demo.stride, f"{demo.stride}th ")  # the stride doubles: 2, 4, 8
    every = f"every {nth}screen of {demo.seen} agent steps"
    return f"demo: {gif} and {video.path} ({len(demo.frames)} frames: {every})"


def recorded_render_mode(args: EvalConfig) -> str | None:
    """``rgb_array`` where the games are recorded (``--new-gym-eval``, ``--demo``)."""
    return "rgb_array" if args.new_gym_eval or args.demo else None


def loaded_model(args: EvalConfig, model_path: Path, env: gym.Env) -> ActorCriticLSTM:
    """The network for `env` holding `model_path`'s weights, as wide as the flag or the file.

    Raises:
        UsageError: the file is missing or unreadable, or its weights do not fit (`load_weights`).
    """
    hidden_size = args.hidden_size or saved_hidden_size(model_path) or HIDDEN_SIZE
    model = build_model(env.observation_space, env.action_space, hidden_size)
    load_weights(model, model_path, hint="or give the file as --model")
    return model


def check_playable(args: EvalConfig, model_path: Path) -> int:
    """Refuse, before anything is written, what would stop the first game; return the LSTM width.

    Raises:
        UsageError: the env or the file cannot be played (`load_weights`' line).
        gym.error.DependencyNotInstalled: drawing the env needs a package not installed.
    """
    render_mode = recorded_render_mode(args)
    env = make_env(EnvSpec.of(args), render_mode)
    try:
        width = loaded_model(args, model_path, env).hidden_size
        if render_mode is not None:
            env.reset(seed=0)
            env.render()
    finally:
        env.close()
    return width


def play_games(
    args: EvalConfig,
    model_path: Path,
    games: range,
    first_seed: int,
    report: Callable[[int, GameResult], None],
    say: Callable[[str], None],
    should_stop: Callable[[], bool] | None = None,
    wrap_env: Callable[[gym.Env], gym.Env] | None = None,
    watch_model: Callable[[ActorCriticLSTM], None] | None = None,
) -> None:
    """Play `games` (game numbers, 1 = the first of the evaluation) one after another here.

    `report` gets each game's result, `say` a line for the log (a demo's file names).
    """
    stem = env_file_stem(args.env)
    spec = EnvSpec.of(args)
    device = worker_device(args.gpu_id)
    torch.set_num_threads(args.threads)
    torch.manual_seed(first_seed)

    env = make_env(spec, recorded_render_mode(args))
    if wrap_env is not None:
        env = wrap_env(env)
    shown = make_env(spec, "human") if args.render else None
    model = loaded_model(args, model_path, env)
    model.to(device).eval()
    if model.channels_last_suits(device):
        model.use_channels_last()
    if watch_model is not None:
        watch_model(model)
    video_dir = Path(args.video_dir) if args.video_dir else Path(args.log_dir) / "videos"
    fps = real_time_fps(args.env, args.frame_skip, env)  # recordings play at the game's speed
    player = GreedyPlayer(model, env, device)
    # Each env is seeded at its first game, from `first_seed`: every game is repeatable.
    unused_seeds = [first_seed, process_seed(first_seed, 1 << 16)]
    seeded: set[int] = set()  # id() of each env played on so far
    try:
        for game in games:
            if should_stop is not None and should_stop():
                return
            player.env = shown if shown is not None and (game - 1) % args.render_freq == 0 else env
            seed = None if id(player.env) in seeded else unused_seeds.pop(0)
            seeded.add(id(player.env))
            recorder = None
            if args.new_gym_eval:
                recorder = VideoRecorder(video_dir / f"{stem}_game{game:04d}.mp4", fps)
            demo = DemoFrames(fps) if args.demo and game == 1 else None

            def on_frame(frame: np.ndarray, recorder=recorder, demo=demo) -> None:
                if recorder is not None:
                    recorder.add(frame)
                if demo is not None:
                    demo.add(frame)

            try:
                result = player.play_game(
                    seed,
                    args.stall_steps,
                    # Screens only for a game that keeps them (--demo keeps the first).
                    on_frame=on_frame if recorder is not None or demo is not None else None,
                    should_stop=should_stop,
                )
                if recorder is not None and result.ending != STOPPED:
                    recorder.close()
            finally:
                if recorder is not None:
                    recorder.discard()  # a game stopped or failed part-way: no video of it
            if result.ending == STOPPED:
                return
            if demo is not None and demo.frames:
                say(write_demo(demo, Path(args.demo_dir), stem))
            report(game, result)
    finally:
        env.close()
        if shown is not None:
            shown.close()


def process_seed(seed: int, process: int) -> int:
    """The reset seed of process `process`'s first game in an evaluation seeded with `seed`."""
    if process == 0:
        return seed
    # Drawn, not seed + process: evaluations with neighbouring seeds then share no games.
    return int(np.random.SeedSequence([seed, process]).generate_state(1)[0])


def _play_share(
    args: EvalConfig, model_path: Path, games: range, first_seed: int, results: Any, parent: int
) -> None:
    """A process of a parallel evaluation: plays its share, sends each result or its error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def stop(_signum: int, _frame: Any) -> None:
        results.cancel_join_thread()  # the evaluation reads no more: exit without flushing
        raise SystemExit(128 + signal.SIGTERM)  # a shell's code for a SIGTERM

    signal.signal(signal.SIGTERM, stop)  # back to the default once its games are done
    try:
        register_games()
        play_games(
            args, model_path, games, first_seed,
            lambda game, result: results.put(("game", game, result)),
            lambda line: results.put(("log", line)), should_stop=lambda: os.getppid() != parent,
        )  # fmt: skip
    except (UsageError, gym.error.DependencyNotInstalled) as err:
        results.put(("error", err))  # raised again in the evaluation, as if it were its own
    except Exception:  # the evaluation must hear of it, not wait for games never played
        details = traceback.format_exc()
        results.put(("error", EvaluationProcessError("an evaluation process failed", details)))
    finally:  # nothing left to discard: a SIGTERM now just ends it (no exit-time traceback)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def play_in_processes(
    args: EvalConfig,
    model_path: Path,
    report: Callable[[int, GameResult], None],
    log: logging.Logger,
) -> None:
    """Play the evaluation's games in ``--processes`` spawned processes; `report` gets each.

    Raises:
        UsageError: a process hit a bad value (e.g. an unwritable --video-dir).
        gym.error.DependencyNotInstalled: drawing the game needs a package not installed.
        EvaluationProcessError: a process failed otherwise, or died.
    """
    processes = min(args.processes, args.num_episodes)
    shares = [range(p + 1, args.num_episodes + 1, processes) for p in range(processes)]
    context = mp.get_context("spawn")
    results = context.Queue()
    children = [
        context.Process(
            target=_play_share,
            args=(args, model_path, share, process_seed(args.seed, p), results, os.getpid()),
            name=f"a3g-eval-{p}",
            daemon=True,
        )
        for p, share in enumerate(shares)
    ]
    owed = [len(share) for share in shares]

    def next_message() -> tuple:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                pass
            for p, child in enumerate(children):
                if owed[p] and child.exitcode is not None:
                    # What it sent before it ended is in the pipe by now: read that first.
                    try:
                        return results.get(timeout=0.5)
                    except queue.Empty:
                        how = f"exit code {child.exitcode}"
                        if child.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM):
                            how += ": stopped by a SIGTERM from outside"
                        raise EvaluationProcessError(
                            f"evaluation process {child.name} ended ({how}) with {owed[p]} of "
                            "its games unplayed"
                        ) from None

    try:
        for child in children:
            with sigint_ignored():
                child.start()
        while sum(owed):
            message = next_message()
            if message[0] == "log":
                log.info(message[1])
            elif message[0] == "error":
                raise message[1]
            else:
                _, game, result = message
                owed[(game - 1) % processes] -= 1
                report(game, result)
    finally:
        started = [child for child in children if child.pid is not None]  # Ctrl-C mid-start
        for child in started:
            if child.is_alive():
                child.terminate()
        deadline = time.monotonic() + 10  # a game's clean-up (a video discarded): milliseconds
        try:
            for child in started:
                child.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # also on a second Ctrl-C while they end
            for child in started:
                if child.is_alive():
                    child.kill()
                    child.join()


def evaluate(args: EvalConfig) -> dict:
    """Play ``--num-episodes`` greedy games; the summary of those that ended, logged and saved."""
    model_path = Path(args.model) if args.model else checkpoint_path(args.load_model_dir, args.env)
    if args.model and not model_path.is_file():
        what = "is a folder" if model_path.is_dir() else "not found"
        raise UsageError(
            f"--model {args.model!r} {what}; give the path of a .dat or training-state file"
        )
    stem = env_file_stem(args.env)
    refuse_folders_named_as(
        (Path(args.log_dir) / f"{stem}_eval_log", "--log-dir"),
        (Path(args.log_dir) / f"{stem}_eval.json", "--log-dir"),
    )
    digest = file_sha256(model_path)  # before the games: a training run may replace the file
    width = check_playable(args, model_path)
    video_dir = Path(args.video_dir) if args.video_dir else Path(args.log_dir) / "videos"
    check_writable(
        (args.log_dir, "--log-dir"),
        *([(video_dir, "--video-dir")] if args.new_gym_eval else []),
        *([(args.demo_dir, "--demo-dir")] if args.demo else []),
    )
    log = setup_logger(f"a3g.eval.{args.env}", Path(args.log_dir) / f"{stem}_eval_log")
    training = training_record(args.log_dir, model_path, digest, log)  # its warning first
    if args.demo:
        earlier = [path for path in demo_paths(Path(args.demo_dir), stem) if path.exists()]
        if earlier:  # the default demo/ holds the shipped pictures
            log.warning(
                f"--demo will write over {' and '.join(map(str, earlier))}; another --demo-dir "
                "keeps them"
            )
    played = protocol(
        args.env, args.frame_skip, args.max_episode_length, args.repeat_action_probability,
        args.stall_steps,
    )  # fmt: skip
    if (short := short_episode_warning(played)) is not None:
        log.warning(short)
    processes = min(args.processes, args.num_episodes)
    if processes > (os.cpu_count() or 1):
        log.warning(
            f"--processes {args.processes} is more than this machine's {os.cpu_count()} cores: "
            "the games share them and the evaluation is no faster"
        )
    sticky, skip = played.get("repeat_action_probability"), played.get("frame_skip")
    conditions = [f"sticky actions {sticky:g}"] if sticky is not None else []
    if isinstance(skip, list):  # a random skip, ours or the -v0 ids'
        conditions.append(f"frame skip {skip_text(tuple(skip))}")
    log.info(
        f"evaluating {model_path} on {args.env} for {args.num_episodes} games"
        + (f" ({', '.join(conditions)})" if conditions else "")
        + (f" in {processes} processes" if processes > 1 else "")
    )
    by_game: dict[int, GameResult] = {}

    def report(game: int, result: GameResult) -> None:
        by_game[game] = result
        mean = statistics.fmean(r.reward for r in by_game.values())
        log.info(
            f"game {game}/{args.num_episodes}: reward {result.reward}, length {result.length}, "
            f"reward mean {mean:.4f}{result.note()}"
        )

    start = time.time()
    interrupted = False
    try:
        with sigterm_interrupts():  # SIGTERM (a scheduler's stop) keeps the games as Ctrl-C
            if processes > 1:
                play_in_processes(args, model_path, report, log)
            else:
                games = range(1, args.num_episodes + 1)
                play_games(args, model_path, games, args.seed, report, log.info)
    except KeyboardInterrupt:
        if not by_game:
            log.warning("interrupted before any game ended: no summary saved")
            raise NoGameEnded from None
        interrupted = True
        log.warning(
            f"interrupted after {len(by_game)} of {args.num_episodes} games: the summary counts "
            "the games that ended"
            + (" (side by side, the short ones end first)" if processes > 1 else "")
        )
    if digest is not None and file_sha256(model_path) != digest:
        log.warning(
            f"{model_path} was replaced during the evaluation (a training run saving it?): the "
            "games may have played either version, so the summary names neither"
        )
        digest = None
    results = [by_game[game] for game in sorted(by_game)]
    rewards = [r.reward for r in results]
    lengths = [r.length for r in results]
    endings = [r.ending for r in results]
    summary = {
        "env": args.env,
        "model": str(model_path),
        "model_sha256": digest,
        "hidden_size": width,
        "games": len(rewards),
        "mean": statistics.fmean(rewards),
        "std": statistics.pstdev(rewards),
        "best": max(rewards),
        "worst": min(rewards),
        "mean_length": statistics.fmean(lengths),
        "rewards": rewards,
        "lengths": lengths,
        "endings": endings,
        "steps_without_reward": [r.steps_without_reward for r in results],
        "games_not_over": sum(ending != GAME_OVER for ending in endings),
        "interrupted": interrupted,
        "seed": args.seed,
        "threads": args.threads,
        "processes": processes,
        "command": shlex.join(["python", *sys.argv]),
        "protocol": played,
        "training": training,
        "seconds": round(time.time() - start, 3),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    json_path = Path(args.log_dir) / f"{stem}_eval.json"
    if (replaced := replaced_summary(json_path, summary)) is not None:
        log.warning(replaced)
    try:
        write_json_atomic(summary, json_path)
    except OSError as err:
        raise UsageError(
            f"cannot write the summary {str(json_path)!r} ({err.strerror}); the games' lines are "
            f"in {Path(args.log_dir) / f'{stem}_eval_log'}"
        ) from None
    log.info(
        f"{args.env}: mean reward {summary['mean']:.2f} +/- {summary['std']:.2f} (std) over "
        f"{summary['games']} games, best {summary['best']}{cut_short(results)}; "
        f"summary in {json_path}"
    )
    if args.new_gym_eval:
        log.info(f"videos in {video_dir}")
    return summary


def replaced_summary(json_path: Path, summary: dict) -> str | None:
    """What writing `summary` over the evaluation summary at `json_path` loses, if anything."""
    try:
        earlier = json.loads(json_path.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, not text
        return None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("model"), str):
        return None
    keep = "; it now holds this one's (give each evaluation its own --log-dir to keep both)"
    if Path(earlier["model"]).resolve() != Path(summary["model"]).resolve():
        return f"{json_path} held the evaluation of {earlier['model']}{keep}"
    digests = (earlier.get("model_sha256"), summary["model_sha256"])
    if None not in digests and digests[0] != digests[1]:
        return f"{json_path} held the evaluation of other weights in {earlier['model']}{keep}"
    before = earlier.get("protocol")
    if not isinstance(before, dict):
        return f"{json_path} held an evaluation of this model that names no protocol{keep}"
    dealt = ("games", "seed", "processes")  # which games each process played
    then = {**before, **{key: earlier.get(key) for key in dealt}}
    now = {**summary["protocol"], **{key: summary[key] for key in dealt}}
    changes = [
        f"{key} {then.get(key)} there, {now.get(key)} here"
        for key in [*now, *(key for key in then if key not in now)]
        if then.get(key) != now.get(key)
    ]
    if not changes:
        return None
    return f"{json_path} held another evaluation of this model ({'; '.join(changes)}){keep}"


def main(argv: list[str] | None = None) -> int:
    """Entry point: the exit code (0 ok, 1 a game process failed, 2 bad input, 130 interrupted)."""
    logging.basicConfig(format="%(asctime)s : %(message)s", level=logging.INFO)
    try:
        args = parse_eval_args(argv)
        check_gpus([args.gpu_id], "--gpu-id")
        if evaluate(args)["interrupted"]:
            return INTERRUPTED_EXIT
    except NoGameEnded:  # the log said so, on the terminal too
        return INTERRUPTED_EXIT
    except KeyboardInterrupt:  # before the games began (the log may not exist yet)
        print("gym_eval.py: interrupted; no summary saved", file=sys.stderr)
        return INTERRUPTED_EXIT
    except UsageError as err:
        say_error("gym_eval.py", err)
        return 2
    except gym.error.DependencyNotInstalled as err:
        print(
            f"gym_eval.py: error: drawing {args.env} needs a package that is not installed "
            f"({err}); install it, or drop --demo/--new-gym-eval/--render",
            file=sys.stderr,
        )
        return 2
    except EvaluationProcessError as err:  # a game process died or failed: no summary
        print(f"{err.details}gym_eval.py: error: {err}; no summary saved", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_script(main, _INTERRUPTED_WHILE_IMPORTING, "gym_eval.py: interrupted; no summary saved")
