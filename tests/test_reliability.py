"""Reliability: resume, crashed workers, NaN updates, failed saves, a killed launcher, bad input.

Each test kills, corrupts or feeds bad input for real, through the real code or CLI.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import run_folder
import train
from checkpoint import RunPaths, TrainingState, file_sha256
from cli import as_dict, parse_train_args
from environment import EnvSpec, load_normalizer_state, make_env, normalizer_state
from launcher import STOPPING, Child, Launcher
from main import prepare
from model import A3Clstm, build_model
from monitor import TENSORBOARD_SECONDS
from run_folder import run_totals
from tests.conftest import (
    PONG,
    PONG_FLAGS,
    ROOT,
    folders,
    group_alive,
    load_pong_dat,
    main_here,
    make_args,
    run_cli,
    wait_group_gone,
)
from utils import FIRST_START, FatalRunError, ProcessContext, ProcessStart, child_process

CONFIG = str(ROOT / "config.json")


# -- normaliser statistics -------------------------------------------------------------------------


def test_frame_normaliser_statistics_round_trip():
    args = make_args(env=PONG)
    env = make_env(EnvSpec.of(args))
    env.reset(seed=0)
    for _ in range(20):
        env.step(0)
    saved = normalizer_state(env)
    assert saved["kind"] == "frames" and saved["num_steps"] > 20
    fresh = make_env(EnvSpec.of(args))
    assert load_normalizer_state(fresh, saved)
    assert normalizer_state(fresh) == saved
    env.close()
    fresh.close()


def test_vector_normaliser_statistics_round_trip(tmp_path):
    args = make_args(env="CartPole-v1", vector_obs_norm=True)
    env = make_env(EnvSpec.of(args))
    env.reset(seed=0)
    for _ in range(10):
        env.step(0)
    saved = normalizer_state(env)
    torch.save(saved, tmp_path / "n.pt")
    loaded = torch.load(tmp_path / "n.pt", weights_only=True)
    fresh = make_env(EnvSpec.of(args))
    assert load_normalizer_state(fresh, loaded)
    assert normalizer_state(fresh) == saved
    plain = make_env(EnvSpec("CartPole-v1"))
    assert normalizer_state(plain) is None and not load_normalizer_state(plain, saved)


# -- NaN and inf never reach the shared model ------------------------------------------------------


class PoisonObservations(gym.ObservationWrapper):
    """Observations turn to NaN on the steps `poisoned` says (a broken env, for real)."""

    def __init__(self, env: gym.Env, poisoned):
        super().__init__(env)
        self.poisoned = poisoned
        self.t = 0

    def observation(self, observation):
        self.t += 1
        if self.poisoned(self.t):
            return np.full_like(observation, np.nan)
        return observation


def run_poisoned_worker(monkeypatch, poisoned, max_steps: int):
    real_make_env = train.make_env
    monkeypatch.setattr(
        train, "make_env", lambda *a, **k: PoisonObservations(real_make_env(*a, **k), poisoned)
    )
    args = make_args(env="CartPole-v1", hidden_size=16, num_steps=5, env_config=CONFIG)
    env = make_env(EnvSpec.of(args))
    torch.manual_seed(0)
    shared = build_model(env.observation_space, env.action_space, args.hidden_size)
    before = [p.detach().clone() for p in shared.parameters()]
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=max_steps)
    losses: list[float] = []
    error = None
    try:
        train.run_worker(
            0, args, EnvSpec.of(args), shared, None, ctx,
            on_update=lambda terms: losses.append(terms.total.item()),
        )  # fmt: skip
    except FatalRunError as err:
        error = err
    return shared, before, ctx, losses, error


def test_a_nan_update_is_skipped_and_training_goes_on(monkeypatch):
    shared, before, ctx, losses, error = run_poisoned_worker(
        monkeypatch, lambda t: t in (3, 40, 80), max_steps=200
    )
    assert error is None
    # A poisoned observation that ends an episode is never fed to the network.
    assert 1 <= ctx.total_skipped() <= 3
    assert len(losses) >= 20 and all(math.isfinite(x) for x in losses)
    assert all(torch.isfinite(p).all() for p in shared.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(shared.parameters(), before, strict=True))


def test_nan_that_keeps_coming_stops_with_a_clear_error_and_untouched_weights(monkeypatch):
    shared, before, ctx, losses, error = run_poisoned_worker(
        monkeypatch, lambda t: True, max_steps=10_000
    )
    assert isinstance(error, FatalRunError)
    assert "10 updates in a row had a NaN or inf policy, loss or gradient" in str(error)
    assert ctx.total_skipped() == train.NONFINITE_LIMIT and losses == []
    assert all(torch.equal(p, q) for p, q in zip(shared.parameters(), before, strict=True))


# -- resume: the values after resume equal the values saved ----------------------------------------


PONG_SMALL = [*PONG_FLAGS, "--workers", "1", "--test-interval", "0"]


def test_run_totals_add_the_chains_of_sittings():
    def sitting(resumed: bool, frames: int | None, seconds: float = 10.0) -> dict:
        finished = None if frames is None else {"frames": frames, "seconds": seconds}
        return {"resumed_from": "state.pt" if resumed else None, "finished": finished}

    # Two sittings on one machine (the second resumed from the training state, counting on),
    # then a new machine from the .dat alone (counting from 0) that crashed, and its resume.
    history = [sitting(False, 100, 1.0), sitting(True, 250, 3.0), sitting(False, None)]
    record = {**sitting(True, 40, 2.0), "previous_runs": history}
    assert run_totals(record) == {"frames": 290, "seconds": 5.0, "sittings": 4, "restarts": 1}
    alone = {"frames": 7, "seconds": 0.5, "sittings": 1, "restarts": 0}
    assert run_totals(sitting(False, 7, 0.5)) == alone
    assert run_totals(sitting(False, None))["frames"] is None
    # Records a person edited badly do not stop an evaluation: what cannot be read is skipped.
    odd = {"previous_runs": None, "finished": [1]}
    assert run_totals(odd) == {"frames": None, "seconds": None, "sittings": 1, "restarts": 0}
    assert run_totals({**record, "previous_runs": [*history, "?"]})["frames"] == 290
    # Read while a sitting runs (an evaluation of the last weights): the running sitting left
    # nothing in those weights and is not counted; the crashed restart before a finished
    # sitting is (its training went on in the next).
    running = {**sitting(False, None), "previous_runs": [*history, sitting(True, 40, 2.0)]}
    assert run_totals(running) == {"frames": 290, "seconds": 5.0, "sittings": 4, "restarts": 1}
    later = {**sitting(True, None), "previous_runs": [sitting(False, 100, 1.0)]}
    assert run_totals(later) == {"frames": 100, "seconds": 1.0, "sittings": 1, "restarts": 0}


def test_an_evaluation_reads_the_whole_run_from_its_record(tmp_path, caplog):
    from run_folder import training_record

    first = {"command": "python main.py --first", "finished": {"frames": 100, "seconds": 60.0}}
    record = {
        "command": "python main.py --first --load",
        "resumed_from": "state.pt",
        "finished": {"frames": 300, "seconds": 150.0},
        "previous_runs": [first],
    }
    (tmp_path / "Game_run.json").write_text(json.dumps(record))
    training = training_record(str(tmp_path), Path("elsewhere/Game.dat"), None)
    assert training is not None
    assert (training["frames"], training["seconds"], training["sittings"]) == (300, 150.0, 2)
    assert training["command"] == "python main.py --first" and training["restarts"] == 0
    assert training["commands"] == ["python main.py --first", "python main.py --first --load"]
    # A third sitting still running when the evaluation reads the record is not counted.
    third = {"command": "python main.py --first --load", "resumed_from": "state.pt"}
    going = {
        **third,
        "previous_runs": [first, {k: v for k, v in record.items() if k != "previous_runs"}],
    }
    (tmp_path / "Game_run.json").write_text(json.dumps(going))
    training = training_record(str(tmp_path), Path("Game.dat"), None)
    assert training is not None and (training["frames"], training["sittings"]) == (300, 2)
    assert len(training["commands"]) == 2
    (tmp_path / "Game_run.json").write_text(json.dumps(record))
    assert training_record(str(tmp_path), Path("Other.dat"), None) is None
    # A --save-max run's shutdown save, <env>_last.dat, is its run's too.
    last = training_record(str(tmp_path), Path("Game_last.dat"), None)
    assert last is not None and last["frames"] == 300
    assert last["record"] == str(tmp_path / "Game_run.json")
    (tmp_path / "Game_last_run.json").write_text(json.dumps(first))  # its own record first
    assert training_record(str(tmp_path), Path("Game_last.dat"), None)["frames"] == 100
    (tmp_path / "List_run.json").write_text("[1, 2]")
    assert training_record(str(tmp_path), Path("List.dat"), None) is None
    (tmp_path / "Binary_run.json").write_bytes(b"PK\x03\x04\x80\xff")  # not even text
    assert training_record(str(tmp_path), Path("Binary.dat"), None) is None
    # A record of the wrong shape is left out with a warning: it never stops an evaluation.
    log = logging.getLogger("test.training_record")
    wrong_shapes = (
        {"previous_runs": 1}, {"finished": {"frames": "12"}}, {"command": 5},
        {"hardware": 3}, {"protocol": []},
    )  # fmt: skip
    for bad in wrong_shapes:
        (tmp_path / "Bad_run.json").write_text(json.dumps(bad))
        with caplog.at_level("WARNING", logger=log.name):
            assert training_record(str(tmp_path), Path("Bad.dat"), None, log) is None
        assert "is not a run record this version reads" in caplog.text
        caplog.clear()


def test_an_evaluation_credits_a_model_only_with_the_training_in_its_weights(tmp_path, caplog):
    from run_folder import training_record

    files = {name: tmp_path / name for name in ("early.dat", "late.dat", "state.pt", "other")}
    for name, path in files.items():
        path.write_bytes(name.encode())
    digest = {name: file_sha256(path) for name, path in files.items()}

    def sitting(frames: int, *left: str, resumed: bool = True) -> dict:
        finished = {"frames": frames, "seconds": frames / 10, "weights_sha256": {}}
        finished["weights_sha256"] = {f"G{i}": digest[name] for i, name in enumerate(left)}
        return {
            "command": f"python main.py --at {frames}",
            "finished": finished,
            **({"resumed_from": "state.pt"} if resumed else {}),
        }

    # --save-max: <env>.dat (early.dat) stayed the same over the second and third sittings.
    first = sitting(100, "early.dat", resumed=False)
    second = sitting(200, "early.dat", "state.pt")
    record = {**sitting(300, "early.dat", "late.dat"), "previous_runs": [first, second]}
    logs = tmp_path / "logs"
    logs.mkdir()

    def credited(name: str, record: dict, *log: logging.Logger) -> dict | None:
        (logs / f"{Path(name).stem}_run.json").write_text(json.dumps(record))
        return training_record(str(logs), files[name], digest[name], *log)

    assert credited("late.dat", record)["frames"] == 300  # the whole run's
    early = credited("early.dat", record)  # the sitting that wrote it, not a later one
    assert (early["frames"], early["commands"]) == (100, ["python main.py --at 100"])
    assert credited("state.pt", record)["frames"] == 200  # a training state too
    # --save-max: the sitting says how far it was when <env>.dat's weights were taken.
    training_in = {"G0": {"steps": 15, "frames": 60, "seconds": 6.0}}
    first_saved = {**first, "finished": {**first["finished"], "training_in": training_in}}
    early = credited("early.dat", {**record, "previous_runs": [first_saved, second]})
    assert (early["frames"], early["seconds"]) == (60, 6.0)
    # A record whose first sitting named no file though it finished (a cluster that failed to
    # start names none) is not taken for an older version's.
    empty = {**first, "finished": {**first["finished"], "weights_sha256": {}}}
    assert credited("other", {**record, "previous_runs": [empty, second]}) is None
    log = logging.getLogger("test.training_record")
    with caplog.at_level("WARNING", logger=log.name):
        assert credited("other", record, log) is None  # a record copied beside other weights
    assert "other_run.json is the record of other weights (no sitting of its run" in caplog.text
    assert "with other's SHA-256); the summary's training entry is left empty" in caplog.text
    # A sitting still running (or killed) has named nothing yet: the weights may be its own.
    going = {"command": "python main.py --load", "previous_runs": [first, second]}
    assert credited("other", going)["frames"] == 200  # up to the last finished, as before
    # Sittings of a version that named no files, then of one that does: the weights no
    # sitting names may be the older sittings', credited with those.
    older = {"command": "python main.py --old", "finished": {"frames": 50, "seconds": 5.0}}
    mixed = {**sitting(300, "late.dat"), "previous_runs": [older, second]}
    assert credited("other", mixed)["commands"] == ["python main.py --old"]


def test_a_save_max_run_records_how_far_it_was_when_its_kept_weights_were_taken(tmp_path):
    """Also past a sitting killed after the save: the state carries it to the next one; and a
    .dat-alone start chains the sitting whole, its figures as they were."""
    flags = [*PONG_SMALL, *folders(tmp_path), "--save-max"]
    launcher = prepare(parse_train_args(flags))
    launcher.open_record()
    game = {"reward": 5.0, "length": 9, "ending": "game over", "steps": 12, "frames": 48}
    taken = {"steps": 10, "seconds": 3.0}  # the game played the weights of step 10
    launcher.monitor.take("test", {**game, "saved": True, "weights_taken_at": taken})
    launcher.monitor.take("test", {**game, "reward": 1.0, "steps": 20, "frames": 80})
    dat = tmp_path / "models" / f"{PONG}.dat"
    torch.save(A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(), dat)  # what the game saved
    launcher.ctx.steps[0] = 30
    launcher.save_state()  # then killed: this sitting never finishes its record
    resumed = prepare(
        parse_train_args([*flags, "--load", "--load-model-dir", str(tmp_path / "models")])
    )
    resumed.open_record()
    resumed.ctx.steps[0] = 40
    resumed.monitor.close("done", 0, weights=sorted(resumed.weights_left()))
    record = json.loads(resumed.paths.record.read_text())
    assert record["finished"]["training_in"] == {
        f"{PONG}.dat": {"steps": 10, "frames": 40, "seconds": 3.0}
    }
    assert record["finished"]["weights_sha256"][dat.name] == file_sha256(dat)
    from run_folder import training_record

    assert training_record(str(tmp_path / "logs"), dat, file_sha256(dat))["frames"] == 40
    # Resumed without --save-max, every game and the shutdown write <env>.dat: no cut point.
    plain = [
        *PONG_SMALL,
        *folders(tmp_path),
        "--load",
        "--load-model-dir",
        str(tmp_path / "models"),
    ]
    assert prepare(parse_train_args(plain)).monitor.dat_trained is None
    # From the .dat alone, with the record: its sitting is chained as it was written.
    models, logs = str(tmp_path / "models"), str(tmp_path / "logs")
    alone = [*PONG_SMALL, "--save-model-dir", str(tmp_path / "m2"), "--log-dir", logs,
             "--load", "--load-model-dir", models]  # fmt: skip
    (tmp_path / "models" / f"{PONG}_state.pt").unlink()
    went_on = prepare(parse_train_args(alone))
    went_on.open_record()
    chained = json.loads(went_on.paths.record.read_text())["previous_runs"][-1]
    assert chained["finished"] == record["finished"] and chained["counted_to"]["frames"] == 40
    assert run_totals(json.loads(went_on.paths.record.read_text()))["frames"] == 40


def test_an_old_summary_of_the_wrong_shape_does_not_stop_an_evaluation(tmp_path):
    from gym_eval import replaced_summary

    path = tmp_path / "Game_eval.json"
    summary = {
        "model": "b.dat", "model_sha256": "a" * 64, "protocol": {"env": "Game"}, "games": 3,
        "seed": 1, "processes": 2,
    }  # fmt: skip
    same = '"model": "b.dat", "protocol": {"env": "Game"}, "games": 3, "seed": 1'
    for content, said in (
        ('{"model": ["x"]}', None),
        ('{"model": "a.dat"}', "held the evaluation of a.dat; it now holds this one's"),
        ('{"model": "b.dat", "protocol": 7}', "held an evaluation of this model that names no"),
        (f'{{{same}, "processes": 2}}', None),  # the same evaluation again
        (f'{{{same}, "processes": 2, "model_sha256": "{"a" * 64}"}}', None),
        (f'{{{same}, "processes": 1}}', "(processes 1 there, 2 here)"),  # other games dealt
        (f'{{{same}, "processes": 2, "model_sha256": "{"b" * 64}"}}', "of other weights in b"),
        ("[1]", None),
        ("not json", None),
    ):
        path.write_text(content)
        note = replaced_summary(path, summary)
        assert note == said if said is None else said in note, (content, note)


def test_resume_with_a_new_lr_uses_it_and_says_so(tmp_path, caplog):
    flags = [*PONG_SMALL, "--amsgrad", *folders(tmp_path)]
    first = prepare(parse_train_args([*flags, "--lr", "0.0001"]))
    first.save_state()
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    with caplog.at_level("INFO", logger="a3g.main"):
        resumed = prepare(parse_train_args([*flags, *load, "--lr", "0.00005"]))
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [0.00005]
    assert resumed.optimizer.param_groups[0]["amsgrad"] is True
    assert "optimizer lr was 0.0001 in the training state; this run uses 5e-05" in caplog.text

    caplog.clear()
    with caplog.at_level("INFO", logger="a3g.main"):
        same = prepare(parse_train_args([*flags, *load, "--lr", "0.0001"]))
    assert same.optimizer.param_groups[0]["lr"] == 0.0001
    assert "resumed from" in caplog.text and "optimizer lr was" not in caplog.text


def test_resume_names_the_settings_it_changes_and_the_lr_a_new_budget_gives(caplog):
    from run_folder import log_changed_settings

    flags = [*PONG_SMALL, "--lr-schedule", "linear", "--lr", "0.001"]
    saved = as_dict(parse_train_args([*flags, "--max-steps", "10000"]))
    log = logging.getLogger("a3g.main")
    with caplog.at_level("INFO", logger=log.name):
        config = parse_train_args(
            [*flags, "--max-steps", "20000", "--load", "--gamma", "0.998", "--load-model-dir", "m"]
        )
        log_changed_settings({**saved, "ray_address": ""}, config, 9000, log)  # an older state
    assert "resume: this sitting changes --gamma 0.99 -> 0.998, --max-steps 10000 -> 20000" in (
        caplog.text
    )
    assert "--load" not in caplog.text and "--ray-address" not in caplog.text  # nor -model-dir
    assert "the lr at step 9,000 is 0.00055; it was 0.0001 when the state was saved" in caplog.text

    caplog.clear()
    with caplog.at_level("INFO", logger=log.name):
        log_changed_settings(saved, parse_train_args([*flags, "--max-steps", "10000"]), 9000, log)
        log_changed_settings({"env": saved["env"]}, config, 9000, log)  # an older state's config
    assert caplog.text == ""
    with caplog.at_level("INFO", logger=log.name):  # a list, changed: said, not a TypeError
        log_changed_settings({**saved, "gpu_ids": [0, 1]}, config, 9000, log)
    assert "--gpu-ids [0, 1] -> [-1]" in caplog.text


@pytest.mark.parametrize(
    ("saved_with", "resumed_with", "said"),
    [
        ("--shared-optimizer", "--shared-optimizer", "; optimizer statistics restored"),
        ("--no-shared-optimizer", "--shared-optimizer", "start afresh (the state holds none"),
        ("--shared-optimizer", "--no-shared-optimizer", "start afresh in each worker"),
    ],
)
def test_resume_says_which_optimizer_statistics_it_restored(
    tmp_path, caplog, saved_with, resumed_with, said
):
    flags = [*PONG_SMALL, *folders(tmp_path)]
    prepare(parse_train_args([*flags, saved_with])).save_state()
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    with caplog.at_level("INFO", logger="a3g.main"):
        prepare(parse_train_args([*flags, *load, resumed_with]))
    [line] = [r.message for r in caplog.records if r.message.startswith("resumed from")]
    assert said in line
    assert ("restored" in line) == (said == "; optimizer statistics restored")


def test_a_run_that_would_write_over_a_saved_model_says_so(tmp_path, caplog):
    (tmp_path / "models").mkdir()
    torch.save(
        A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(), tmp_path / "models" / f"{PONG}.dat"
    )
    with caplog.at_level("WARNING", logger="a3g.main"):
        prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    assert f"{PONG}.dat exists and this run will write over it" in caplog.text
    caplog.clear()
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    with caplog.at_level("WARNING", logger="a3g.main"):
        prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), *load]))
    assert "write over it" not in caplog.text and "--save-max" not in caplog.text
    # --save-max from the weights alone: the file's score is unknown, the first game replaces it.
    with caplog.at_level("WARNING", logger="a3g.main"):
        prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), *load, "--save-max"]))
    assert "the first test game's weights replace it; copy it elsewhere" in caplog.text
    # Loaded from elsewhere, the saved model is still written over; and an earlier run's record.
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / f"{PONG}.dat").write_bytes(
        (tmp_path / "models" / f"{PONG}.dat").read_bytes()
    )
    (tmp_path / "logs" / f"{PONG}_run.json").write_text("{}")
    caplog.clear()
    with caplog.at_level("WARNING", logger="a3g.main"):
        prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
        prepare(
            parse_train_args([*PONG_SMALL, *folders(tmp_path), *load[:2], str(tmp_path / "in")])
        )
    assert caplog.text.count(f"{PONG}.dat exists and this run will write over it") == 2
    # The earlier run's record is kept aside, never written over (twice: both kept).
    record = tmp_path / "logs" / f"{PONG}_run.json"
    for kept in (f"{record}.earlier_run", f"{record}.earlier_run.1"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)])).open_record()
        assert (
            f"held an earlier run's record (its test games stay in the log); the file is "
            f"kept as {kept}" in caplog.text
        )
    assert json.loads(Path(f"{record}.earlier_run").read_text()) == {}
    # --save-max's final weights too, unless the run goes on from that folder's training
    # state (from its .dat alone, the file may be another run's).
    (tmp_path / "models" / f"{PONG}_last.dat").write_bytes(b"")
    for flags, said in (([], 1), (load, 1), (load, 0)):
        if not said:
            prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), *load])).save_state()
        caplog.clear()
        with caplog.at_level("WARNING", logger="a3g.main"):
            prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), *flags, "--save-max"]))
        assert caplog.text.count(f"{PONG}_last.dat exists and this run will write over it") == said


def test_a_resume_past_its_budget_or_at_another_frame_skip_is_refused(
    tmp_path, monkeypatch, capsys
):
    flags = [*PONG_SMALL, *folders(tmp_path)]
    launcher = prepare(parse_train_args(flags))
    launcher.ctx.steps[0] = 1500
    launcher.save_state()
    state = tmp_path / "models" / f"{PONG}_state.pt"
    load = [*flags, "--load", "--load-model-dir", str(tmp_path / "models")]
    for more, message in (
        (["--max-steps", "1500"], "is at step 1,500, at or past --max-steps 1500: give a larger"),
        (["--skip-rate", "2"], "frame skip of 4, this run has 2: resume with --skip-rate 4 (its"),
        (
            ["--skip-rate-min", "3"],
            "frame skip of 4, this run has 3-4: resume with --skip-rate 4 and without "
            "--skip-rate-min (its",
        ),
        (["--amsgrad"], "was saved with --amsgrad False, this run has True: resume with the"),
        (["--optimizer", "RMSprop"], "was saved with --optimizer Adam, this run has RMSprop"),
    ):
        code, err = main_here([*load, *more], monkeypatch, capsys)
        assert code == 2 and err.startswith(f"main.py: error: training state '{state}' "), err
        assert message in err and len(err.splitlines()) == 1, err
    assert prepare(parse_train_args([*load, "--max-steps", "1501"])).resumed.steps == 1500


def test_a_resume_into_another_log_dir_keeps_the_earlier_sittings_record_and_says_so(
    tmp_path, caplog
):
    first = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    first.open_record()
    first.ctx.steps[0] = 1500
    first.save_state()
    first.monitor.close("SIGINT received", 0)
    elsewhere = ["--save-model-dir", str(tmp_path / "m2"), "--log-dir", str(tmp_path / "l2")]
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    with caplog.at_level("WARNING", logger="a3g.main"):
        resumed = prepare(parse_train_args([*PONG_SMALL, *elsewhere, *load]))
    assert (
        f"resume: the earlier sittings logged to {tmp_path / 'logs'}; this sitting's log "
        f"{tmp_path / 'l2' / f'{PONG}_log'} starts without their test games (copy "
        f"{PONG}_log from there first for one curve)"
    ) in caplog.text
    # The new folder holds another run's record: neither chained in nor written over.
    foreign = {"config": {"tensorboard_dir": "l2/runs/Other_1"}, "finished": {"frames": 9}}
    resumed.paths.record.write_text(json.dumps(foreign))
    with caplog.at_level("WARNING", logger="a3g.main"):
        resumed.open_record()
    assert f"{resumed.paths.record} is the record of another run (TensorBoard folder Other_1" in (
        caplog.text
    )
    record = json.loads(resumed.paths.record.read_text())
    (earlier,) = record["previous_runs"]
    assert earlier["finished"]["steps"] == 1500  # read from the earlier --log-dir, left there
    assert json.loads((tmp_path / "logs" / f"{PONG}_run.json").read_text()) == earlier
    kept = resumed.paths.record.with_name(f"{PONG}_run.json.another_run")
    assert json.loads(kept.read_text()) == foreign
    # Once more: the one kept before is not written over.
    resumed.paths.record.write_text(json.dumps({**foreign, "finished": {"frames": 10}}))
    resumed.monitor.record = {}
    resumed.open_record()
    assert json.loads(kept.read_text()) == foreign
    assert json.loads(kept.with_name(kept.name + ".1").read_text())["finished"]["frames"] == 10
    # Back into the first --log-dir, whose record is older: the sittings in between stay.
    resumed.ctx.steps[0] = 500
    resumed.save_state()
    resumed.monitor.close("SIGINT received", 0)
    back = [*PONG_SMALL, "--save-model-dir", str(tmp_path / "m3"), "--log-dir",
            str(tmp_path / "logs"), "--load", "--load-model-dir", str(tmp_path / "m2")]  # fmt: skip
    (tmp_path / "logs" / f"{PONG}_log").write_text("")  # the first sitting's test games
    caplog.clear()
    with caplog.at_level("WARNING", logger="a3g.main"):
        again = prepare(parse_train_args(back))
    assert f"resume: the sitting before logged to {tmp_path / 'l2'}; {again.paths.log} goes on" in (
        caplog.text
    )
    again.open_record()
    record = json.loads(again.paths.record.read_text())
    assert [run["finished"]["steps"] for run in record["previous_runs"]] == [1500, 2000]


def test_a_resume_from_another_working_directory_finds_the_earlier_sittings(
    tmp_path, monkeypatch, caplog
):
    """The state keeps its --log-dir absolute: typed relative, it named another folder."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    first = prepare(parse_train_args([*PONG_SMALL, "--save-model-dir", "m", "--log-dir", "l"]))
    first.open_record()
    first.ctx.steps[0] = 100
    first.save_state()
    first.monitor.close("SIGINT received", 0)
    monkeypatch.chdir(tmp_path / "elsewhere")
    load = [*PONG_SMALL, "--save-model-dir", "../m", "--load", "--load-model-dir", "../m"]
    for log_dir in ("../l", "../l2"):  # the same folder, then another
        caplog.clear()
        with caplog.at_level("WARNING", logger="a3g.main"):
            again = prepare(parse_train_args([*load, "--log-dir", log_dir]))
        assert ("resume:" in caplog.text) == (log_dir == "../l2"), caplog.text
        assert "is not there" not in caplog.text
        again.open_record()
        record = json.loads(again.paths.record.read_text())
        finished = [
            run["finished"]["steps"] for run in record["previous_runs"] if "finished" in run
        ]
        assert finished == [100]  # (then the sitting in ../l, never finished here)
    # The earlier sittings' record gone: said, not silently started afresh.
    (tmp_path / "l" / f"{PONG}_run.json").unlink()
    with caplog.at_level("WARNING"):
        prepare(parse_train_args([*load, "--log-dir", "../l3"])).open_record()
    assert f"resume: no run record of the earlier sittings in ../l3 or {tmp_path / 'l'}" in (
        caplog.text
    )
    # The run folder moved whole, resumed with the same relative flags: quiet, record kept.
    (tmp_path / "l2" / f"{PONG}_run.json").rename(tmp_path / "l" / f"{PONG}_run.json")
    from checkpoint import release_run_locks

    release_run_locks()  # as the earlier sittings' processes did at their exit
    monkeypatch.chdir(tmp_path.parent)
    moved = tmp_path.parent / f"{tmp_path.name}_moved"
    tmp_path.rename(moved)
    monkeypatch.chdir(moved)  # where the first sitting was started, with its flags
    first_flags = ["--save-model-dir", "m", "--log-dir", "l", "--load", "--load-model-dir", "m"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = prepare(parse_train_args([*PONG_SMALL, *first_flags]))
        again.open_record()
    assert "resume" not in caplog.text, caplog.text
    record = json.loads(again.paths.record.read_text())
    assert [run.get("finished", {}).get("steps") for run in record["previous_runs"]][0] == 100


def test_a_resume_finds_its_record_set_aside_by_another_run_started_in_its_log_dir(
    tmp_path, caplog
):
    logs = ["--log-dir", str(tmp_path / "logs")]
    first = prepare(parse_train_args([*PONG_SMALL, "--save-model-dir", str(tmp_path / "a"), *logs]))
    first.open_record()
    first.ctx.steps[0] = 100
    first.save_state()
    first.monitor.close("SIGINT received", 0)
    time.sleep(1.05)  # a run is told by its TensorBoard folder, named to the second
    other = prepare(parse_train_args([*PONG_SMALL, "--save-model-dir", str(tmp_path / "b"), *logs]))
    other.open_record()  # by mistake into the same --log-dir: the first run's record set aside
    other.save_state()
    load = [
        "--save-model-dir",
        str(tmp_path / "a"),
        "--load",
        "--load-model-dir",
        str(tmp_path / "a"),
    ]
    again = prepare(parse_train_args([*PONG_SMALL, *load, *logs]))
    with caplog.at_level("WARNING"):
        again.open_record()
    kept = tmp_path / "logs" / f"{PONG}_run.json.earlier_run"
    assert f"the earlier sittings' run record is taken from {kept}" in caplog.text
    record = json.loads(again.paths.record.read_text())
    assert [run["finished"]["steps"] for run in record["previous_runs"]] == [100]
    # And the other run resumed in turn: its record, set aside by that resume, is found.
    b = ["--save-model-dir", str(tmp_path / "b"), "--load", "--load-model-dir", str(tmp_path / "b")]
    resumed_b = prepare(parse_train_args([*PONG_SMALL, *b, *logs]))
    resumed_b.open_record()
    record = json.loads(resumed_b.paths.record.read_text())
    assert record["previous_runs"][0]["config"]["save_model_dir"] == str(tmp_path / "b")


def test_a_run_record_that_cannot_be_started_is_one_line_and_nothing_runs(
    tmp_path, monkeypatch, capsys
):
    import monitor

    def disk_full(_self, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(monitor.RunMonitor, "open", disk_full)
    code, err = main_here([*PONG_SMALL, *folders(tmp_path)], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"main.py: error: cannot start the run record {tmp_path}"), err
    assert "No space left on device" in err and "--log-dir" in err
    assert not (tmp_path / "models" / f"{PONG}.dat").exists()  # nothing trained, nothing saved


def test_a_run_whose_games_can_end_in_their_reset_says_so(tmp_path, caplog):
    flags = [*PONG_SMALL, *folders(tmp_path), "--max-episode-length", "5"]
    with caplog.at_level("WARNING", logger="a3g.main"):
        prepare(parse_train_args(flags))
    assert "--max-episode-length 5 is 20 frames, which the reset's 1-30 random" in caplog.text


def test_a_ctrl_c_while_the_run_is_prepared_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    import main

    real_prepare = main.prepare

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt  # a Ctrl-C while a large training state loads, say

    monkeypatch.setattr(main, "prepare", interrupted)
    code, err = main_here([*PONG_SMALL, *folders(tmp_path)], monkeypatch, capsys)
    assert (code, err) == (130, "main.py: stopped before training started\n")

    # SIGTERM (timeout, a scheduler) there is the same, and the run's folder marks go with it.
    def terminated(*args, **kwargs):
        launcher = real_prepare(*args, **kwargs)
        assert (tmp_path / "models" / f"{PONG}.lock").exists()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal stops it first
        return launcher

    monkeypatch.setattr(main, "prepare", terminated)
    code, err = main_here([*PONG_SMALL, *folders(tmp_path)], monkeypatch, capsys)
    assert (code, err) == (130, "main.py: stopped before training started\n")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []
    assert not (tmp_path / "logs" / f"{PONG}.lock").exists()


# Runs the script as `python <script>` does, with a Ctrl-C sent the moment its `import torch`
# begins (inside the imports, where Python would raise KeyboardInterrupt mid-import).
CTRL_C_IN_TORCH_IMPORT = """
import os, runpy, signal, sys

class CtrlCAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.argv = sys.argv[1:]
sys.meta_path.insert(0, CtrlCAtTorch())
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def sigint_default() -> None:
    """In a child before it runs: SIGINT as a terminal gives it (a test run in the background,
    as CI may start it, would hand it down ignored, which the scripts keep)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("main.py", "main.py: stopped before training started"),
        ("gym_eval.py", "gym_eval.py: interrupted; no summary saved"),
    ],
)
def test_a_ctrl_c_while_torch_imports_is_one_line_and_exit_130(tmp_path, script, message):
    flags = (
        [*PONG_SMALL, "--max-steps", "200", *folders(tmp_path)]
        if script == "main.py"
        else ["--env", PONG, "--num-episodes", "1", "--log-dir", str(tmp_path / "logs")]
    )
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_TORCH_IMPORT, script, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=sigint_default,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (130, message + "\n"), result.stderr
    assert not (tmp_path / "models").exists() and not (tmp_path / "logs").exists()


def test_a_ctrl_c_as_a_script_exits_is_ignored_and_an_inherited_ignore_is_kept():
    """A Ctrl-C in the exit handlers, or in the teardown after them (sent from each here),
    leaves the exit code main returned."""
    for late in ("exit handlers", "teardown"):
        at_exit = (
            "import atexit, os, signal, sys, time, utils\n"
            "def ctrl_c(): os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
            "class Late:\n"
            "    def __del__(self): ctrl_c()\n"
            + (
                "atexit.register(ctrl_c)\n"
                if late == "exit handlers"
                else "sys.modules['late'] = type(sys)('late'); sys.modules['late'].x = Late()\n"
            )
            + "utils.run_script(lambda: 0, [], 'never printed')\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", at_exit], cwd=ROOT, capture_output=True, text=True,
            timeout=60, preexec_fn=sigint_default,
        )  # fmt: skip
        assert (result.returncode, result.stderr) == (0, ""), (late, result.stderr)
    # Started with SIGINT ignored (a background job of a script): main runs with it ignored.
    ignored = (
        "import signal, utils\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "utils.run_script(lambda: 3 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 4,"
        " [], '')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", ignored], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 3, result.stderr


def test_a_signal_while_a_run_stops_at_its_budget_keeps_the_reason_it_stopped(tmp_path):
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    launcher.stop_reason = "--max-steps 100 reached"  # its files are being saved
    launcher._on_signal(signal.SIGINT, None)
    assert launcher.ctx.stopping() and launcher.stop_reason == "--max-steps 100 reached"


def test_a_launcher_that_fails_mid_run_still_saves_and_closes_its_record(tmp_path, caplog):
    """An unexpected error while supervising (a bug, Ray's engine) is its traceback in the log
    and exit 1, with the files saved and the run record finished: not a record left open."""
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))

    def broken() -> None:
        raise RuntimeError("the GCS hiccuped")

    launcher.on_poll = broken
    launcher.ctx.steps[0] = 100  # it has trained (a fresh run that had not saves nothing)
    with caplog.at_level("INFO", logger="a3g.main"):
        assert launcher.run() == 1
    assert "Traceback" in caplog.text and 'raise RuntimeError("the GCS hiccuped")' in caplog.text
    record = json.loads(launcher.paths.record.read_text())
    assert record["finished"]["exit_code"] == 1
    assert (
        record["finished"]["stop_reason"] == "the launcher failed: RuntimeError: the GCS hiccuped"
    )
    assert (tmp_path / "models" / f"{PONG}.dat").exists()
    assert (tmp_path / "models" / f"{PONG}_state.pt").exists()
    assert all(proc.exitcode is not None for proc in launcher.processes.values())
    # The record names the weights the run left, for evaluations to tell them from others.
    left = [tmp_path / "models" / f"{PONG}{end}" for end in (".dat", "_state.pt")]
    assert record["finished"]["weights_sha256"] == {path.name: file_sha256(path) for path in left}


def test_a_save_max_record_names_the_dat_only_once_a_game_of_its_run_saved_it(tmp_path):
    (tmp_path / "models").mkdir()
    foreign = tmp_path / "models" / f"{PONG}.dat"  # another run's, found in the folder
    torch.save(A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(), foreign)
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), "--save-max"]))
    launcher.ctx.steps[0] = 10
    assert foreign not in launcher.weights_left()
    game = {"reward": 5.0, "length": 9, "ending": "game over", "steps": 10, "frames": 40}
    launcher.monitor.take("test", {**game, "saved": True})
    assert foreign in launcher.weights_left()
    plain = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path / "b")]))
    plain.monitor.take("test", {**game, "saved": False})  # a game of untrained weights
    assert plain.weights_left() == set()  # nothing trained yet: nothing is this run's
    plain.ctx.steps[0] = 100
    assert plain.paths.model in plain.weights_left()  # its shutdown writes it


def test_skipped_updates_are_counted_in_the_status_line_and_the_run_record(tmp_path, caplog):
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    launcher.open_record()
    launcher.ctx.skipped[0] = 2  # as two workers' non-finite updates would count them
    with caplog.at_level("INFO", logger="a3g.main"):
        launcher.monitor.tick(force=True)
        assert caplog.text.rstrip().endswith(
            "| no test game finished yet | 2 non-finite updates skipped | the workers are starting"
        )
        launcher.ctx.steps[0] = 20  # a first rollout counted: started
        launcher.monitor.tick(force=True)
    assert caplog.text.rstrip().endswith("| 2 non-finite updates skipped")
    launcher.monitor.close("done", 0)
    record = json.loads(launcher.paths.record.read_text())
    assert record["finished"]["skipped_updates"] == 2


def test_the_closing_status_line_of_a_run_that_trained_nothing_says_no_start(tmp_path, caplog):
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    launcher.open_record()
    with caplog.at_level("INFO", logger="a3g.main"):
        launcher.monitor.close("SIGINT received", 0)  # stopped before any rollout counted
    closing = [r.message for r in caplog.records if r.message.startswith("status ")][-1]
    assert closing.endswith("| no test game finished yet"), closing


def test_a_run_record_that_cannot_be_completed_is_said_and_exit_1(tmp_path, caplog):
    """The weights and state are saved, but a record without its end is lost data: exit 1."""
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    launcher.on_poll = launcher.ctx.request_stop  # at its first look: stop
    launcher.ctx.steps[0] = 100  # having trained

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    launcher.monitor.close = disk_full
    with caplog.at_level("INFO", logger="a3g.main"):
        assert launcher.run() == 1
    assert f"could not complete the run record {launcher.paths.record} (" in caplog.text
    assert "finished" not in json.loads(launcher.paths.record.read_text())
    assert (tmp_path / "models" / f"{PONG}.dat").exists()


def test_a_signal_before_any_child_starts_stops_and_writes_over_nothing(tmp_path, caplog):
    """Inside `Launcher.run` the handlers are set from its first moment: a Ctrl-C while the
    run record is written there (a cluster's driver writes it inside them, then starts the
    nodes) is a clean stop, not a KeyboardInterrupt. main.py writes it before `run`: a Ctrl-C
    then is `test_a_ctrl_c_while_the_run_is_prepared_is_one_line_and_exit_130`'s. A fresh
    run that trained nothing leaves the weights there (the shipped agent, by default) as
    they were, and no training state to refuse the next fresh run."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"{PONG}.dat").write_bytes(b"the shipped agent")
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    open_record = launcher.monitor.open

    def interrupted_while_writing(**kwargs):
        open_record(**kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # handled at once, in this thread

    launcher.monitor.open = interrupted_while_writing
    before = signal.getsignal(signal.SIGINT)
    with caplog.at_level("INFO", logger="a3g.main"):
        assert launcher.run() == 0
    assert signal.getsignal(signal.SIGINT) is before  # given back
    assert not launcher.processes and launcher.stop_reason == "SIGINT received"
    assert (tmp_path / "models" / f"{PONG}.dat").read_bytes() == b"the shipped agent"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        f"{PONG}.dat",
        f"{PONG}.lock",
    ]
    assert "nothing saved (untrained when the stop came)" in caplog.text
    record = json.loads((tmp_path / "logs" / f"{PONG}_run.json").read_text())
    assert record["finished"]["stop_reason"] == "SIGINT received"
    assert record["finished"]["exit_code"] == 0 and record["finished"]["weights_sha256"] == {}
    # Loaded weights are saved as ever, trained or not (a resume stopped at once, say).
    (tmp_path / "weights").mkdir()
    torch.save(launcher.shared_model.state_dict(), tmp_path / "weights" / f"{PONG}.dat")
    load = ["--load", "--load-model-dir", str(tmp_path / "weights")]
    loaded = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path / "b"), *load]))
    loaded.ctx.request_stop()
    assert loaded.run() == 0
    assert {p.name for p in (tmp_path / "b" / "models").iterdir()} >= {
        f"{PONG}.dat",
        f"{PONG}_state.pt",
    }


def test_a_rollout_counted_while_an_untrained_run_stops_saves_nothing(tmp_path, caplog):
    """The stop decides: 32 workers on 2 cores stopped in their first minute finish a
    rollout or two while they stop, and those weights must not replace the shipped agent."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"{PONG}.dat").write_bytes(b"the shipped agent")
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    launcher.open_record()
    stop_children = launcher.stop_children

    def a_last_rollout_counted() -> None:
        stop_children()
        launcher.ctx.steps[0] = 40

    launcher.stop_children = a_last_rollout_counted
    with caplog.at_level("INFO", logger="a3g.main"):
        launcher._on_signal(signal.SIGINT, None)  # the Ctrl-C, as its handler takes it
        launcher.ctx.steps[0] = 20  # a rollout counted before the launcher's shutdown began
        launcher.shutdown()
    assert f"{STOPPING}SIGINT received; nothing trained to save" in caplog.text
    assert "nothing was trained before the stop: no weights or training state written" in (
        caplog.text
    )
    assert (tmp_path / "models" / f"{PONG}.dat").read_bytes() == b"the shipped agent"
    assert not (tmp_path / "models" / f"{PONG}_state.pt").exists()
    assert launcher.trained_nothing() and launcher.weights_left() == set()


def test_an_rmsprop_state_saved_with_amsgrad_still_resumes(tmp_path):
    """Earlier versions took --amsgrad with RMSprop (which ignores it) and saved it."""
    flags = [*PONG_SMALL, *folders(tmp_path), "--optimizer", "RMSprop"]
    prepare(parse_train_args(flags)).save_state()
    path = tmp_path / "models" / f"{PONG}_state.pt"
    state = TrainingState.load(path)
    state.config["amsgrad"] = True
    state.save(path)
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    assert prepare(parse_train_args([*flags, *load])).resumed is not None


def test_a_state_without_optimizer_statistics_resumes_with_another_optimizer(tmp_path, caplog):
    """Nothing of the saved optimizer is restored (--no-shared-optimizer, or a cluster run)."""
    flags = [*PONG_SMALL, *folders(tmp_path)]
    prepare(
        parse_train_args([*flags, "--no-shared-optimizer", "--optimizer", "RMSprop"])
    ).save_state()
    assert TrainingState.load(tmp_path / "models" / f"{PONG}_state.pt").optimizer is None
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    with caplog.at_level("INFO", logger="a3g.main"):
        assert prepare(parse_train_args([*flags, *load, "--amsgrad"])).resumed is not None
    assert "optimizer statistics start afresh (the state holds none" in caplog.text


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"previous_runs": 3}'])
def test_a_resume_keeps_an_unreadable_run_record_aside_and_says_so(tmp_path, caplog, content):
    flags = [*PONG_SMALL, *folders(tmp_path)]
    prepare(parse_train_args(flags)).save_state()
    record = tmp_path / "logs" / f"{PONG}_run.json"
    record.write_text(content)
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    monitor = prepare(parse_train_args([*flags, *load])).monitor
    with caplog.at_level("WARNING"):
        monitor.open(resumed_from=str(tmp_path / "models" / f"{PONG}_state.pt"))
    assert f"run record {record} cannot be read" in caplog.text
    assert (tmp_path / "logs" / f"{PONG}_run.json.unreadable").read_text() == content
    written = json.loads(record.read_text())
    assert "previous_runs" not in written and written["resumed_from"].endswith("_state.pt")


@pytest.mark.slow
def test_load_without_a_training_state_loads_the_weights_alone_and_says_so(tmp_path):
    model = A3Clstm(1, gym.spaces.Discrete(6), 32)
    (tmp_path / "in").mkdir()
    torch.save(model.state_dict(), tmp_path / "in" / f"{PONG}.dat")
    # The record of the run the .dat came from (another machine's, copied over).
    (tmp_path / "logs").mkdir()
    before = {"command": "python main.py --before", "finished": {"frames": 1000, "seconds": 9.0}}
    (tmp_path / "logs" / f"{PONG}_run.json").write_text(json.dumps(before))
    result = run_cli(
        "main.py", *PONG_SMALL, "--max-steps", "40", "--load",
        "--load-model-dir", str(tmp_path / "in"), *folders(tmp_path), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loaded the weights alone from" in result.stderr
    assert "no training state" in result.stderr
    # The record keeps the run before, and this sitting counts afresh after it.
    record = json.loads((tmp_path / "logs" / f"{PONG}_run.json").read_text())
    assert record["previous_runs"] == [before] and "resumed_from" not in record
    assert record["loaded_weights_from"] == str(tmp_path / "in" / f"{PONG}.dat")
    totals = run_totals(record)
    assert totals["frames"] == 1000 + record["finished"]["frames"] and totals["restarts"] == 1


def test_a_dat_alone_goes_on_only_from_the_sittings_behind_its_bytes(tmp_path, caplog):
    """The record beside a .dat loaded alone is chained up to the sitting that wrote it."""
    (tmp_path / "in").mkdir()
    dat = tmp_path / "in" / f"{PONG}.dat"
    torch.save(A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(), dat)
    digest = file_sha256(dat)
    record = tmp_path / "logs" / f"{PONG}_run.json"
    load = [*PONG_SMALL, "--load", "--load-model-dir", str(tmp_path / "in"), *folders(tmp_path)]

    def sitting(n: int, weights: str) -> dict:
        return {
            "command": f"python main.py --{n}",
            "finished": {
                "frames": 1000 * n,
                "seconds": 9.0,
                "weights_sha256": {f"{PONG}_last.dat": weights},
            },
        }

    def started(before: dict) -> dict:
        record.parent.mkdir(exist_ok=True)
        record.write_text(json.dumps(before))
        launcher = prepare(parse_train_args(load))
        with caplog.at_level("WARNING"):
            launcher.open_record()
        return json.loads(record.read_text())

    # Written by the first of two sittings: the second trained past them, so it is left out.
    two = {**sitting(2, "b" * 64), "previous_runs": [sitting(1, digest)]}
    assert started(two)["previous_runs"] == [sitting(1, digest)]
    assert json.loads((record.parent / f"{record.name}.whole").read_text()) == two
    assert "is of its sitting 1, so this run's record goes on from there without the 1" in (
        caplog.text
    )
    # Another run's record (no sitting left these bytes): kept aside, not chained in.
    caplog.clear()
    other = sitting(1, "c" * 64)
    assert "previous_runs" not in started(other)
    assert json.loads((record.parent / f"{record.name}.another_run").read_text()) == other
    assert f"is the record of other weights (no sitting in it left {dat})" in caplog.text


# -- a killed launcher -----------------------------------------------------------------------------


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def start_run(tmp_path: Path, *flags: str, preexec_fn=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "main.py", *flags, *folders(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=preexec_fn,
    )  # fmt: skip


def process_with_title(pgid: int, title: bytes) -> int | None:
    for pid in group_alive(pgid):
        try:
            if title in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_orphans_and_the_run_resumes(tmp_path):
    state_path = tmp_path / "models" / f"{PONG}_state.pt"
    proc = start_run(tmp_path, *PONG_FLAGS, "--workers", "2", "--state-interval", "1")
    try:
        wait_for(lambda: state_path.exists(), 90, "the first training-state file")
        wait_for(lambda: TrainingState.read_file(state_path)["steps"] > 0, 60, "counted steps")
        # A second launcher into the live run's folders (a resume typed in another terminal)
        # is refused before it writes a byte: the run's files stay its own.
        lock = tmp_path / "models" / f"{PONG}.lock"
        holder = f"{proc.pid} on {socket.gethostname()}\n"
        assert lock.read_text() == holder
        log_before = (tmp_path / "logs" / f"{PONG}_log").read_bytes()
        load = ["--load", "--load-model-dir", str(tmp_path / "models")]
        second = run_cli("main.py", *PONG_FLAGS, *load, *folders(tmp_path), timeout=60)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.count("\n") == 1, second.stderr
        assert f"another run of {PONG} (process {holder.strip()})" in second.stderr
        assert (tmp_path / "logs" / f"{PONG}_log").read_bytes()[: len(log_before)] == log_before
        assert lock.read_text() == holder
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        # The children notice their parent is gone and stop by themselves.
        assert wait_group_gone(proc.pid, seconds=20) == []
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    saved = TrainingState.read_file(state_path)
    result = run_cli(
        "main.py", *PONG_FLAGS, "--workers", "1", "--load",
        "--load-model-dir", str(tmp_path / "models"), "--max-steps", str(saved["steps"] + 100),
        *folders(tmp_path), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resumed from {state_path}: step {saved['steps']:,}" in result.stderr
    assert TrainingState.read_file(state_path)["steps"] >= saved["steps"] + 100
    # The killed launcher's lock file (its process id still in it) held no lock; the resume
    # took it, and removed it at its exit.
    assert not (tmp_path / "models" / f"{PONG}.lock").exists()
    assert not (tmp_path / "logs" / f"{PONG}.lock").exists()


# -- crashed workers -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_finishes(tmp_path):
    proc = start_run(
        tmp_path, *PONG_FLAGS, "--workers", "2", "--max-steps", "1500", "--test-interval", "0"
    )
    try:
        wait_for(lambda: process_with_title(proc.pid, b"Train Agent: 1"), 60, "worker 1")
        victim = process_with_title(proc.pid, b"Train Agent: 1")
        time.sleep(2)
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-2000:]
    assert (
        f"Train Agent: 1 (pid {victim}) died: killed by SIGKILL; no error report "
        "(it died without raising); restarting it with the latest weights"
    ) in stderr
    assert "--max-steps 1500 reached" in stderr
    assert wait_group_gone(proc.pid) == []
    load_pong_dat(tmp_path / "models" / f"{PONG}.dat")


@pytest.mark.slow
def test_a_worker_that_keeps_dying_stops_the_run_with_files_saved(tmp_path):
    proc = start_run(tmp_path, *PONG_FLAGS, "--workers", "2")
    killed = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            victim = process_with_title(proc.pid, b"Train Agent: 0")
            if victim is not None and victim not in killed:
                time.sleep(0.5)
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
            time.sleep(0.1)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-2000:]
    assert len(killed) == 4
    assert "died 4 times in 10 minutes, so the run stops" in stderr
    assert stderr.count("restarting it with the latest weights") == 3
    assert wait_group_gone(proc.pid) == []
    load_pong_dat(tmp_path / "models" / f"{PONG}.dat")
    assert TrainingState.read_file(tmp_path / "models" / f"{PONG}_state.pt")["steps"] > 0


def _exit_with(code: int) -> None:
    sys.exit(code)


def _fail_with(kind: str, ctx: ProcessContext) -> None:
    with child_process("Train Agent: 0", ctx):
        if kind == "fatal":
            raise FatalRunError("NaN keeps coming")
        raise RuntimeError("the env crashed")


@pytest.mark.parametrize(("kind", "restarted"), [("crash", True), ("fatal", False)])
def test_the_launcher_restarts_a_crashed_child_but_not_a_fatal_one(
    tmp_path, caplog, kind, restarted
):
    """A crash is restarted; a FatalRunError (bad config, NaN that keeps coming) stops the run."""
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    child_ctx = launcher.channels.open(Child(0), launcher.ctx, 0)
    dead = launcher.mp.Process(target=_fail_with, args=(kind, child_ctx))
    dead.start()
    launcher.channels.started(child_ctx)
    dead.join()
    # What a restart would run: a child that exits at once, instead of a real worker.
    launcher.process_target = lambda child, ctx: (_exit_with, (0,))
    with caplog.at_level("WARNING", logger="a3g.main"):
        assert launcher._handle_death(Child(0), dead) is restarted
    assert launcher.failed is not restarted
    if restarted:
        assert "exit code 1; RuntimeError: the env crashed; restarting it" in caplog.text
        launcher.processes[Child(0)].join(30)
        assert launcher.processes[Child(0)].exitcode == 0
    else:
        assert launcher.stop_reason.endswith("exit code 3; FatalRunError: NaN keeps coming")
        assert Child(0) not in launcher.processes
    if launcher.monitor.writer is not None:
        launcher.monitor.writer.close()


def test_each_start_of_a_child_is_given_its_own_seeds(tmp_path):
    """A fresh run's children start with the plain seeds; a restarted one draws its own."""
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path)]))
    given: list[tuple[Child, ProcessStart]] = []

    def quick_target(child: Child, ctx: ProcessContext) -> tuple:
        args = Launcher.process_target(launcher, child, ctx)[1]
        given.append((child, args[0].start if child.rank is None else args[-1]))
        return _exit_with, (0,)

    launcher.process_target = quick_target
    for child in (Child(0), Child(None), Child(0), Child(None)):  # the second each: a restart
        launcher._start(child)
        launcher.processes[child].join(30)
    assert given == [
        (Child(0), FIRST_START), (Child(None), FIRST_START),
        (Child(0), ProcessStart(0, 1)), (Child(None), ProcessStart(0, 1)),
    ]  # fmt: skip
    restarted, first = (train.worker_seeds(1, 0, 1, 1, given[i][1]) for i in (2, 0))
    assert restarted != first == (1, [1])
    if launcher.monitor.writer is not None:
        launcher.monitor.writer.close()


def _large_last_report(ctx: ProcessContext) -> None:
    ctx.report("ready", {})
    while not ctx.stopping():
        time.sleep(0.05)
    ctx.report("diagnostic", {"blob": "x" * 200_000})  # over a pipe's 64 KiB: blocks until read


@pytest.mark.slow
def test_shutdown_reads_the_last_reports_while_it_waits_for_the_children(tmp_path, caplog):
    launcher = prepare(parse_train_args([*PONG_FLAGS, "--workers", "4", *folders(tmp_path)]))
    launcher.process_target = lambda child, ctx: (_large_last_report, (ctx,))
    launcher.start()
    ready, deadline = 0, time.monotonic() + 180
    while ready < len(launcher.children) and time.monotonic() < deadline:  # all started
        ready += sum(kind == "ready" for _, kind, _ in launcher.channels.receive())
        time.sleep(0.1)
    assert ready == len(launcher.children)
    with caplog.at_level("WARNING", logger="a3g.main"):
        launcher.shutdown()
    assert "did not stop in time" not in caplog.text  # none had to be terminated
    assert [proc.exitcode for proc in launcher.processes.values()] == [0] * 5
    if launcher.monitor.writer is not None:
        launcher.monitor.writer.close()


# -- a failed save ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_save_keeps_the_previous_file_and_training_goes_on(tmp_path):
    """Files may not grow past 10 MiB (RLIMIT_FSIZE: EFBIG, as on a full disk).

    The shared-memory tensors (8 MiB at most) still fit; the 13 MB .dat and the training state
    do not.
    """
    (tmp_path / "models").mkdir()
    dat = tmp_path / "models" / f"{PONG}.dat"
    dat.write_bytes(b"previous checkpoint")

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 20, 10 << 20))

    proc = start_run(
        tmp_path, "--env", PONG, "--max-episode-length", "60", "--workers", "1",
        "--max-steps", "300", "--test-interval", "0", preexec_fn=limit_file_size,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-2000:]  # the last stretch's weights are not on disk
    assert f"could not save {dat}" in stderr and "the previous file is kept" in stderr
    assert "could not save the training state" in stderr
    assert "--max-steps 300 reached" in stderr
    last = stderr.strip().splitlines()[-1]  # the final line says which saves did not happen
    assert f"model NOT saved to {dat}" in last, last
    assert f"training state NOT saved to {tmp_path / 'models' / f'{PONG}_state.pt'}" in last, last
    assert dat.read_bytes() == b"previous checkpoint"
    assert not list((tmp_path / "models").glob(".*.tmp"))


def test_save_max_beats_the_score_on_disk_not_one_whose_save_failed(tmp_path, monkeypatch):
    """A best game whose save failed leaves the bar at the score of the weights in the file."""
    import test as test_process
    from player_util import GAME_OVER, STOPPED, GameResult

    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), "--save-max"]))
    ctx = ProcessContext.create(mp.get_context("spawn"))
    ctx.steps[0] = 10  # trained (the games of a fresh run's untrained weights save nothing)
    scores = iter([5.0, 3.0, 4.0, 2.0, 4.0])
    played: list[float] = []
    saved: list[float] = []

    def play_game(_player, _seed, _stall_steps, should_stop):
        score = next(scores, None)
        if score is None:
            ctx.request_stop()
            return GameResult(0.0, 0, STOPPED, 0)
        played.append(score)
        return GameResult(score, 100, GAME_OVER, 0)

    def save(_state, _path):
        if played[-1] == 5.0:
            raise OSError(28, "No space left on device")
        saved.append(played[-1])

    monkeypatch.setattr(test_process.GreedyPlayer, "play_game", play_game)
    monkeypatch.setattr(test_process, "save_atomic", save)
    begin = test_process.TestStart(
        launcher.config, launcher.spec, launcher.paths, str(tmp_path / "runs")
    )
    test_process.run_test(begin, launcher.shared_model, ctx)
    assert saved == [3.0, 4.0, 4.0]


@pytest.mark.parametrize("start", [FIRST_START, ProcessStart(5000, 0), ProcessStart(0, 2)])
def test_the_test_process_seeds_its_first_game_by_its_start(tmp_path, monkeypatch, start):
    """A fresh run's test process seeds torch and its first game with --seed; a resumed or
    restarted one with its own seeds; the games after the first go on unseeded."""
    import test as test_process
    from player_util import GAME_OVER, STOPPED, GameResult

    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), "--seed", "7"]))
    ctx = ProcessContext.create(mp.get_context("spawn"))
    seeds: list[tuple[int | None, int]] = []

    def play_game(_player, seed, _stall_steps, should_stop):
        seeds.append((seed, torch.initial_seed()))
        if len(seeds) == 2:
            ctx.request_stop()
            return GameResult(0.0, 0, STOPPED, 0)
        return GameResult(1.0, 100, GAME_OVER, 0)

    monkeypatch.setattr(test_process.GreedyPlayer, "play_game", play_game)
    monkeypatch.setattr(test_process, "save_atomic", lambda _state, _path: None)
    begin = test_process.TestStart(
        launcher.config, launcher.spec, launcher.paths, str(tmp_path / "runs"), start=start
    )
    test_process.run_test(begin, launcher.shared_model, ctx)
    torch_seed, game_seed = (7, 7) if start == FIRST_START else start.seeds(7, None, 2)
    assert seeds == [(game_seed, torch_seed), (None, torch_seed)]
    assert start == FIRST_START or 7 not in (torch_seed, game_seed)
    if launcher.monitor.writer is not None:
        launcher.monitor.writer.close()


@pytest.mark.parametrize("load", [False, True])
def test_the_test_games_of_a_fresh_runs_untrained_weights_save_nothing(tmp_path, monkeypatch, load):
    """Before a fresh run's first step its weights are random: a game of them must not
    replace the <env>.dat there (the shipped agent). Loaded weights are saved as ever."""
    import test as test_process
    from player_util import GAME_OVER, STOPPED, GameResult

    flags = [*PONG_SMALL, *folders(tmp_path)]
    if load:
        (tmp_path / "weights").mkdir()
        torch.save(
            A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(),
            tmp_path / "weights" / f"{PONG}.dat",
        )
        flags += ["--load", "--load-model-dir", str(tmp_path / "weights")]
    launcher = prepare(parse_train_args(flags))
    ctx = ProcessContext.create(mp.get_context("spawn"))
    games = iter([GameResult(-21.0, 100, GAME_OVER, 0)])
    monkeypatch.setattr(
        test_process.GreedyPlayer,
        "play_game",
        lambda *_args, **_kwargs: next(games, None) or GameResult(0.0, 0, STOPPED, 0),
    )
    begin = test_process.TestStart(
        launcher.config, launcher.spec, launcher.paths, str(tmp_path / "runs")
    )
    test_process.run_test(begin, launcher.shared_model, ctx)
    assert (tmp_path / "models" / f"{PONG}.dat").exists() == load


def test_a_save_max_run_writes_its_state_at_once_after_a_new_best(tmp_path, monkeypatch):
    """A resume takes the score to beat from the state: it must not lag the best .dat."""
    launcher = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path), "--save-max"]))
    launcher.ctx.steps[0] = 10  # trained (before its first step a run saves no state)
    game = {
        "reward": -20.0, "length": 100, "ending": "game over", "steps": 10, "frames": 40,
        "saved": True,
    }  # fmt: skip
    assert not launcher.state_due()
    launcher.monitor.take("test", {**game, "saved": False})  # its save failed
    assert not launcher.state_due()
    launcher.monitor.take("test", game)
    assert launcher.state_due()
    assert launcher.save_state() and not launcher.state_due()
    launcher.monitor.take("test", game)  # a tie: the file changes, its score does not
    assert not launcher.state_due()
    assert TrainingState.read_file(launcher.paths.state)["dat_score"] == -20.0
    # A state save that fails (a full disk) is tried again at the next --state-interval,
    # not at every poll.
    monkeypatch.setattr(TrainingState, "save", lambda *_: (_ for _ in ()).throw(OSError(28, "")))
    launcher.monitor.take("test", {**game, "reward": -19.0})
    assert launcher.state_due() and not launcher.save_state()
    assert not launcher.state_due()

    plain = prepare(parse_train_args([*PONG_SMALL, *folders(tmp_path / "plain")]))
    plain.monitor.take("test", game)
    assert not plain.state_due()  # every --state-interval only


def test_a_resumed_save_max_run_must_match_the_score_of_the_file_it_finds(tmp_path, caplog):
    """The score a game must match is that of the weights in <env>.dat, where it is known."""
    flags = [*PONG_SMALL, *folders(tmp_path)]
    load = ["--load", "--load-model-dir", str(tmp_path / "models"), "--save-max"]
    game = {"reward": 5.0, "length": 9, "ending": "game over", "steps": 1, "frames": 4}
    # A run without --save-max: its best game is not what its last .dat holds.
    plain = prepare(parse_train_args(flags))
    plain.monitor.take("test", {**game, "saved": True})
    plain.monitor.take("test", {**game, "reward": -3.0, "saved": True})
    plain.ctx.steps[0] = 1
    plain.shutdown()  # the final weights, no game's, go to <env>.dat
    assert TrainingState.load(plain.paths.state).dat_score is None
    with caplog.at_level("WARNING", logger="a3g.main"):
        resumed = prepare(parse_train_args([*flags, *load]))
    assert "its run saved it without --save-max" in caplog.text
    assert resumed.monitor.best == 5.0 and resumed.monitor.dat_score is None
    assert resumed.process_target(Child(None), resumed.ctx)[1][0].dat_score is None  # the bar
    # A --save-max run: its state keeps the score of the file, not the run's best game.
    resumed.monitor.take("test", {**game, "reward": -1.0, "saved": True})
    resumed.monitor.take("test", {**game, "reward": -2.0, "saved": False})
    resumed.shutdown()
    again = prepare(parse_train_args([*flags, *load]))
    assert again.monitor.dat_score == -1.0 and again.monitor.best == 5.0
    assert again.process_target(Child(None), again.ctx)[1][0].dat_score == -1.0
    # Resumed without --save-max: every test game will write over the best weights; said.
    caplog.clear()
    with caplog.at_level("WARNING", logger="a3g.main"):
        prepare(parse_train_args([*flags, *load[:-1]]))
    assert "holds the best test game's weights so far (a score of -1, --save-max)" in caplog.text
    # Loaded from that folder into another, whose .dat is not the one the score was of.
    elsewhere = prepare(
        parse_train_args([*PONG_SMALL, *folders(tmp_path / "new"), *load])
    )  # fmt: skip
    assert elsewhere.monitor.dat_score is None


# -- bad input, through the CLI: one line, exit 2, nothing overwritten -----------------------------


class RunsCode:
    """A pickled object that would create a file when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def bad_dat_files(folder: Path) -> dict[str, tuple[str, str]]:
    """Make each bad checkpoint in its own folder: name -> (folder, expected message)."""
    good = A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict()
    out = {}

    def place(name: str, write, message: str) -> None:
        sub = folder / name
        sub.mkdir(parents=True)
        write(sub / f"{PONG}.dat")
        out[name] = (str(sub), message)

    def truncated(path: Path) -> None:
        torch.save(good, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    place("truncated", truncated, "is truncated or not a PyTorch file")
    place("empty", lambda p: p.write_bytes(b""), "is empty; use an intact file")
    place("text", lambda p: p.write_text("weights\n"), "is not a PyTorch file (it begins b'we')")
    breakout = A3Clstm(1, gym.spaces.Discrete(4), 32).state_dict()
    place("other-game", lambda p: torch.save(breakout, p), "saved for a game with 4 actions")
    bigger = A3Clstm(1, gym.spaces.Discrete(6), 64).state_dict()
    place("other-hidden", lambda p: torch.save(bigger, p), "saved with --hidden-size 64")
    marker = folder / "code-ran"
    place(
        "pickled-object",
        lambda p: p.write_bytes(pickle.dumps({"x": RunsCode(marker)})),
        "holds pickled objects",
    )
    return out


@pytest.mark.slow
def test_bad_input_through_the_cli_is_one_line_exit_2_and_overwrites_nothing(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "models").mkdir()
    sentinel = tmp_path / "models" / f"{PONG}.dat"
    sentinel.write_bytes(b"keep me")
    bad_config = tmp_path / "bad.json"
    bad_config.write_text('{"Default": {"crop1": 34,')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases: list[tuple[list[str], str]] = [
        (["--workers", "-2"], "--workers must be at least 1, got -2"),
        (["--num-steps", "0"], "--num-steps must be at least 1, got 0"),
        (["--lr", "-0.1"], "--lr must be a positive number, got -0.1"),
        (["--gamma", "0"], "--gamma must be in (0, 1], got 0.0"),
        (["--tau", "1.01"], "--tau must be in (0, 1], got 1.01"),
        (["--optimizer", "SGD"], "invalid choice: 'SGD'"),
        (["--env", "../../etc/passwd"], "unknown env id '../../etc/passwd'"),
        (["--env", "/tmp/Pong"], "unknown env id '/tmp/Pong'"),
        (["--env", "Pongg"], "did you mean Pong-v4"),
        (["--save-model-dir", str(a_file / "sub")], "--save-model-dir"),
        (["--log-dir", str(a_file / "sub")], "--log-dir"),
        (["--env-config", str(bad_config)], str(bad_config)),
        (["--gpu-ids", "99"], "--gpu-ids"),  # no machine has a GPU 99 (7 is valid on 8)
    ]
    for folder, message in bad_dat_files(tmp_path / "dats").values():
        cases.append((["--hidden-size", "32", "--load", "--load-model-dir", folder], message))
    for flags, message in cases:
        base = ["--save-model-dir", str(tmp_path / "models"), "--log-dir", str(tmp_path / "logs")]
        # The real CLI for the first and for the pickled object, the rest in this process.
        real = flags is cases[0][0] or "pickled objects" in message
        code, stderr = main_here([*base, *flags], monkeypatch, capsys, real)
        lines = stderr.strip().splitlines()
        assert code == 2, (flags, stderr[-1500:])
        assert len(lines) == 1 and lines[0].startswith("main.py: error: "), (flags, lines)
        assert message in lines[0], (flags, lines[0])
    assert sentinel.read_bytes() == b"keep me"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [sentinel.name]
    assert not (tmp_path / "dats" / "code-ran").exists()  # the pickled object never ran


def test_tensorboard_that_cannot_write_is_turned_off_and_status_interval_0_spares_it(
    tmp_path, caplog
):
    config = parse_train_args(
        ["--env", PONG, "--workers", "1", "--tensorboard-logger", "--status-interval", "0",
         "--save-model-dir", str(tmp_path / "models"), "--log-dir", str(tmp_path / "logs")]
    )  # fmt: skip
    monitor = prepare(config).monitor
    monitor.open()
    written = []
    monitor.writer.add_histogram = lambda name, *a, **k: written.append(name)
    # No status lines: TensorBoard's figures still come, but every TENSORBOARD_SECONDS, not
    # at every 0.25-s poll (each writes a histogram of all 3.25M weights).
    monitor.last_tick = time.time() - 5
    monitor.tick()
    assert written == []
    monitor.last_tick = time.time() - TENSORBOARD_SECONDS - 1
    monitor.tick()
    assert len(written) == len(list(monitor.model.parameters()))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monitor.writer.add_scalar = full
    monitor.take("test", {"reward": 1.0, "length": 10, "frames": 100, "seconds": 1.0})
    assert monitor.writer is None and monitor.rewards == [1.0]  # the game still counts
    errors = [r.message for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert "the run goes on without it" in errors[0]
    monitor.tick(force=True)  # nothing more to write, nothing raised
    monitor.close("stopped", 0)
    assert json.loads(Path(monitor.record_path).read_text())["finished"]["exit_code"] == 0


def test_a_resumed_run_drops_tensorboard_events_past_the_frames_it_resumes_at(
    tmp_path, monkeypatch
):
    import torch.utils.tensorboard

    made = []

    class Writer:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def add_graph(self, *args):
            pass

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", Writer)
    config = parse_train_args(
        ["--env", PONG, "--workers", "1", "--tensorboard-logger",
         "--save-model-dir", str(tmp_path / "models"), "--log-dir", str(tmp_path / "logs")]
    )  # fmt: skip
    monitor = prepare(config).monitor
    monitor.ctx.steps[0] = 1500  # as if resumed at 1,500 steps (4 frames each)
    monitor.open(resumed_from=str(tmp_path / "models" / f"{PONG}_state.pt"))
    monitor.open()  # a new run purges nothing
    assert [m["purge_step"] for m in made] == [6000, None]


def test_a_run_started_in_the_same_second_as_another_gets_a_name_of_its_own(tmp_path, monkeypatch):
    """Two runs of one name in one --log-dir would be one run to the log's reader (the curve)
    and to the records (a resume's sittings): a fresh run takes a free name."""
    logs = tmp_path / "logs"
    paths = RunPaths.of(PONG, f"{logs}/", f"{tmp_path}/models/", f"{tmp_path}/models/", False)
    logs.mkdir()
    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt, *args: "20260101-000000")
    name = f"{PONG}_20260101-000000"
    assert run_folder.new_run_name(PONG, paths) == name  # nothing in the folder yet
    (paths.runs / name).mkdir(parents=True)  # its TensorBoard folder (--tensorboard-logger)
    assert run_folder.new_run_name(PONG, paths) == f"{name}-2"
    (paths.runs / name).rmdir()
    block = "2026-01-01 00:00:00,000 : tensorboard_dir: {}\n"
    paths.log.write_text(block.format(paths.runs / name))  # the log alone names it
    assert run_folder.new_run_name(PONG, paths) == f"{name}-2"
    paths.log.write_text(block.format(paths.runs / name) + block.format(f"elsewhere/{name}-2"))
    assert run_folder.new_run_name(PONG, paths) == f"{name}-3"  # by name, as the log is read
    paths.log.unlink()
    paths.record.write_text(json.dumps({"config": {"tensorboard_dir": str(paths.runs / name)}}))
    assert run_folder.new_run_name(PONG, paths) == f"{name}-2"  # the record alone names it
    for unfit in ("[1]", "{", '{"config": {"tensorboard_dir": 3}}'):  # set aside by the run
        paths.record.write_text(unfit)
        assert run_folder.new_run_name(PONG, paths) == name


def test_a_run_without_load_never_writes_over_an_earlier_runs_training_state(
    tmp_path, monkeypatch, capsys
):
    models = tmp_path / "models"
    models.mkdir()
    state = models / f"{PONG}_state.pt"
    state.write_bytes(b"a long run's state")  # refused before it is read
    (models / f"{PONG}.dat").write_bytes(b"its weights")
    result = run_cli(
        "main.py", "--env", PONG, "--save-model-dir", str(models), "--log-dir",
        str(tmp_path / "logs"), timeout=120,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-1500:]
    assert lines[0] == (
        f"main.py: error: {state} holds an earlier run's training state, which this run would "
        f"write over; add --load --load-model-dir {models} to continue that run, or give "
        "--save-model-dir another folder (or delete the file) to start afresh"
    )
    # --load-model-dir already names the folder: only --load is missing.
    flags = ["--env", PONG, *folders(tmp_path), "--load-model-dir", str(models)]
    code, err = main_here(flags, monkeypatch, capsys)
    assert code == 2 and "which this run would write over; add --load to continue" in err, err
    assert state.read_bytes() == b"a long run's state"
    assert (models / f"{PONG}.dat").read_bytes() == b"its weights"
    assert not (tmp_path / "logs").exists()  # nor a folder made


def test_a_load_from_another_folder_never_writes_over_the_save_folders_training_state(
    tmp_path, monkeypatch, capsys
):
    """--load reads --load-model-dir (trained_models/ by default), not --save-model-dir."""
    models = tmp_path / "models"
    models.mkdir()
    state = models / f"{PONG}_state.pt"
    state.write_bytes(b"a long run's state")
    other = tmp_path / "other"
    other.mkdir()
    torch.save(A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict(), other / f"{PONG}.dat")
    flags = [*folders(tmp_path), "--env", PONG, "--hidden-size", "32", "--load"]
    code, err = main_here([*flags, "--load-model-dir", str(other)], monkeypatch, capsys)
    assert code == 2 and err == (
        f"main.py: error: {state} holds an earlier run's training state, which this run would "
        f"write over; add --load-model-dir {models} to continue that run, or give "
        "--save-model-dir another folder (or delete the file) to start afresh\n"
    )
    assert state.read_bytes() == b"a long run's state"
    assert not (tmp_path / "logs").exists()


def test_a_refused_command_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
    for flags, message in (
        (["--env", "NoSuchGame-v4"], "NoSuchGame-v4"),
        (["--env", PONG, "--load", "--load-model-dir", str(tmp_path / "none")], "--load"),
        (["--env", PONG, "--env-config", str(tmp_path / "missing.json")], "missing.json"),
    ):
        code, err = main_here(
            [*folders(tmp_path), *flags, "--hidden-size", "32"], monkeypatch, capsys
        )
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
        assert sorted(p.name for p in tmp_path.iterdir()) == [], flags
    # The save folder passes, the log folder (a file) does not: the save folder goes too.
    (tmp_path / "a_file").write_text("")
    flags = ["--env", PONG, "--hidden-size", "32", "--save-model-dir", str(tmp_path / "m" / "n")]
    code, err = main_here([*flags, "--log-dir", str(tmp_path / "a_file")], monkeypatch, capsys)
    assert code == 2 and f"--log-dir {str(tmp_path / 'a_file')!r} is not writable" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_bad_training_state_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    good = A3Clstm(1, gym.spaces.Discrete(6), 32).state_dict()
    cases = {
        "truncated": (b"PK\x03\x04 half a file", "is truncated or not a PyTorch file"),
        "not-a-state": (None, "is not an A3G training-state file"),
        "other-env": (None, "is for --env BreakoutNoFrameskip-v4, not PongNoFrameskip-v4"),
        "other-optimizer": (None, "was saved with --optimizer RMSprop, this run has Adam"),
    }
    for name, (raw, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        torch.save(good, folder / f"{PONG}.dat")
        path = folder / f"{PONG}_state.pt"
        if raw is not None:
            path.write_bytes(raw)
        elif name == "not-a-state":
            torch.save(good, path)
        elif name == "other-env":
            torch.save({"format": 1, "config": {"env": "BreakoutNoFrameskip-v4"}}, path)
        else:
            statistics = {"state": {}, "param_groups": []}  # the refusal comes before them
            config = {"env": PONG, "optimizer": "RMSprop"}
            torch.save({"format": 1, "config": config, "optimizer": statistics}, path)
        code, err = main_here(
            ["--env", PONG, "--hidden-size", "32", "--load", "--load-model-dir", str(folder),
             *folders(tmp_path)], monkeypatch, capsys, through_cli=name == "truncated",
        )  # fmt: skip
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (name, err[-1500:])
        assert message in lines[0], (name, lines[0])
