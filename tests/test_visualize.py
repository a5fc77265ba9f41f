"""Evidence: TensorBoard tags, the status line, the run record, curves, input views, GIFs, table."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from environment import protocol
from tests.conftest import ROOT, script_here
from utils import UsageError
from visualize import (
    TestGame,
    describe_milestone,
    first_reaching,
    moving_average,
    parse_log,
    parse_sittings,
    protocol_parts,
    results_table,
    resumed_note,
    without_folders,
    write_gif,
)

TRAIN_TAGS = {
    "train/fps", "train/lr", "train/policy_loss", "train/value_loss", "train/entropy",
    "train/grad_norm", "train/grad_norm/lstm", "train/grad_norm/actor_linear",
    "train/grad_norm/critic_linear", "train/grad_norm/fc1", "train/episode_score",
}  # fmt: skip
TEST_TAGS = {"test/episode_reward", "test/episode_length", "test/reward_mean_100"}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 30,000-step CartPole run with TensorBoard, frequent status lines, a linear lr."""
    out = tmp_path_factory.mktemp("run")
    result = subprocess.run(
        [sys.executable, "main.py", "--env", "CartPole-v1", "--workers", "2",
         "--max-steps", "30000", "--hidden-size", "32", "--lr", "0.001", "--lr-schedule", "linear",
         "--reward-scale", "0.1", "--test-interval", "0.2", "--status-interval", "1",
         "--tensorboard-logger", "--save-model-dir", str(out), "--log-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return out, result


@pytest.mark.slow
def test_tensorboard_has_every_tag_against_increasing_frames(short_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = short_run
    runs = list((out / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("CartPole-v1_")
    events = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags >= TRAIN_TAGS | TEST_TAGS, sorted(TRAIN_TAGS | TEST_TAGS - tags)
    for tag in ("train/fps", "train/policy_loss", "test/episode_reward"):
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > steps[0], tag
    assert steps[-1] <= 30000 + 100  # x axis is frames (CartPole: one per step)
    lrs = [(e.step, e.value) for e in events.Scalars("train/lr")]
    for frames, lr in lrs:  # --lr-schedule linear: 0.001 at frame 0, 0 at 30,000
        assert lr == pytest.approx(0.001 * max(0.0, 1 - frames / 30000), rel=1e-4, abs=1e-9)
    assert lrs[0][1] > 0.0005 and lrs[-1][1] == 0.0
    assert {"lstm.weight_ih", "actor_linear.weight"} <= set(events.Tags()["histograms"])
    assert events.Tags()["graph"]


@pytest.mark.slow
def test_status_lines_come_at_a_steady_rhythm(short_run):
    _, result = short_run
    lines = [line for line in result.stderr.splitlines() if " : status " in line]
    assert len(lines) >= 3
    assert all("frames/s" in line and "steps" in line for line in lines)
    assert "best" in lines[-1] and "games)" in lines[-1]
    # At --status-interval 1, one a second (the last, at the stop, may come sooner).
    times = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in lines[:-1]]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    assert 0.8 <= statistics.median(gaps) <= 1.5, gaps


@pytest.mark.slow
def test_run_record_holds_configuration_versions_and_outcome(short_run):
    out, _ = short_run
    record = json.loads((out / "CartPole-v1_run.json").read_text())
    assert record["config"]["workers"] == 2 and record["config"]["max_steps"] == 30000
    assert {"torch", "gymnasium", "ale_py", "numpy", "python"} <= set(record["versions"])
    assert "CPU cores" in record["hardware"]
    assert "--max-steps 30000" in record["command"]
    finished = record["finished"]
    assert finished["steps"] >= 30000 and finished["exit_code"] == 0
    assert finished["test_games"] > 0 and finished["frames"] == finished["steps"]
    games = record["training_games"]
    assert games["columns"] == ["frames", "seconds", "score", "steps"]
    rows = games["games"]
    assert len(rows) == finished["training_games"] > 100
    assert all(score == steps >= 8 for _, _, score, steps in rows)  # CartPole: 1 a step
    frames = [row[0] for row in rows]
    assert frames == sorted(frames) and frames[0] >= 0 and frames[-1] <= finished["frames"]
    assert finished["training_score_mean_100"] == pytest.approx(
        statistics.mean(row[2] for row in rows[-100:])
    )


@pytest.mark.slow
def test_curve_png_is_written_at_the_end_and_on_demand(short_run, tmp_path):
    out, _ = short_run
    assert cv2.imread(str(out / "CartPole-v1_curve.png")) is not None
    png = tmp_path / "curve.png"
    result = subprocess.run(
        [sys.executable, "visualize.py", "curve", str(out / "CartPole-v1_log"), "--out", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    image = cv2.imread(str(png))
    assert image is not None and image.shape == (450, 1200, 3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 10  # not blank


def test_curve_of_a_log_with_no_game_says_so(tmp_path):
    log = tmp_path / "Pong_log"
    log.write_text("2026-01-01 00:00:00,000 : workers: 2\n")
    result = script_here("visualize.py", "curve", str(log))
    assert result.returncode == 2 and "no finished test game yet" in result.stderr


def test_parse_log_reads_our_lines_and_the_originals(tmp_path):
    log = tmp_path / "x_log"
    log.write_text(
        "2026-01-01 00:00:00,000 : workers: 2\n"
        "2026-01-01 00:01:00,000 : Time 00h 00m 40s, episode reward -21.0, episode length 764, "
        "reward mean -21.0000\n"
        "2026-01-01 00:00:00,000 : workers: 4\n"
        "2026-01-01 00:02:00,000 : Time 01h 02m 03s, episode reward 3.0, episode length 900, "
        "reward mean 3.0000, total steps 1000, total frames 4000, frames/s 12\n"
    )
    games = parse_log(log)  # the last run only
    assert len(games) == 1
    assert games[0].seconds == 3723 and games[0].reward == 3.0 and games[0].frames == 4000
    both = parse_log(log, all_runs=True)
    assert [g.reward for g in both] == [-21.0, 3.0] and both[0].steps is None
    # A killed run's last line, cut as it was written, is no game (its counts would be cut,
    # or missing), nor is it where the next sitting's first line continues it.
    whole = _game(50, 5.0, 3490)
    cuts = [
        whole.index("reward mean") + 13, whole.index(", total steps"),
        whole.index("total frames") + 16, whole.index(", frames/s"), len(whole) - 3,
    ]  # fmt: skip
    for cut in cuts:
        for after in ("", _block("r", 3000) + _game(60, 6.0, 3600)):
            log.write_text(_block("r") + _game(40, 4.0, 2000) + whole[:cut] + after)
            games = [(g.reward, g.steps) for g in parse_log(log)]
            assert games == [(4.0, 2000)] + [(6.0, 3600)] * bool(after), whole[:cut]
    log.write_text(_game(40, 4.0, 2000) + whole)
    assert [g.frames for g in parse_log(log)] == [8000, 13960]
    # The first day's lines (2026-11-21) had no total frames.
    log.write_text(whole.replace(", total frames 13960", ""))
    assert [(g.steps, g.frames) for g in parse_log(log)] == [(3490, None)]


def _game(seconds: int, reward: float, steps: int) -> str:
    return (
        f"2026-01-01 00:00:00,000 : Time 00h 00m {seconds:02d}s, episode reward {reward}, "
        f"episode length 800, reward mean 0.0, total steps {steps}, total frames {4 * steps}, "
        "frames/s 100\n"
    )


def _block(
    run: str, steps_at_start: int | None = None, runs: str = "logs/runs/", load: bool | None = None
) -> str:
    start = "" if load is None else f"2026-01-01 00:00:00,000 : load: {load}\n"
    if steps_at_start is not None:
        start += f"2026-01-01 00:00:00,000 : steps_at_start: {steps_at_start}\n"
    return (
        f"{start}2026-01-01 00:00:00,000 : tensorboard_dir: {runs}{run}\n"
        "2026-01-01 00:00:00,000 : workers: 2\n"
    )


def test_parse_log_keeps_a_run_across_test_restarts_and_resumes(tmp_path):
    log = tmp_path / "x_log"
    log.write_text(
        _block("old")
        + _game(5, -21.0, 100)
        + _block("pong_1")  # a new run
        + _game(10, -21.0, 1000)
        + _game(20, -20.0, 2000)
        + _block("pong_1")  # the test process restarted
        + _game(30, -19.0, 3000)
        + _block("pong_1")  # --load resumed it
        + _block("pong_1")  # twice, with no game between
        + _game(40, -18.0, 4000)
    )
    games = parse_log(log)
    assert [g.reward for g in games] == [-21.0, -20.0, -19.0, -18.0]
    assert [g.steps for g in games] == [1000, 2000, 3000, 4000]
    assert len(parse_log(log, all_runs=True)) == 5
    log.write_text(log.read_text() + _block("pong_2") + _game(3, 1.0, 10))
    assert [g.reward for g in parse_log(log)] == [1.0]


def test_a_resume_from_an_older_state_drops_the_games_of_the_stretch_trained_again(tmp_path):
    log = tmp_path / "x_log"
    log.write_text(
        _block("pong_1", 0)
        + _game(10, -21.0, 1000)
        + _game(20, -20.0, 2000)  # the state was saved at 1,500 steps, then the run was killed
        + _game(30, -19.0, 3000)
        + _block("pong_1", 1500, runs="/elsewhere/logs/runs/")  # resumed (another --log-dir)
        + _game(40, -18.0, 2500)
        + _block("pong_1", 3100)  # the test process restarted: nothing is dropped
        + _game(50, -17.0, 3200)
    )
    games = parse_log(log)
    assert [(g.steps, g.reward) for g in games] == [(1000, -21.0), (2500, -18.0), (3200, -17.0)]
    assert [g.steps for g in parse_log(log, all_runs=True)] == [1000, 2500, 3200]


def test_sittings_out_of_order_twice_or_of_two_runs_are_refused_not_joined(tmp_path):
    first, resumed, other = tmp_path / "a_log", tmp_path / "b_log", tmp_path / "c_log"
    first.write_text(_block("r1", 0, load=False) + _game(10, 1.0, 1000) + _game(20, 2.0, 2000))
    # resumed from a state saved at 1,500 steps (in another --log-dir): 2,000 was trained again
    resumed.write_text(_block("r1", 1500, load=True) + _game(30, 3.0, 2500))
    other.write_text(_block("r2", 0, load=False) + _game(5, 4.0, 500))  # a fresh run
    games = parse_sittings([first, resumed])
    assert [(g.steps, g.reward) for g in games] == [(1000, 1.0), (2500, 3.0)]
    # A run started in the log after the last game (its first game not yet played) is not
    # the run the log's games are of.
    first.write_text(first.read_text() + _block("r9", 0, load=False))
    assert parse_sittings([first, resumed]) == games
    older = tmp_path / "d_log"  # written before logs said steps_at_start
    older.write_text(_block("r0", load=False) + _game(10, 1.0, 1000))
    # resumed with --load, from a log written before logs said steps_at_start
    resumed_old = tmp_path / "f_log"
    resumed_old.write_text(_block("r1", load=True) + _game(40, 4.0, 3000))
    # a sitting killed before its first game says nothing: the next one still drops 2,000
    empty = tmp_path / "g_log"
    empty.write_text(_block("r1", 1800, load=True))
    assert parse_sittings([first, empty, resumed]) == games
    again = tmp_path / "h_log"  # resumed once more, after b_log's sitting
    again.write_text(_block("r1", 2600, load=True) + _game(50, 5.0, 2700))
    assert [g.steps for g in parse_sittings([first, resumed, again])] == [1000, 2500, 2700]
    assert parse_sittings([first, resumed, resumed]) == games  # known steps: taken once
    later = tmp_path / "e_log"  # another fresh run, whose counts happen to be higher
    later.write_text(_block("r3", 0, load=False) + _game(50, 5.0, 9000))
    # A fresh run stopped before its first game, then resumed: its log's run began fresh.
    quick = tmp_path / "i_log"
    quick.write_text(  # another run's block between them
        _block("r4", 0, load=False)
        + _block("r5", 0, load=False)
        + _block("r4", 900, load=True)
        + _game(60, 6.0, 1000)
    )
    for logs, says in (
        ([first, first], "a_log' starts its run again; give each log of one run once, in"),
        ([resumed, first], "a_log' starts its run again"),
        ([older, older], "d_log' starts its run again"),
        ([first, resumed_old, resumed_old], "f_log' starts its run again"),
        ([first, again, resumed], "b_log' starts its run again"),  # sittings out of order
        ([first, other], "c_log' is of another run, started without --load; give each log"),
        ([first, later], "e_log' is of another run, started without --load"),
        ([first, quick], "i_log' is of another run, started without --load"),
    ):
        with pytest.raises(UsageError, match=re.escape(says)):
            parse_sittings(logs)


def test_sittings_join_a_run_resumed_from_its_state_and_one_from_a_dat_alone(tmp_path):
    first, resumed, fresh = tmp_path / "a_log", tmp_path / "b_log", tmp_path / "c_log"
    first.write_text(_block("r1") + _game(10, 1.0, 1000) + _game(20, 2.0, 2000))
    resumed.write_text(_block("r1") + _game(30, 3.0, 3000))  # --load from the state: counts go on
    fresh.write_text(_block("r2") + _game(5, 4.0, 500) + _game(15, 5.0, 900))  # from a .dat
    games = parse_sittings([first, resumed, fresh])
    assert [g.reward for g in games] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [g.steps for g in games] == [1000, 2000, 3000, 3500, 3900]
    assert [g.frames for g in games] == [4000, 8000, 12000, 14000, 15600]
    assert [g.seconds for g in games] == [10, 20, 30, 35, 45]
    assert parse_sittings([fresh]) == parse_log(fresh)

    result = script_here(
        "visualize.py",
        "milestone",
        str(first),
        str(resumed),
        str(fresh),
        "--reward",
        "4.5",
        "--window",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "first reached 4.5 after 00h 00m 45s, 15,600 frames (test game 5)" in result.stdout
    png = tmp_path / "joined.png"
    result = script_here("visualize.py", "curve", str(first), str(fresh), "--out", str(png))
    assert result.returncode == 0, result.stderr
    assert cv2.imread(str(png)) is not None


def test_milestone_is_the_first_full_window_reaching_the_reward(tmp_path):
    rewards = [19.0, 15, 16, 17, 18, 19, 20, 21, 21]
    games = [TestGame(60.0 * i, r, 800, 1000 * i, 4000 * i) for i, r in enumerate(rewards, 1)]
    # Means of 3, by hand: 16.67 (games 1-3), 16, 17, then 18 (games 4-6): the 6th game.
    assert first_reaching(games, 18.0, window=3) is games[5]
    assert first_reaching(games, 21.0, window=2) is games[8]
    assert first_reaching(games, 19.0, window=1) is games[0]
    assert first_reaching(games, 21.5, window=3) is None
    assert describe_milestone(games, 18.0, 3) == (
        "the mean of the last 3 test games first reached 18 after 00h 06m 00s, 24,000 frames "
        "(test game 6)"
    )
    assert "has not reached 21.5 in 9 games (best 3-game mean so far 20.67)" in (
        describe_milestone(games, 21.5, 3)
    )
    # Fewer games than the window: every game above the reward is still no mean of 10.
    assert describe_milestone(games, 0.0, 10) == (
        "the mean of 10 test games has not reached 0: 9 games so far, fewer than the window "
        "(--window sets it)"
    )

    log = tmp_path / "x_log"
    log.write_text(_block("r") + "".join(_game(10 + i, r, 100 * i) for i, r in enumerate(rewards)))
    result = script_here(
        "visualize.py", "milestone", str(log), "--reward", "18", "21.5", "--window", "3"
    )
    assert result.returncode == 0, result.stderr
    reached, not_reached = result.stdout.splitlines()
    assert "first reached 18 after 00h 00m 15s, 2,000 frames (test game 6)" in reached
    assert "has not reached 21.5" in not_reached


def test_moving_average_by_hand():
    np.testing.assert_allclose(moving_average([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])


def test_input_view_has_the_expected_size(tmp_path):
    png = tmp_path / "view.png"
    result = script_here(
        "visualize.py",
        "view",
        "--env",
        "BreakoutNoFrameskip-v4",
        "--steps",
        "10",
        "--out",
        str(png),
    )
    assert result.returncode == 0, result.stderr
    image = cv2.imread(str(png))
    assert image.shape == (450, 660, 3)
    # The processed panel is gray: its three channels are equal.
    panel = image[50:370, 340:660]
    assert np.array_equal(panel[..., 0], panel[..., 1])


def test_input_view_by_default_writes_in_demo_and_says_when_it_writes_over_one(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # demo/ here holds the shipped pictures
    view = ["visualize.py", "view", "--steps", "0", "--env-config", str(ROOT / "config.json")]
    first = script_here(*view)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    shipped = tmp_path / "demo" / "PongNoFrameskip-v4_view.png"
    assert cv2.imread(str(shipped)) is not None
    again = script_here(*view)
    assert again.returncode == 0
    assert again.stderr == (
        "visualize.py: writing over demo/PongNoFrameskip-v4_view.png; --out keeps it\n"
    )


def test_input_view_rejects_non_atari_ids(tmp_path):
    result = script_here("visualize.py", "view", "--env", "CartPole-v1")
    assert result.returncode == 2 and "not an Atari game" in result.stderr


def test_gif_writer_keeps_every_frame(tmp_path):
    frames = [np.full((21, 16, 3), 10 * i, dtype=np.uint8) for i in range(12)]
    path = write_gif(frames, tmp_path / "demo" / "x.gif", fps=15)
    with Image.open(path) as gif:
        assert gif.n_frames == 12 and gif.size == (16, 21)
        assert gif.info["loop"] == 0


def test_an_interrupted_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    from PIL import Image as PILImage

    frames = [np.full((21, 16, 3), 10 * i, dtype=np.uint8) for i in range(3)]
    path = write_gif(frames, tmp_path / "x.gif")
    before = path.read_bytes()

    def interrupted(self, fp, *args, **kwargs):
        fp.write(b"GIF89a half")  # part of the file, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(PILImage.Image, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_gif(frames[::-1], path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["x.gif"]


def test_an_image_in_a_folder_that_takes_no_files_is_one_line_naming_it():
    from visualize import write_png

    with pytest.raises(UsageError, match=r"cannot write '/sys/x.png' \(.+\); choose a folder"):
        write_png(np.zeros((4, 4, 3), np.uint8), "/sys/x.png")  # /sys takes no new file


def test_a_game_video_gets_its_name_only_when_the_game_ended(tmp_path):
    from gym_eval import VideoRecorder

    frame = np.zeros((210, 160, 3), np.uint8)
    ended, stopped = (VideoRecorder(tmp_path / f"{name}.mp4", 15) for name in ("ended", "stopped"))
    for recorder in (ended, stopped):
        recorder.add(frame)
        recorder.add(frame)
    ended.close()
    ended.discard()  # what play_games's finally does after every game: nothing left to drop
    stopped.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ended.mp4"]
    assert (tmp_path / "ended.mp4").stat().st_size > 0


@pytest.mark.slow
def test_gym_eval_writes_a_demo_gif_and_mp4(tmp_path):
    import gymnasium as gym
    import torch

    from model import A3Clstm

    (tmp_path / "models").mkdir()
    model = A3Clstm(1, gym.spaces.Discrete(6), 32)
    torch.save(model.state_dict(), tmp_path / "models" / "PongNoFrameskip-v4.dat")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "PongNoFrameskip-v4.gif").write_bytes(b"an earlier demo")
    result = subprocess.run(
        [sys.executable, "gym_eval.py", "--num-episodes", "2", "--hidden-size", "32",
         "--max-episode-length", "40", "--demo", "--demo-dir", str(tmp_path / "demo"),
         "--load-model-dir", str(tmp_path / "models"), "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    gif_path = tmp_path / "demo" / "PongNoFrameskip-v4.gif"
    assert f"--demo will write over {gif_path}; another --demo-dir keeps them" in result.stderr
    summary = json.loads((tmp_path / "logs" / "PongNoFrameskip-v4_eval.json").read_text())
    with Image.open(gif_path) as gif:
        # One frame per agent step of the first game, shown 1/15 s each. Pillow merges
        # identical neighbours (Pong's screen stands still between points) and adds up their
        # durations, which GIF keeps in whole centiseconds: so the count may fall short of the
        # steps, but the play time is the game's, within 10 ms per stored frame.
        steps = summary["lengths"][0]
        assert 0 < gif.n_frames <= steps and gif.size == (160, 210)
        shown_ms = 0
        for index in range(gif.n_frames):
            gif.seek(index)
            shown_ms += gif.info["duration"]
        assert abs(shown_ms - steps * round(1000 / 15)) <= 10 * gif.n_frames, (shown_ms, steps)
    assert (tmp_path / "demo" / "PongNoFrameskip-v4.mp4").stat().st_size > 1000


def test_gym_eval_renders_only_the_games_it_keeps_screens_of(tmp_path):
    import gymnasium as gym
    import torch

    from cli import parse_eval_args
    from gym_eval import play_games
    from model import A3Clstm

    model = tmp_path / "Pong.dat"
    torch.save(A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(), model)
    args = parse_eval_args(
        ["--hidden-size", "32", "--max-episode-length", "30", "--demo",
         "--demo-dir", str(tmp_path / "demo"), "--log-dir", str(tmp_path / "logs")]
    )  # fmt: skip
    renders: list[int] = []

    class CountRenders(gym.Wrapper):
        def render(self):
            renders[-1] += 1
            return self.env.render()

    def report(_game, _result):
        renders.append(0)

    renders.append(0)
    said: list[str] = []
    play_games(args, model, range(1, 4), 1, report, said.append, wrap_env=CountRenders)
    assert renders[0] > 0 and renders[1:] == [0, 0, 0]  # the demo's game; none after it
    assert len(said) == 1 and said[0].startswith(f"demo: {tmp_path / 'demo'}")


def test_results_table_from_eval_summaries(tmp_path):
    summary = {
        "env": "CartPole-v1", "mean": 500.0, "std": 0.0, "best": 500.0, "games": 100,
        "training": {"frames": 250000, "seconds": 84.0, "hardware": "2 CPU cores",
                     "command": "python main.py --env CartPole-v1"},
    }  # fmt: skip
    path = tmp_path / "CartPole-v1_eval.json"
    path.write_text(json.dumps(summary))
    table = results_table([path]).splitlines()
    assert table[0] == (
        "| game | score ± std (100 games) | evaluated under | trained under | frames | hours "
        "| hardware |"
    )
    # The row links to the game's section of docs/results.md; 84 s are 0.023 hours.
    assert table[2] == (
        "| [CartPole-v1](docs/results.md#cartpole-v1) | 500.00 ± 0.00 | ? | ? | 250,000 | 0.023 "
        "| 2 CPU cores |"
    )
    command = "- CartPole-v1: `python main.py --env CartPole-v1`"
    assert table[3:] == ["", "Trained with:", "", command]
    summary["protocol"] = protocol("PongNoFrameskip-v4", 4, 10000, 0.25)
    summary["training"]["protocol"] = protocol("PongNoFrameskip-v4", 4, 10000)
    summary["training"]["seconds"] = 22_902.0  # 381.7 minutes: tenths of an hour
    summary["env"] = "ALE/Pong-v5"  # the anchor GitHub gives the heading "## ALE/Pong-v5"
    path.write_text(json.dumps(summary))
    cells = results_table([path]).splitlines()[2].split(" | ")
    assert cells[0] == "| [ALE/Pong-v5](docs/results.md#alepong-v5)"
    assert cells[2:6] == ["sticky 0.25", "deterministic", "250,000", "6.4"]
    # The rest of the evaluation's protocol goes under the table, once for the rows sharing it.
    under = results_table([path]).splitlines()[3:6]
    assert under == ["", "Every game: skip 4 max-pooled, 1-30 no-op starts, cap 10,000 steps.", ""]
    summary["env"] = "CartPole-v1"
    summary["training"]["command"] += " --log-dir /work/run/logs/ -smd /work/m --load-model-dir=x"
    summary["training"]["sittings"] = 3  # a run resumed twice: its first command, and so
    path.write_text(json.dumps(summary))
    command = results_table([path]).splitlines()[-1]
    assert command == (
        "- CartPole-v1: `python main.py --env CartPole-v1` (resumed with `--load`: 3 parts in all)"
    )
    summary["training"]["restarts"] = 1
    path.write_text(json.dumps(summary))
    assert (
        results_table([path])
        .splitlines()[-1]
        .endswith("(resumed with `--load`: 3 parts in all, 1 of them from the `.dat` alone)")
    )
    # Two protocols' rows of one run give two rows and its command once.
    other = tmp_path / "sticky" / "CartPole-v1_eval.json"
    other.parent.mkdir()
    other.write_text(json.dumps({**summary, "mean": 480.0}))
    both = results_table([path, other]).splitlines()
    assert len(both) == 2 + 2 + 2 + 3 + 1 and both[3].startswith("| [CartPole-v1]")
    # Parts whose flags changed (a new lr, fp32 on another machine) are named with the
    # flags that differ from the first part's; --load, the folders and a part with no command
    # known change nothing.
    first = summary["training"]["command"]
    fp32 = "python main.py --env CartPole-v1 --lr 0.0003"
    summary["training"].update(
        sittings=6,
        commands=[first, f"{first} --load", f"{fp32} -lmd y", f"{fp32} --load", None, first],
    )
    path.write_text(json.dumps(summary))
    assert (
        results_table([path])
        .splitlines()[-1]
        .endswith(
            "(resumed with `--load`: 6 parts in all, 1 of them from the `.dat` alone; "
            "parts 3-5: `--lr 0.0003`; part 6: as part 1)"
        )
    )
    # Short forms and --flag=value are the long flag; negative numbers are values.
    changed = resumed_note(2, 0, ["main.py --lr 1 --amsgrad -s 2", "main.py -s 3 --lr=-1E-4"])
    assert changed.endswith("part 2: `--seed 3 --lr -1E-4 without --amsgrad`)")
    same = resumed_note(3, 0, ["main.py -s 2 --lr 0.1", "main.py --lr 0.1 --seed 2 --load", None])
    assert same == " (resumed with `--load`: 3 parts in all)"
    # Run records quote as a shell does (shlex): a folder with a space is one value.
    spaced = "python main.py --save-model-dir '/my runs/' --seed 2 --load --log-dir 'a b/'"
    assert without_folders(spaced) == "python main.py --seed 2 --load"
    assert resumed_note(2, 0, ["python main.py --seed 1", spaced]).endswith("`--seed 2`)")
    v5 = protocol_parts(protocol("ALE/Pong-v5", 4, 27000))
    assert v5 == ("sticky 0.25", "skip 4, no no-op starts, cap 27,000 steps")
    v0 = protocol_parts(protocol("Pong-v0", 4, 100))
    assert v0 == ("sticky 0.25", "skip 2-4, no no-op starts, cap 100 steps")


def test_results_table_outside_atari_and_for_an_interrupted_evaluation(tmp_path):
    summary = {
        "env": "CartPole-v1", "mean": 480.5, "std": 3.0, "best": 500.0, "games": 37,
        "interrupted": True, "protocol": protocol("CartPole-v1", 4, 10000),
        "training": {"protocol": protocol("CartPole-v1", 4, 10000), "hardware": None},
    }  # fmt: skip
    path = tmp_path / "CartPole-v1_eval.json"
    path.write_text(json.dumps(summary))
    lines = results_table([path]).splitlines()
    cells = lines[2].split(" | ")
    assert cells[1] == "480.50 ± 3.00 (37 games, interrupted)"
    assert cells[2:4] == ["not an ALE game", "not an ALE game"]
    assert "Every game: cap 500 steps." in lines
    assert cells[4:7] == ["?", "?", "? |"]  # a record without frames, time or hardware
    assert lines[-1] == "- CartPole-v1: `?`"  # ... and without a command
    summary.update(games=50, interrupted=False)
    path.write_text(json.dumps(summary))
    assert results_table([path]).splitlines()[2].split(" | ")[1] == "480.50 ± 3.00 (50 games)"
    # --stall-steps changes scores, so a row says it; a summary with a value of the wrong
    # type is one line, not a traceback.
    summary["protocol"] = protocol("CartPole-v1", 4, 10000, stall_steps=200)
    path.write_text(json.dumps(summary))
    stalled = tmp_path / "stalled" / "CartPole-v1_eval.json"
    stalled.parent.mkdir()
    stalled.write_text(json.dumps(summary))
    both = results_table([path, stalled]).splitlines()
    assert both[5] == "Every game: cap 500 steps, games cut after 200 steps without a reward."
    summary["protocol"] = protocol("CartPole-v1", 4, 10000)
    path.write_text(json.dumps(summary))
    assert results_table([path, stalled, path]).splitlines()[5:11] == [
        "",
        "Evaluated with:",
        "",
        "- rows 1, 3: cap 500 steps",
        "- row 2: cap 500 steps, games cut after 200 steps without a reward",
        "",
    ]
    path.write_text(json.dumps({**summary, "mean": "a"}))
    with pytest.raises(UsageError, match="is not a gym_eval.py summary this version reads"):
        results_table([path])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["table", "{run}"], "'{run}' is not a gym_eval.py summary; pass <log-dir><env>_eval.json"),
        (["table", "{list}"], "'{list}' is not a gym_eval.py summary"),
        (["table", "{binary}"], "'{binary}' is not a gym_eval.py summary (not JSON); pass <log-"),
        (["table", "{log}"], "'{log}' is not a gym_eval.py summary (not JSON); pass <log-dir>"),
        (["table", "{dir}/no.json"], "eval summary '{dir}/no.json' not found; pass <log-dir><env>"),
        (["table", "{dir}"], "cannot read eval summary '{dir}' (Is a directory); pass <log-"),
        (["curve", "{binary}"], "'{binary}' is not a training log (no line of one); pass"),
        (["milestone", "{run}", "--reward", "1"], "'{run}' is not a training log"),
        (["curve", "{eval_log}"], "'{eval_log}' is gym_eval.py's log, not a training log; pass"),
        (["curve", "{dir}"], "cannot read log '{dir}' (Is a directory); pass a <log-dir><env>_log"),
        (["curve", "{log}", "--out", "{file}/c.png"],
         "cannot write '{file}/c.png' (File exists); choose a folder you can write"),
        (["view", "--steps", "0", "--out", "{file}/v.png"], "cannot write '{file}/v.png'"),
        (["view", "--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
        (["milestone", "{log}", "--reward", "1", "nan"], "--reward must be a finite number, got"),
        (["milestone", "{log}", "--window", "0"], "--window must be at least 1, got 0"),
        (["curve", "{log}", "--out", "{dir}/c.pngx"], "'{dir}/c.pngx': not an image name"),
        (["view", "--steps", "0", "--out", "{dir}/v.txt"], "'{dir}/v.txt': not an image name"),
        # No suffix (matplotlib's default is a PNG): the training log given twice is kept.
        (["curve", "{log}", "--out", "{log}"], "'{log}': not an image name; end it in .png"),
    ],
)  # fmt: skip
def test_visualize_bad_files_are_one_line(tmp_path, capsys, args, message):
    from visualize import main

    names = {
        "run": tmp_path / "run.json", "list": tmp_path / "list.json", "dir": tmp_path,
        "log": tmp_path / "x_log", "file": tmp_path / "a_file", "binary": tmp_path / "x.dat",
        "eval_log": tmp_path / "x_eval_log",
    }  # fmt: skip
    names["eval_log"].write_text(
        "2026-11-28 18:13:02,110 : game 1/2: reward 1.0, length 297, reward mean 1.0000\n"
    )
    names["binary"].write_bytes(b"PK\x03\x04\x80\xff")  # a .dat (a zip) given as a summary
    names["run"].write_text(json.dumps({"config": {}, "finished": {}}))
    names["list"].write_text("[1, 2]")
    names["log"].write_text(_game(40, 3.0, 1000))
    names["file"].write_text("")

    def fill(text: str) -> str:
        return text.format(**{key: str(path) for key, path in names.items()})

    assert main([fill(arg) for arg in args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("visualize.py: error: "), lines
    assert fill(message) in lines[0]
    assert names["log"].read_text() == _game(40, 3.0, 1000)


def test_ctrl_c_in_visualize_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    import visualize

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(visualize, "plot_curve", interrupted)
    assert visualize.main(["curve", str(tmp_path / "x_log")]) == 130
    assert capsys.readouterr().err == "visualize.py: stopped\n"


def test_recordings_play_at_the_games_own_speed():
    import gymnasium as gym

    from gym_eval import real_time_fps

    cartpole = gym.make("CartPole-v1")
    assert real_time_fps("PongNoFrameskip-v4", 4, cartpole) == 15.0  # 60 frames a second
    assert real_time_fps("PongNoFrameskip-v4", 2, cartpole) == 30.0
    assert real_time_fps("ALE/Pong-v5", 4, cartpole) == 15.0  # ALE's own skip of 4
    assert real_time_fps("CartPole-v1", 4, cartpole) == 50.0  # its render_fps (tau 0.02 s)


def test_a_long_demo_keeps_the_whole_game_at_an_even_pace():
    from gym_eval import DemoFrames

    demo = DemoFrames(15.0, cap=10)
    for step in range(7):
        demo.add(np.full((2, 2, 3), step, np.uint8))
    assert [int(f[0, 0, 0]) for f in demo.frames] == list(range(7)) and demo.fps == 15.0
    for step in range(7, 45):
        demo.add(np.full((2, 2, 3), step, np.uint8))
    kept = [int(f[0, 0, 0]) for f in demo.frames]
    # 45 screens: past 10 frames the stride went 1 -> 2 -> 4 -> 8: screens 0, 8, 16, ...
    assert demo.stride == 8 and demo.fps == 15.0 / 8
    assert kept == [0, 8, 16, 24, 32, 40] and len(kept) <= 10


def test_training_games_follow_the_record_chain(tmp_path):
    from visualize import training_games

    first = [[100, 10.0, 5.0, 30], [200, 20.0, 7.0, 40]]
    resumed = [*first, [300, 30.0, 9.0, 50]]  # resumed from the state: the earlier games too
    afresh = [[50, 5.0, 11.0, 60]]  # started from the .dat alone: counts from 0 again
    again = [*afresh, [80, 8.0, 13.0, 70]]  # resumed from that sitting's state
    sittings = [first, resumed, afresh]
    record = {
        "previous_runs": [{"training_games": {"games": games}} for games in sittings],
        "training_games": {"games": again},
    }
    path = tmp_path / "Pong_run.json"
    path.write_text(json.dumps(record))
    assert training_games(path) == [*resumed, [350, 35.0, 11.0, 60], [380, 38.0, 13.0, 70]]
    assert training_games(tmp_path / "missing_run.json") == []


def test_the_peers_measures_average_the_last_100_games_and_that_mean_over_4m_frames(
    tmp_path, capsys
):
    import visualize
    from visualize import training_means

    # Game i ends at 100,000 x i frames and scores i: 200 games, 20M frames.
    games = [[100_000.0 * i, 10.0 * i, float(i), 100] for i in range(1, 201)]
    count, last, spread = training_means(games)
    assert (count, last) == (200, 150.5)  # games 101..200
    # 101 points over 16M-20M frames: games 160..200 end there, each mean 100 games back.
    ends = [int(16e6 + 40_000 * k) // 100_000 for k in range(101)]
    assert spread == pytest.approx(sum(end - 49.5 for end in ends) / 101)
    count, last, spread = training_means(games, at=10_050_000)
    assert (count, last) == (100, 50.5)
    assert spread == pytest.approx(50.5)  # the one point with 100 games done: the last
    count, last, spread = training_means(games, at=9e6)
    assert count == 90 and math.isnan(last) and math.isnan(spread)

    record = tmp_path / "Pong_run.json"
    record.write_text(json.dumps({"training_games": {"games": games}}))
    assert visualize.main(["training", str(record)]) == 0
    out = capsys.readouterr().out
    assert "200 training games by 20,000,000 frames" in out and "mean 150.5" in out
    assert visualize.main(["training", str(tmp_path / "none_run.json")]) == 2
    assert "holds no training game" in capsys.readouterr().err


def test_the_curve_draws_the_workers_games_from_the_record_beside_the_log(tmp_path):
    from visualize import plot_curve

    log = tmp_path / "PongNoFrameskip-v4_log"
    log.write_text(
        "2026-12-01 10:00:00,000 : Time 00h 01m 00s, episode reward -21.0, episode length 800, "
        "reward mean -21.0000, total steps 1000, total frames 4000, frames/s 66\n"
    )
    games = {"games": [[2000, 30.0, -20.0, 900], [4000, 60.0, -19.0, 950]]}
    (tmp_path / "PongNoFrameskip-v4_run.json").write_text(json.dumps({"training_games": games}))
    png = plot_curve(log, tmp_path / "curve.png")
    assert png.stat().st_size > 0


@pytest.mark.parametrize(
    "log", ["logs/Pong_log", "demo/Pong_train_log", "demo/Pong_train_log_4", "x/Pong_log_2"]
)
def test_the_run_record_is_found_beside_a_log_and_beside_demos_split_logs(log):
    from visualize import record_beside

    assert record_beside(Path(log)) == Path(log).parent / "Pong_run.json"
