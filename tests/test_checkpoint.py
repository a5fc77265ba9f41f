"""The files a run writes: atomic saves, safe names, the training-state layout, the run's paths."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import signal
import socket
import stat
import time

import pytest
import torch
import torch.multiprocessing as mp

from checkpoint import (
    RunPaths,
    TrainingState,
    current_umask,
    env_file_stem,
    hold_run_lock,
    load_weights,
    release_run_locks,
    save_atomic,
    saved_hidden_size,
    write_atomic,
    write_json_atomic,
)
from utils import UsageError


def test_save_atomic_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "Pong.dat"
    save_atomic({"w": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(TypeError):  # fails before any file is opened
        save_atomic({"w": Unpicklable()}, path)

    def disk_fills(f):  # fails half-way through the temporary file
        f.write(b"PK" + bytes(1000))
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, disk_fills)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["Pong.dat"]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_saved_files_get_the_umasks_mode_not_a_temporary_files(tmp_path, umask):
    previous = os.umask(umask)
    try:
        assert current_umask() == umask
        save_atomic({"w": torch.ones(2)}, tmp_path / "Pong.dat")
        write_json_atomic({"a": 1}, tmp_path / "Pong_run.json")
    finally:
        os.umask(previous)
    for name in ("Pong.dat", "Pong_run.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_a_file_system_without_modes_still_gets_the_file(tmp_path, monkeypatch):
    def refuse(fd, mode):  # vfat, exFAT, some network mounts
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    save_atomic({"w": torch.ones(2)}, tmp_path / "Pong.dat")
    assert torch.equal(torch.load(tmp_path / "Pong.dat", weights_only=True)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["Pong.dat"]


def test_the_folder_is_synced_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def record(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    save_atomic({"w": torch.ones(2)}, tmp_path / "Pong.dat")
    assert synced == [False, True]  # the file's data, then the folder holding the new name


def _slow_write(path, marker) -> None:
    def write(f):
        f.write(b"new, half written")
        marker.touch()
        time.sleep(60)

    write_atomic(path, write)


def test_a_save_interrupted_by_sigterm_leaves_no_temporary_file(tmp_path):
    path, marker = tmp_path / "Pong.dat", tmp_path / "writing"
    path.write_bytes(b"old")
    spawn = mp.get_context("spawn")
    proc = spawn.Process(target=_slow_write, args=(path, marker))
    proc.start()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(tmp_path.glob(".Pong.dat.*.tmp"))  # mid-write: the temporary file exists
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(30)
    assert proc.exitcode == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Pong.dat", "writing"]
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize(
    ("env_id", "stem"),
    [("PongNoFrameskip-v4", "PongNoFrameskip-v4"), ("ALE/Pong-v5", "ALE_Pong-v5"),
     ("../../etc/passwd", "_.._etc_passwd")],
)  # fmt: skip
def test_env_ids_become_safe_file_names(env_id, stem):
    assert env_file_stem(env_id) == stem
    assert "/" not in env_file_stem(env_id)


# -- the training state ------------------------------------------------------------------------

LAYOUT = {
    "format", "model", "optimizer", "steps", "frames", "elapsed", "skipped_updates",
    "test_rewards", "test", "normalizers", "tensorboard_dir", "config", "saved_at",
    "dat_score", "dat_trained", "log_dir", "training_games",
}  # fmt: skip
"""The keys of a state file (format 1): a file written before `TrainingState` has them too
(but ``dat_score``, ``dat_trained``, ``log_dir`` and ``training_games``, added later:
`TrainingState.load` infers the first for older files and leaves the others unknown)."""


def test_training_state_round_trips_with_the_file_layout_unchanged(tmp_path):
    state = TrainingState(
        model={"w": torch.arange(3.0)},
        optimizer={"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": []},
        steps=120, frames=480, elapsed=33.5, skipped_updates=2,
        test_rewards=[-21.0, -19.0, -20.0], training_games=[[400, 30.0, -21.0, 812]],
        worker_normalizers={0: {"kind": "frames", "num_steps": 7}, 1: {"kind": "frames"}},
        test_normalizer={"kind": "frames", "num_steps": 3},
        tensorboard_dir="logs/runs/Pong_1", config={"env": "Pong", "lr": 1e-4}, saved_at=5.0,
        dat_score=-20.0, dat_trained={"steps": 100, "frames": 400, "seconds": 30.0},
        log_dir="/runs/logs",
    )  # fmt: skip
    path = tmp_path / "Pong_state.pt"
    state.save(path)
    raw = TrainingState.read_file(path)
    assert set(raw) == LAYOUT and raw["format"] == 1
    assert raw["normalizers"] == {
        "0": {"kind": "frames", "num_steps": 7},
        "1": {"kind": "frames"},
        "test": {"kind": "frames", "num_steps": 3},
    }
    assert raw["test"] == {"games": 3, "reward_total": -60.0, "best": -19.0}
    loaded = TrainingState.load(path)
    assert torch.equal(loaded.model["w"], state.model["w"])
    assert loaded.worker_normalizers == state.worker_normalizers  # ranks are ints again
    for name in ("steps", "frames", "elapsed", "skipped_updates", "test_rewards",
                 "training_games", "test_normalizer", "tensorboard_dir", "config", "saved_at",
                 "dat_score", "dat_trained", "log_dir"):  # fmt: skip
        assert getattr(loaded, name) == getattr(state, name), name


def test_a_state_without_counters_loads_with_zeros(tmp_path):
    path = tmp_path / "old_state.pt"
    torch.save({"format": 1, "model": {"w": torch.ones(1)}, "optimizer": None}, path)
    state = TrainingState.load(path)
    assert (state.steps, state.skipped_updates, state.test_rewards) == (0, 0, [])
    assert state.training_games == []
    assert state.worker_normalizers == {} and state.test_normalizer is None
    assert state.dat_score is None
    # A file from before dat_score: a --save-max run's .dat held its best game's weights.
    older = {"format": 1, "model": {"w": torch.ones(1)}, "test_rewards": [-3.0, 7.0, 1.0]}
    torch.save({**older, "config": {"save_max": True}}, path)
    assert TrainingState.load(path).dat_score == 7.0
    torch.save({**older, "config": {"save_max": False}}, path)
    assert TrainingState.load(path).dat_score is None


def test_a_file_that_is_not_a_state_is_refused(tmp_path):
    path = tmp_path / "x_state.pt"
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(UsageError, match="is not an A3G training-state file"):
        TrainingState.load(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty; use an intact file"),
        (b"# A3G\n", r"is not a PyTorch file \(it begins b'# '\)"),
        (b"PK\x03\x04 half an archive", "is truncated or not a PyTorch file"),
    ],
)
def test_a_file_that_is_not_weights_gets_a_message_that_says_what_it_is(tmp_path, content, message):
    path = tmp_path / "Pong.dat"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load_weights(torch.nn.Linear(1, 1), path)
    with pytest.raises(UsageError, match=message):
        TrainingState.load(path)


def test_a_cut_archive_gets_pytorchs_first_sentence_and_a_state_the_way_past_it(tmp_path):
    path = tmp_path / "Pong_state.pt"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 64)  # a zip archive's start, nothing more
    with pytest.raises(UsageError) as refused:
        TrainingState.load(path)
    message = str(refused.value)
    assert message.endswith("; use an intact file, or delete it to load the weights alone")
    assert ". " not in message.split("(", 1)[1]  # PyTorch's paragraph cut to its first sentence
    # The legacy (pickle) format cut anywhere is one line too, never a traceback.
    legacy = io.BytesIO()
    torch.save({"w": torch.zeros(64)}, legacy, _use_new_zipfile_serialization=False)
    for size in (1, 18, 28, 140, len(legacy.getvalue()) - 10):  # (a cut inside a GLOBAL
        # opcode reads as a global not allowed: refused as pickled objects, also one line)
        path.write_bytes(legacy.getvalue()[:size])
        with pytest.raises(UsageError, match=r"is truncated or not a PyTorch file \(.+\); use an"):
            load_weights(torch.nn.Linear(1, 1), path)


def test_an_agent_for_frames_and_one_for_vectors_are_told_apart(tmp_path):
    import gymnasium as gym

    from model import A3Clstm, A3CMlp

    atari, cartpole = A3Clstm(1, gym.spaces.Discrete(6), 32), A3CMlp(4, gym.spaces.Discrete(2), 32)
    for saved, loaded, says in (
        (cartpole, atari, "a vector-observation agent (CartPole-like) and this env gives frames"),
        (atari, cartpole, "an Atari agent (frames) and this env gives vectors"),
    ):
        torch.save(saved.state_dict(), tmp_path / "x.dat")
        with pytest.raises(UsageError) as refused:
            load_weights(loaded, tmp_path / "x.dat")
        assert str(refused.value).endswith(f"holds {says}: pass the --env it was trained on")
    torch.save({"w": torch.zeros(1)}, tmp_path / "x.dat")
    with pytest.raises(UsageError, match="for another network .*; use a .dat A3G \\(or the orig"):
        load_weights(atari, tmp_path / "x.dat")


def test_main_reads_the_hidden_size_of_what_load_reads_unless_given(tmp_path, monkeypatch):
    import gymnasium as gym

    import run_folder
    from cli import parse_train_args
    from model import HIDDEN_SIZE, A3Clstm

    def width(*flags: str) -> int:
        """The width the run's plan gives (parsing reads no file)."""
        out = ["--save-model-dir", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]
        return run_folder.plan(parse_train_args(["--env", "CartPole-v1", *out, *flags])).hidden_size

    def agent(hidden: int) -> dict:
        return A3Clstm(4, gym.spaces.Discrete(2), hidden).state_dict()

    load = ["--load", "--load-model-dir", str(tmp_path)]
    assert width(*load) == HIDDEN_SIZE  # no file: the resume says so, with the usual width
    torch.save(agent(16), tmp_path / "CartPole-v1.dat")
    assert width(*load) == 16  # the weights alone
    monkeypatch.chdir(tmp_path)  # trained_models/ here, the default --load-model-dir
    (tmp_path / "trained_models").mkdir()
    torch.save(agent(16), tmp_path / "trained_models" / "CartPole-v1.dat")
    assert width() == HIDDEN_SIZE  # a fresh run: not read
    with pytest.raises(UsageError, match="is read only with --load; add --load to go on from"):
        width("--load-model-dir", str(tmp_path))  # given without --load: a resume forgotten
    state = TrainingState(model=agent(24), steps=10, config={"env": "CartPole-v1"})
    state.save(tmp_path / "CartPole-v1_state.pt")
    assert width(*load) == 24  # the training state, which --load resumes from
    assert width(*load, "--hidden-size", "8") == 8  # given: kept (the load then refuses it)
    state = (tmp_path / "CartPole-v1_state.pt").read_bytes()
    (tmp_path / "CartPole-v1_state.pt").write_bytes(state[: len(state) // 2])
    with pytest.raises(UsageError, match="CartPole-v1_state.pt.*delete it to load the weights"):
        width(*load)  # as the resume says it: the way past it is named


def test_weights_load_from_a_training_state_too_and_a_file_as_folder_is_named(tmp_path):
    import gymnasium as gym

    from model import A3Clstm

    def net(seed: int) -> A3Clstm:
        torch.manual_seed(seed)
        return A3Clstm(1, gym.spaces.Discrete(6), 32)

    TrainingState(model=net(1).state_dict(), steps=10).save(tmp_path / "Pong_state.pt")
    torch.save(A3Clstm(1, gym.spaces.Discrete(6), 16).state_dict(), tmp_path / "Pong.dat")
    # The width gym_eval.py builds without --hidden-size; None where the file says nothing.
    assert saved_hidden_size(tmp_path / "Pong_state.pt") == 32
    assert saved_hidden_size(tmp_path / "Pong.dat") == 16
    assert saved_hidden_size(tmp_path / "missing.dat") is None
    torch.save({"weight": torch.zeros(2, 2)}, tmp_path / "linear.dat")
    assert saved_hidden_size(tmp_path / "linear.dat") is None
    model = net(2)
    load_weights(model, tmp_path / "Pong_state.pt")  # gym_eval.py --model <env>_state.pt
    for got, want in zip(model.state_dict().values(), net(1).state_dict().values(), strict=True):
        assert torch.equal(got, want)
    # --load-model-dir given a file: named as such, not "'x.dat/Pong.dat' not found"
    (tmp_path / "x.dat").write_bytes(b"PK")
    with pytest.raises(UsageError) as refused:
        load_weights(model, tmp_path / "x.dat" / "Pong.dat", hint="or that")
    assert str(refused.value) == (
        f"--load-model-dir {str(tmp_path / 'x.dat')!r} is a file; give the folder holding "
        "Pong.dat (or that)"
    )
    with pytest.raises(UsageError) as refused:
        load_weights(model, tmp_path / "missing.dat")
    assert str(refused.value) == (
        f"checkpoint {str(tmp_path / 'missing.dat')!r} not found; train first, or point "
        "--load-model-dir at the folder holding missing.dat"
    )


# -- where a run's files go --------------------------------------------------------------------


def test_run_paths_are_computed_once_from_the_flags():
    paths = RunPaths.of("ALE/Pong-v5", "logs/", "out/", "in/", save_max=False)
    assert str(paths.log) == "logs/ALE_Pong-v5_log"
    assert str(paths.record) == "logs/ALE_Pong-v5_run.json"
    assert str(paths.curve) == "logs/ALE_Pong-v5_curve.png"
    assert str(paths.runs) == "logs/runs"
    assert str(paths.model) == str(paths.final_model) == "out/ALE_Pong-v5.dat"
    assert str(paths.state) == "out/ALE_Pong-v5_state.pt"
    assert str(paths.load_model) == "in/ALE_Pong-v5.dat"
    assert str(paths.load_state) == "in/ALE_Pong-v5_state.pt"
    best_kept = RunPaths.of("PongNoFrameskip-v4", "logs/", "out/", "in/", save_max=True)
    assert str(best_kept.final_model) == "out/PongNoFrameskip-v4_last.dat"


# -- one run at a time in a folder -------------------------------------------------------------


def test_a_folder_a_live_run_writes_is_refused_to_another_run_of_its_env(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    folder.mkdir()
    lock = folder / "ALE_Pong-v5.lock"
    # Another run's: a lock on its own open file, and its process id in it.
    lock.write_text("4242 on elsewhere\n")
    theirs = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(theirs, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError) as refused:
            hold_run_lock(folder, "ALE/Pong-v5", "--save-model-dir")
        assert str(refused.value) == (
            f"--save-model-dir {str(folder)!r} is being written by another run of ALE/Pong-v5 "
            "(process 4242 on elsewhere), which would write over this run's files and this run "
            "over its; stop that run first, or give --save-model-dir another folder"
        )
        hold_run_lock(folder, "Breakout-v5", "--save-model-dir")  # another env: its own
    finally:
        os.close(theirs)  # that run ends (a SIGKILL too): the file stays, unlocked
    release_run_locks()
    assert sorted(p.name for p in folder.iterdir()) == ["ALE_Pong-v5.lock"]

    hold_run_lock(folder, "ALE/Pong-v5", "--save-model-dir")  # the stale file is taken
    assert lock.read_text() == f"{os.getpid()} on {socket.gethostname()}\n"
    (tmp_path / "alias").symlink_to(folder)
    hold_run_lock(tmp_path / "alias", "ALE/Pong-v5", "--log-dir")  # the process's own, again
    probe = os.open(lock, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # held, for any other open of the file
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
    release_run_locks()
    assert list(folder.iterdir()) == []  # a normal exit leaves nothing

    hold_run_lock(tmp_path / "not_yet", "ALE/Pong-v5", "--log-dir")  # made later: nothing now
    assert not (tmp_path / "not_yet").exists()

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # a mount without locks: run, leave nothing
    hold_run_lock(folder, "ALE/Pong-v5", "--save-model-dir")
    assert list(folder.iterdir()) == []
