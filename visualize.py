"""Evidence to look at: training curves, what the agent sees, results (GIFs: gym_eval --demo)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import cv2
import numpy as np

import cli
from checkpoint import env_file_stem, write_atomic
from environment import DEFAULT_CONFIG, env_config, read_config
from utils import OneLineParser, UsageError, format_elapsed
from validate import MAX_SEED

# A test game's whole line (ours goes on past the original's); one cut by a kill matches none.
LINE = re.compile(
    r"Time (?P<h>\d+)h (?P<m>\d\d)m (?P<s>\d\d)s, episode reward (?P<reward>[-\d.e+]+), "
    r"episode length (?P<length>\d+), reward mean [-\d.e+]+"
    r"(?:\s*$|, total steps (?P<steps>\d+)(?:, total frames (?P<frames>\d+))?, "
    r"frames/s \d+(?=$|, ))"
)
ARGUMENT_BLOCK = re.compile(r" : workers: \d+$")  # a line of every process's argument block
STEPS_AT_START = re.compile(r" : steps_at_start: (?P<steps>\d+)$")  # the run's, as a block began
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} : ")  # every log line's start
EVAL_GAME = re.compile(r" : game \d+/\d+: reward ")  # a game line of gym_eval.py's log
LOADED = re.compile(r" : load: (?P<load>True|False)$")  # whether a block's run began with --load
# The run's name: a resume and a restarted test process log the same; the original logs none.
RUN_ID = re.compile(r" : tensorboard_dir: (?P<run>.+)$")


@dataclass
class TestGame:
    """One test game read back from a training log."""

    __test__ = False  # not a pytest test class, whatever its name

    seconds: float
    reward: float
    length: int
    steps: int | None
    frames: int | None


# Training curves


def parse_log(path: str | Path, all_runs: bool = False) -> list[TestGame]:
    """The test games of the last run in a training log, or of every run (`read_log`).

    Raises:
        UsageError: the file cannot be read, or holds no line of a training log.
    """
    return read_log(path, all_runs)[0]


@dataclass
class LogStart:
    """How the run kept from a log began: its first argument block's run id and settings."""

    run: str  # "" in the original's logs, which name none
    loaded: bool | None  # --load, where the block says
    steps_at_start: int | None


def read_log(path: str | Path, all_runs: bool = False) -> tuple[list[TestGame], LogStart]:
    """The test games of a log's last run (`all_runs`: every run's), and that run's `LogStart`."""
    text = _read_text(path, "log", "pass a <log-dir><env>_log file")
    lines = text.splitlines()
    # A last line with no newline is still being written, or was cut by a kill: no game yet.
    whole = lines if text.endswith("\n") else lines[:-1]
    games: list[TestGame] = []
    start = LogStart("", None, None)
    run: str | None = None  # the run the games so far belong to
    block: str | None = None  # the argument block read since the last game ("": no run id)
    block_steps: int | None = None  # its steps_at_start, where it has one
    block_loaded: bool | None = None  # its --load, where it says
    # By run id, since the last game: its first block's --load, its lowest steps_at_start.
    firsts: dict[str, tuple[bool | None, int | None]] = {}
    for line in whole:
        if match := STEPS_AT_START.search(line):
            block_steps = int(match["steps"])
            continue
        if match := LOADED.search(line):
            block_loaded = match["load"] == "True"
            continue
        if match := RUN_ID.search(line):
            block = Path(match["run"].strip()).name  # by name: a resume may name another --log-dir
            # (a block's load and steps_at_start lines come before its tensorboard_dir)
            loaded, steps = firsts.get(block, (block_loaded, block_steps))
            known = [s for s in (steps, block_steps) if s is not None]
            firsts[block] = (loaded, min(known, default=None))
            continue
        if ARGUMENT_BLOCK.search(line):
            block = block or ""
            continue
        match = LINE.search(line)
        if match is None:
            continue
        if block is not None:
            loaded, steps = firsts[block] if block else (block_loaded, block_steps)
            if block == "" or block != run:  # a new run
                if not all_runs:
                    games = []
                if not all_runs or run is None:
                    start = LogStart(block, loaded, steps)
            elif steps is not None:
                games = [g for g in games if g.steps is None or g.steps <= steps]  # trained again
            run, block, block_steps, block_loaded, firsts = block, None, None, None, {}
        seconds = int(match["h"]) * 3600 + int(match["m"]) * 60 + int(match["s"])
        steps = int(match["steps"]) if match["steps"] else None
        frames = int(match["frames"]) if match["frames"] else None
        games.append(TestGame(seconds, float(match["reward"]), int(match["length"]), steps, frames))
    if any(line.strip() for line in lines) and not any(LOG_LINE.match(line) for line in lines):
        raise UsageError(
            f"{str(path)!r} is not a training log (no line of one); pass a <log-dir><env>_log file"
        )
    if not games and any(EVAL_GAME.search(line) for line in lines):
        raise UsageError(
            f"{str(path)!r} is gym_eval.py's log, not a training log; pass a <log-dir><env>_log "
            "file (an evaluation's games are in its <env>_eval.json)"
        )
    return games, start


def _read_text(path: str | Path, what: str, wanted: str) -> str:
    """A file's text; if it cannot be read, a `UsageError` naming it, `what` it is and `wanted`."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        raise UsageError(f"{what} {str(path)!r} not found; {wanted}") from None
    except OSError as err:
        raise UsageError(f"cannot read {what} {str(path)!r} ({err.strerror}); {wanted}") from None


def parse_sittings(paths: list[str | Path]) -> list[TestGame]:
    """The test games of one run trained in several sittings, one log each, in order.

    A sitting resumed from its state goes on counting; one started from a ``.dat`` alone
    (counts lower than where the one before ended) is shifted to go on from its last game.

    Raises:
        UsageError: a file does not exist, or the logs are not one run's in the order written.
    """
    games: list[TestGame] = []
    before: LogStart | None = None
    for path in paths:
        sitting, start = read_log(path)
        if games and sitting and before is not None:
            order = "give each log of one run once, in the order they were written"
            if start.run and start.run == before.run:  # resumed from the run's training state
                if _starts_again(start, before, sitting[0], games[-1]):
                    raise UsageError(f"log {str(path)!r} starts its run again; {order}")
                if start.steps_at_start is not None:
                    games = [g for g in games if g.steps is None or g.steps <= start.steps_at_start]
            elif start.loaded is False:
                raise UsageError(
                    f"log {str(path)!r} is of another run, started without --load; {order}"
                )
            elif _count(sitting[0]) < _count(games[-1]):  # from a .dat alone: counts afresh
                last = games[-1]
                sitting = [
                    replace(
                        g,
                        seconds=g.seconds + last.seconds,
                        steps=_shift(g.steps, last.steps),
                        frames=_shift(g.frames, last.frames),
                    )
                    for g in sitting
                ]
        if sitting:  # a log with no game yet says nothing of the run the next one goes on
            games.extend(sitting)
            before = start
    return games


def _starts_again(start: LogStart, before: LogStart, first: TestGame, last: TestGame) -> bool:
    """Whether sitting `start` (first game `first`) cannot follow `before` (last game `last`)."""
    here, there = start.steps_at_start, before.steps_at_start
    if start.loaded is False or here == 0:  # the run's first sitting: given twice, or out of order
        return True
    if here is not None and there is not None:
        return here < there
    return here is None and _count(first) <= _count(last)  # older logs: by their counts


def _count(game: TestGame) -> float:
    """How far the run was at `game`: frames, else steps, else wall time."""
    return next(count for count in (game.frames, game.steps, game.seconds) if count is not None)


def _shift(count: int | None, by: int | None) -> int | None:
    return None if count is None or by is None else count + by


def moving_average(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over up to `window` points (shorter at the start)."""
    data = np.asarray(values, dtype=np.float64)
    sums = np.cumsum(np.insert(data, 0, 0.0))
    idx = np.arange(1, len(data) + 1)
    start = np.maximum(idx - window, 0)
    return (sums[idx] - sums[start]) / (idx - start)


def first_reaching(games: list[TestGame], reward: float, window: int = 10) -> TestGame | None:
    """The game where the mean of a full window of test games first reached `reward`, or None."""
    rewards = [g.reward for g in games]
    for end in range(window, len(games) + 1):
        if sum(rewards[end - window : end]) / window >= reward:
            return games[end - 1]
    return None


def describe_milestone(games: list[TestGame], reward: float, window: int = 10) -> str:
    """One line: when (wall time, frames, game number) the `window`-game mean reached `reward`."""
    reached = first_reaching(games, reward, window)
    if reached is None:
        not_yet = f"the mean of {window} test games has not reached {reward:g}"
        if len(games) < window:
            return f"{not_yet}: {len(games)} games so far, fewer than the window (--window sets it)"
        best = max(moving_average([g.reward for g in games], window)[window - 1 :])
        return f"{not_yet} in {len(games)} games (best {window}-game mean so far {best:.2f})"
    frames = f", {reached.frames:,} frames" if reached.frames is not None else ""
    return (
        f"the mean of the last {window} test games first reached {reward:g} after "
        f"{format_elapsed(reached.seconds)}{frames} (test game {games.index(reached) + 1})"
    )


def record_beside(log: Path) -> Path:
    """The run record beside a training log, ``<env>_run.json``.

    Beside ``<env>_log`` in logs/, and beside demo/'s ``<env>_train_log`` and its later parts.
    """
    return log.with_name(re.sub(r"(_train)?_log(_\d+)?$", "", log.name) + "_run.json")


def training_games(record_path: str | Path) -> list[list[float]]:
    """The workers' games ``[frames, seconds, score, steps]`` of a run record's sittings, in order.

    A sitting resumed from the state holds the earlier games already; one started from a
    ``.dat`` alone counts afresh and is shifted to go on from the sitting before. [] without a
    readable record.
    """
    try:
        record = json.loads(Path(record_path).read_text())
    except (OSError, ValueError):
        return []
    games: list[list[float]] = []
    before: list[list[float]] = []  # the sitting before's own games, as it counted them
    frames = seconds = 0.0  # what a sitting that counts afresh is shifted by
    for sitting in [*record.get("previous_runs", []), record]:
        own = (sitting.get("training_games") or {}).get("games") or []
        if before and own[: len(before)] == before:  # resumed: the earlier games, then its own
            fresh = own[len(before) :]
        else:
            fresh = own
            if own and games and own[0][0] < games[-1][0]:  # counts afresh from a .dat alone
                frames, seconds = games[-1][0], games[-1][1]
        games += [[f + frames, t + seconds, score, n] for f, t, score, n in fresh]
        before = own or before
    return games


def training_means(
    games: list[list[float]], at: float | None = None, window: int = 100, span: float = 4e6
) -> tuple[int, float, float]:
    """The workers' games by `at` frames (default: the last game's): count, last, spread.

    `last` is the mean of the last `window` games; `spread`, that rolling mean averaged over 101
    points of the last `span` frames: the published peers' measure (SLM-Lab averages its
    rolling 100-game training mean over the checkpoints of a run's last 1M agent steps, 4M
    frames). Points before the first full window are left out of it (NaN where none is full).
    """
    frames = np.asarray([game[0] for game in games], dtype=np.float64)
    at = frames[-1] if at is None else at
    count = int(np.searchsorted(frames, at, side="right"))
    if count < window:
        return count, math.nan, math.nan
    rolling = moving_average([game[2] for game in games[:count]], window)
    ends = np.searchsorted(frames[:count], np.linspace(at - span, at, 101), side="right")
    full = ends[ends >= window]
    spread = float(rolling[full - 1].mean()) if len(full) else math.nan
    return count, float(rolling[-1]), spread


def plot_curve(log_path: str | Path | list[str | Path], out: str | Path, window: int = 20) -> Path:
    """Write a PNG of the scores against frames and wall time, from a log or a run's sittings.

    The test games come from the logs; the workers' own games, where the run record beside the
    last log holds them, are drawn with a 100-game mean.

    Raises:
        UsageError: the log holds no finished test game yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = log_path if isinstance(log_path, list) else [log_path]
    games = parse_sittings(logs)
    if not games:
        names = ", ".join(repr(str(log)) for log in logs)
        raise UsageError(f"log {names} has no finished test game yet; try again later")
    rewards = [g.reward for g in games]
    if all(g.frames is not None for g in games):
        x_frames, x_label = [g.frames for g in games], "frames"
    elif all(g.steps is not None for g in games):
        x_frames, x_label = [g.steps for g in games], "agent steps"
    else:
        x_frames, x_label = list(range(1, len(games) + 1)), "test game"
    last = Path(logs[-1])
    # the workers' games are stamped with frames, so they share only a frames axis
    trained = training_games(record_beside(last)) if x_label == "frames" else []
    seconds = [g.seconds for g in games] + [game[1] for game in trained]
    unit, per = ("hours", 3600) if max(seconds) >= 2 * 3600 else ("min", 60)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for ax, time_axis in zip(axes, (False, True), strict=True):
        if trained:
            xs = [game[1] / per if time_axis else game[0] for game in trained]
            scores = [game[2] for game in trained]
            ax.plot(xs, scores, ".", alpha=0.15, color="tab:green", label="training game")
            mean = moving_average(scores, 100)
            ax.plot(xs, mean, "-", color="darkgreen", label="training, mean of last 100")
        xs = [g.seconds / per for g in games] if time_axis else x_frames
        ax.plot(xs, rewards, ".", alpha=0.35, color="tab:blue", label="test game")
        mean = moving_average(rewards, window)
        ax.plot(xs, mean, "-", color="tab:red", label=f"test, mean of last {window}")
        ax.set_xlabel(f"wall time ({unit})" if time_axis else x_label)
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    earlier = len(logs) - 1
    before = f" after {earlier} earlier log{'s' * (earlier > 1)}" if earlier else ""
    played = f", {len(trained)} training games" if trained else ""
    fig.suptitle(f"{last.name}{before}: {len(games)} test games{played}")
    fig.tight_layout()
    try:
        return write_image(out, lambda f: fig.savefig(f, format=Path(out).suffix[1:]))
    finally:
        plt.close(fig)


# What the agent sees

VIEW_RAW_SCALE = 2
VIEW_PROCESSED_SCALE = 4
VIEW_GAP = 20
VIEW_CAPTION = 30


def input_view(env_id: str, config_path: str | Path, steps: int = 60, seed: int = 0) -> np.ndarray:
    """A raw screen (crop rows outlined) beside the 80x80 frame the network gets, as RGB."""
    import gymnasium as gym

    from environment import ATARI_ENTRY_POINT, lookup_spec, process_frame

    if lookup_spec(env_id).entry_point != ATARI_ENTRY_POINT:
        raise UsageError(f"{env_id!r} is not an Atari game; the input view is for screen images")
    conf = env_config(read_config(config_path), env_id)
    env = gym.make(env_id)
    frame, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    for _ in range(steps * 4):
        frame, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            frame, _ = env.reset()
    env.close()

    gray = np.clip(process_frame(frame, conf)[0], 0, 255).astype(np.uint8)
    big_processed = _enlarge(np.dstack([gray] * 3), VIEW_PROCESSED_SCALE)
    raw = _enlarge(frame, VIEW_RAW_SCALE)
    top = conf["crop1"] * VIEW_RAW_SCALE
    bottom = min(conf["crop2"] + 160, frame.shape[0]) * VIEW_RAW_SCALE - 1
    cv2.rectangle(raw, (0, top), (160 * VIEW_RAW_SCALE - 1, bottom), (255, 0, 0), 1)

    height = max(raw.shape[0], big_processed.shape[0])
    width = raw.shape[1] + VIEW_GAP + big_processed.shape[1]
    canvas = np.full((height + VIEW_CAPTION, width, 3), 255, dtype=np.uint8)
    canvas[: raw.shape[0], : raw.shape[1]] = raw
    y0 = (height - big_processed.shape[0]) // 2
    x0 = raw.shape[1] + VIEW_GAP
    canvas[y0 : y0 + big_processed.shape[0], x0:] = big_processed
    captions = (
        (0, f"raw 210x160, rows {conf['crop1']}:{conf['crop2'] + 160} kept"),
        (x0, "network input 80x80 (before normalising)"),
    )
    for x, text in captions:
        cv2.putText(
            canvas, text, (x + 4, height + 20), cv2.FONT_HERSHEY_SIMPLEX, 0.42, (0, 0, 0), 1,
            cv2.LINE_AA,
        )  # fmt: skip
    return canvas


def _enlarge(image: np.ndarray, scale: int) -> np.ndarray:
    """`image` `scale` times as tall and wide, each pixel a square of `scale` x `scale`."""
    return image.repeat(scale, axis=0).repeat(scale, axis=1)


def write_png(image: np.ndarray, out: str | Path) -> Path:
    """Save an RGB array as PNG."""
    bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
    return write_image(out, lambda f: f.write(cv2.imencode(Path(out).suffix, bgr)[1].tobytes()))


def write_image(out: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write an image file, in the format its suffix names, with `checkpoint.write_atomic`.

    Raises:
        UsageError: the file cannot be written, or its suffix names no image format.
    """
    not_an_image = f"cannot write {str(out)!r}: not an image name; end it in .png (.gif for a GIF)"
    if not Path(out).suffix:
        raise UsageError(not_an_image)
    try:
        write_atomic(out, write)
    except OSError as err:
        raise UsageError(
            f"cannot write {str(out)!r} ({err.strerror}); choose a folder you can write"
        ) from None
    except (ValueError, KeyError, cv2.error):  # a format unknown to matplotlib, Pillow, OpenCV
        raise UsageError(not_an_image) from None
    return Path(out)


def write_gif(frames: list[np.ndarray], out: str | Path, fps: float = 15) -> Path:
    """Write RGB frames as a looping GIF (Pillow, which matplotlib already brings)."""
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]

    def save(f: BinaryIO) -> None:
        image_format = Image.registered_extensions()[Path(out).suffix.lower()]  # KeyError: none
        images[0].save(
            f, format=image_format, save_all=True, append_images=images[1:],
            duration=round(1000 / fps), loop=0,
        )  # fmt: skip

    return write_image(out, save)


# Results table


def protocol_parts(protocol: dict[str, Any] | None) -> tuple[str, str]:
    """A protocol dict's (or None's) results-table cell, its sticky actions, and the rest.

    The rest (frame skip, no-op starts, cap, a stall cut) goes under the table, once for the
    rows that share it.
    """
    if not protocol:
        return "?", "?"
    stall = protocol.get("stall_steps")
    tail = [f"cap {protocol['episode_cap_steps']:,} steps"]
    tail += [f"games cut after {stall:,} steps without a reward"] if stall else []
    if "repeat_action_probability" not in protocol:  # `environment.protocol` outside Atari
        return "not an ALE game", ", ".join(tail)
    sticky = protocol["repeat_action_probability"]
    rest = []
    skip = protocol.get("frame_skip")
    if skip is not None:
        skip_text = f"{skip[0]}-{skip[1]}" if isinstance(skip, list) else str(skip)
        pooled = " max-pooled" if protocol.get("max_pool_frames") else ""
        rest.append(f"skip {skip_text}{pooled}")
    noops = protocol.get("noop_starts")
    if noops is not None:
        rest.append(f"1-{noops} no-op starts" if noops else "no no-op starts")
    return (f"sticky {sticky:g}" if sticky else "deterministic"), ", ".join(rest + tail)


# Left out of a results row's command: they change nothing trained, and name a machine's folders.
FOLDER_FLAGS = ("--save-model-dir", "-smd", "--load-model-dir", "-lmd", "--log-dir", "-lg", "-lgd")
_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?|-inf|-nan", re.IGNORECASE)


def _flag_words(command: str) -> list[tuple[str, list[str]]]:
    """A recorded command's words by flag: ``[("", ["python", "main.py"]), ("--lr", ["--lr=1"])]``.

    The words are a shell's (run records quote with `shlex`); a flag is named as spelled, up to
    any ``=``; -1 is a value, not a flag.
    """
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: the words as they stand
        words = command.split()
    groups: list[tuple[str, list[str]]] = [("", [])]
    for word in words:
        if word.startswith("-") and not _NUMBER.fullmatch(word):
            groups.append((word.partition("=")[0], []))
        groups[-1][1].append(word)
    return groups


def without_folders(command: str) -> str:
    """`command` without its folder flags (`FOLDER_FLAGS`) and their values."""
    groups = _flag_words(command)
    return shlex.join(word for flag, words in groups if flag not in FOLDER_FLAGS for word in words)


def _flag_values(command: str) -> dict[str, tuple[str, ...]]:
    """What a command trains with: its values by long flag (``-s 2``: {"--seed": ("2",)}).

    ``""`` holds the words before any flag. The folder flags and ``--load`` are left out: a later
    part of a run names them, and they change nothing trained.
    """
    long_form = _main_py_long_forms()
    (_, program), *groups = _flag_words(command)
    flags = {"": tuple(program)}
    for flag, (word, *values) in groups:
        if flag not in (*FOLDER_FLAGS, "--load"):
            joined = [word.partition("=")[2]] if "=" in word else []  # --flag=value
            flags[long_form.get(flag, flag)] = (*joined, *values)
    return flags


@functools.cache
def _main_py_long_forms() -> dict[str, str]:
    """main.py's flag spellings -> the long form (``-s`` -> ``--seed``; ``--no-x`` stays)."""
    forms = {}
    for action in cli.build_parser(cli.TrainConfig, "")._actions:
        names = [name for name in action.option_strings if not name.startswith("--no-")]
        forms.update({name: names[0] for name in names})
    return forms


def resumed_note(sittings: int, restarts: int, commands: list[str | None] | None = None) -> str:
    """A results row's note on a run trained in sittings, naming the flags later parts changed."""
    if sittings <= 1:
        return ""
    fresh = f", {restarts} of them from the `.dat` alone" if restarts else ""
    groups: list[list] = []  # [first part, last part, flags] of each run of equal flags
    for part, command in enumerate(commands or [], 1):
        flags = _flag_values(command) if command else None
        if groups and flags in (None, groups[-1][2]):
            groups[-1][1] = part
        elif flags is not None:
            groups.append([part, part, flags])
    notes = []
    for first, last, flags in groups[1:]:
        changed = _changes(groups[0][2], flags)
        parts = f"part {first}" if first == last else f"parts {first}-{last}"
        notes.append(f"; {parts}: " + (f"`{changed}`" if changed else f"as part {groups[0][0]}"))
    return f" (resumed with `--load`: {sittings} parts in all{fresh}{''.join(notes)})"


def _changes(first: dict[str, tuple[str, ...]], later: dict[str, tuple[str, ...]]) -> str:
    """`later`'s flags that differ from `first`'s ("" if none), dropped ones as ``without --x``."""
    changed = {flag: values for flag, values in later.items() if first.get(flag) != values}
    dropped = {f"without {flag}": values for flag, values in first.items() if flag not in later}
    shown = {**changed, **dropped}
    return " ".join(" ".join((flag, *values)).strip() for flag, values in shown.items())


SUMMARY_KEYS = {"env", "mean", "std", "best", "games"}  # what a results row needs of a summary


def results_table(paths: list[str | Path]) -> str:
    """The README's results table from `gym_eval.py` JSON summaries, one row per file.

    Under the table, the evaluations' frame skip, no-op starts and cap, once for the rows that
    share them, then each row's training command, with the flags its later parts changed.
    """
    rows = [
        "| game | score ± std (100 games) | evaluated under | trained under | frames | hours "
        "| hardware |",
        "|---|---|---|---|---|---|---|",
    ]
    commands: list[str] = []
    protocols: dict[str, list[str]] = {}  # the rest of each evaluation's protocol: its rows
    for path in paths:
        wanted = "pass <log-dir><env>_eval.json files"
        text = _read_text(path, "eval summary", wanted)
        try:
            summary = json.loads(text)
        except ValueError:
            raise UsageError(
                f"{str(path)!r} is not a gym_eval.py summary (not JSON); {wanted}"
            ) from None
        if not isinstance(summary, dict) or not summary.keys() >= SUMMARY_KEYS:
            raise UsageError(f"{str(path)!r} is not a gym_eval.py summary; {wanted}")
        try:
            row, command, rest = _results_row(summary)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise UsageError(
                f"{str(path)!r} is not a gym_eval.py summary this version reads ({err!r}); "
                "evaluate the model again to remake it"
            ) from None
        rows.append(row)
        if rest != "?":
            protocols.setdefault(rest, []).append(str(len(rows) - 2))
        if command not in commands:  # two protocols' rows of one run: its command once
            commands.append(command)
    if len(protocols) == 1:
        evaluated = [f"Every game: {next(iter(protocols))}.", ""]
    else:
        evaluated = [
            f"- row{'s' * (len(r) > 1)} {', '.join(r)}: {rest}" for rest, r in protocols.items()
        ]
        evaluated = ["Evaluated with:", "", *evaluated, ""] if evaluated else []
    return "\n".join([*rows, "", *evaluated, "Trained with:", "", *commands])


def _results_row(summary: dict[str, Any]) -> tuple[str, str, str]:
    """A summary's row of `results_table`, its training command, and the rest of its protocol.

    A value of the wrong type raises TypeError or ValueError.
    """
    env = summary["env"]
    training = summary.get("training") or {}
    interrupted = ", interrupted" if summary.get("interrupted") else ""
    games = summary["games"]
    played = f" ({games} games{interrupted})" if games != 100 or interrupted else ""
    frames = training.get("frames")
    seconds = training.get("seconds")
    hours = None if seconds is None else seconds / 3600
    anchor = re.sub(r"[^\w\- ]", "", env.lower()).replace(" ", "-")  # GitHub's, for ``## <env>``
    evaluated, rest = protocol_parts(summary.get("protocol"))
    cells = [
        f"[{env}](docs/results.md#{anchor})",
        f"{summary['mean']:.2f} ± {summary['std']:.2f}{played}",
        evaluated,
        protocol_parts(training.get("protocol"))[0],
        "?" if frames is None else f"{frames:,}",
        # Tenths of an hour, or two figures for a run shorter than one (CartPole's 0.015).
        "?" if hours is None else f"{hours:.1f}" if hours >= 0.95 else f"{hours:.2g}",
        training.get("hardware") or "?",
    ]
    command = training.get("command")
    shown = without_folders(command) if command else "?"
    resumed = resumed_note(
        training.get("sittings", 1), training.get("restarts", 0), training.get("commands")
    )
    return f"| {' | '.join(cells)} |", f"- {env}: `{shown}`{resumed}", rest


# Command line


def build_parser() -> argparse.ArgumentParser:
    """The ``curve``, ``view``, ``milestone``, ``training`` and ``table`` subcommands."""
    p = OneLineParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(
        dest="command", required=True, metavar="{curve,view,milestone,training,table}"
    )
    curve = sub.add_parser("curve", help="PNG of the scores vs frames and wall time from a log")
    curve.add_argument(
        "log",
        nargs="+",
        help="a training log, <log-dir><env>_log (a run still going is ok); several: the "
        "sittings of one run in order (one started from a .dat alone goes on from the last)",
    )
    curve.add_argument("--out", help="PNG path (default: beside the log, <env>_curve.png)")
    curve.add_argument("--window", type=int, default=20, help="moving-average window (games)")
    view = sub.add_parser("view", help="PNG of a raw frame beside the processed 80x80 input")
    view.add_argument("--env", "-ev", default="PongNoFrameskip-v4", help="Atari id")
    view.add_argument("--env-config", "-evc", default=DEFAULT_CONFIG, help="crop settings")
    view.add_argument("--steps", type=int, default=60, help="random steps before the snapshot")
    view.add_argument("--seed", type=int, default=0, help="game and action seed")
    view.add_argument("--out", help="PNG path (default: demo/<env>_view.png)")
    milestone = sub.add_parser(
        "milestone", help="when the mean of the last N test games first reached a reward"
    )
    milestone.add_argument(
        "log", nargs="+", help="a training log, <log-dir><env>_log; several: as for curve"
    )
    milestone.add_argument(
        "--reward",
        type=float,
        nargs="+",
        default=[18.0],
        help="the reward(s) to reach, one line each (default 18, Pong's; e.g. 50 100 200 300 "
        "400 for Breakout, 475 for CartPole)",
    )
    milestone.add_argument("--window", type=int, default=10, help="games in the mean (10)")
    training = sub.add_parser(
        "training", help="the workers' own games by a frame count: the peers' measures"
    )
    training.add_argument("record", help="a run record, <log-dir><env>_run.json")
    training.add_argument(
        "--at", type=float, help="frames the measures stop at (default: the last game's)"
    )
    table = sub.add_parser("table", help="markdown results table from gym_eval JSON summaries")
    table.add_argument("summaries", nargs="+", help="<log-dir><env>_eval.json files")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the exit code (0 ok, 2 bad input, 130 Ctrl-C)."""
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "window", 1) < 1:  # curve's and milestone's
            raise UsageError(f"--window must be at least 1, got {args.window}")
        if args.command == "curve":
            log = Path(args.log[-1])
            out = args.out or log.with_name(log.name.removesuffix("_log") + "_curve.png")
            print(plot_curve(list(args.log), out, args.window))
        elif args.command == "view":
            if args.steps < 0:
                raise UsageError(f"--steps must be 0 or more, got {args.steps}")
            if not 0 <= args.seed <= MAX_SEED:
                raise UsageError(f"--seed must be in 0..{MAX_SEED}, got {args.seed}")
            out = args.out or f"demo/{env_file_stem(args.env)}_view.png"
            if not args.out and Path(out).exists():  # demo/ holds the shipped pictures
                print(f"visualize.py: writing over {out}; --out keeps it", file=sys.stderr)
            print(write_png(input_view(args.env, args.env_config, args.steps, args.seed), out))
        elif args.command == "milestone":
            for reward in args.reward:
                if not math.isfinite(reward):
                    raise UsageError(f"--reward must be a finite number, got {reward}")
            games = parse_sittings(args.log)
            if not games:
                names = ", ".join(repr(log) for log in args.log)
                raise UsageError(f"log {names} has no finished test game yet")
            for reward in args.reward:
                print(describe_milestone(games, reward, args.window))
        elif args.command == "training":
            games = training_games(args.record)
            if not games:
                raise UsageError(f"run record {args.record!r} holds no training game")
            count, last, spread = training_means(games, args.at)
            at = f"{args.at if args.at is not None else games[-1][0]:,.0f}"
            print(f"{count:,} training games by {at} frames")
            print(f"the last 100: mean {last:.1f}")
            print(f"their rolling mean over the last 4M frames (SLM-Lab's measure): {spread:.1f}")
        else:
            print(results_table(args.summaries))
    except UsageError as err:
        print(f"visualize.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # no file half-written: pictures are written atomically
        print("visualize.py: stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
