"""The run folder's plan as data: what a run would refuse, resume and warn of, before it writes."""

from __future__ import annotations

import ast
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run_folder
from checkpoint import TrainingState
from cli import as_dict, parse_train_args
from tests.conftest import PONG, PONG_FLAGS, ROOT, folders
from utils import UsageError


def config_of(tmp_path: Path, *flags: str):
    return parse_train_args([*PONG_FLAGS, *folders(tmp_path), *flags])


def saved_state(tmp_path: Path, **fields) -> Path:
    """A training state in ``models/`` as a run of `PONG_FLAGS` (and `fields`) would leave it."""
    (tmp_path / "models").mkdir(exist_ok=True)
    config = {**as_dict(config_of(tmp_path)), **fields.pop("config", {})}
    state = TrainingState(model={"w": torch.zeros(1)}, steps=1500, config=config, **fields)
    path = tmp_path / "models" / f"{PONG}_state.pt"
    state.save(path)
    return path


def test_a_fresh_runs_plan_writes_nothing_and_names_a_new_tensorboard_folder(tmp_path):
    plan = run_folder.plan(config_of(tmp_path))
    assert list(tmp_path.iterdir()) == []  # no folder made, no lock taken
    assert plan.state is None and plan.warnings == () and plan.earlier_logs is None
    assert Path(plan.tensorboard_dir).parent == tmp_path / "logs" / "runs"
    assert Path(plan.tensorboard_dir).name.startswith(f"{PONG}_")
    assert plan.folders == (
        (str(tmp_path / "models"), "--save-model-dir"), (str(tmp_path / "logs"), "--log-dir")
    )  # fmt: skip


def test_an_earlier_runs_state_without_load_is_refused_with_the_flags_that_resume_it(tmp_path):
    saved_state(tmp_path)
    models = tmp_path / "models"
    with pytest.raises(
        UsageError, match=f"earlier run's training state.*add --load --load-model-dir {models} to"
    ):
        run_folder.plan(config_of(tmp_path))
    other = ["--load", "--load-model-dir", str(tmp_path / "elsewhere")]
    with pytest.raises(UsageError, match=f"add --load-model-dir {tmp_path / 'models'} to"):
        run_folder.plan(config_of(tmp_path, *other))


def test_a_resume_plans_the_state_its_tensorboard_folder_and_the_known_score(tmp_path):
    saved_state(
        tmp_path, tensorboard_dir="/old/place/runs/Pong_1", dat_score=7.0,
        config={"save_max": True},
    )  # fmt: skip
    (tmp_path / "models" / f"{PONG}.dat").write_bytes(b"weights")
    plan = run_folder.plan(
        config_of(tmp_path, "--load", "--load-model-dir", str(tmp_path / "models"), "--save-max")
    )
    assert plan.state is not None and plan.state.steps == 1500
    assert plan.state.dat_score == 7.0  # the score of this folder's own .dat
    assert plan.tensorboard_dir == str(tmp_path / "logs" / "runs" / "Pong_1")
    assert plan.warnings == ()


def test_a_state_from_another_folder_forgets_the_score_of_a_dat_that_is_not_this_ones(tmp_path):
    saved_state(tmp_path, dat_score=7.0, config={"save_max": True})
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    flags = [*PONG_FLAGS, "--save-model-dir", str(tmp_path / "new"), "--log-dir", str(tmp_path)]
    plan = run_folder.plan(parse_train_args([*flags, *load, "--save-max"]))
    assert plan.state is not None and plan.state.dat_score is None


@pytest.mark.parametrize(
    ("fields", "flags", "message"),
    [
        ({"config": {"env": "BreakoutNoFrameskip-v4"}}, [], "is for --env Breakout"),
        ({}, ["--max-steps", "1500"], "at or past --max-steps 1500: give a larger"),
        ({}, ["--skip-rate", "3"], "frame skip of 4, this run has 3: resume with --skip-rate 4"),
        (
            {"optimizer": {"state": {}, "param_groups": []}, "config": {"amsgrad": True}},
            [], "saved with --amsgrad True, this run has False",
        ),
    ],
)  # fmt: skip
def test_a_state_that_does_not_fit_the_run_is_refused_by_the_plan(tmp_path, fields, flags, message):
    saved_state(tmp_path, **fields)
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    with pytest.raises(UsageError, match=message):
        run_folder.plan(config_of(tmp_path, *load, *flags))


def test_the_plan_warns_of_what_it_writes_over_and_of_a_best_score_not_known(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"{PONG}.dat").write_bytes(b"the shipped agent")
    (tmp_path / "models" / f"{PONG}_last.dat").write_bytes(b"an earlier run's end")
    (warning,) = run_folder.plan(config_of(tmp_path)).warnings
    assert "will write over it; --load with --load-model-dir" in warning
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    warnings = run_folder.plan(config_of(tmp_path, *load, "--save-max")).warnings
    assert len(warnings) == 2
    assert "_last.dat exists and this run will write over it at its end" in warnings[0]
    assert "is not known (no training state)" in warnings[1]


def test_a_resume_in_another_log_dir_warns_that_the_earlier_games_stay_there(tmp_path):
    saved_state(tmp_path, log_dir=str(tmp_path / "logs"))
    load = ["--load", "--load-model-dir", str(tmp_path / "models")]
    flags = [*PONG_FLAGS, "--save-model-dir", str(tmp_path / "models")]
    plan = run_folder.plan(parse_train_args([*flags, "--log-dir", str(tmp_path / "l2"), *load]))
    assert plan.earlier_logs == tmp_path / "logs"
    (warning,) = plan.warnings
    assert f"the earlier sittings logged to {tmp_path / 'logs'}" in warning


def test_a_folder_another_live_run_writes_is_refused_before_anything_else(tmp_path):
    saved_state(tmp_path)  # would be refused too, but the live run is what to say
    lock = tmp_path / "models" / f"{PONG}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "f.write('4242 on elsewhere'); f.flush(); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=r"being written by another run .*4242 on elsewhere"):
            run_folder.plan(config_of(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(UsageError, match="holds an earlier run's training state"):
        run_folder.plan(config_of(tmp_path))  # the lock went with its process
    fd = os.open(lock, os.O_RDONLY)  # and the plan took none
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_no_module_imports_itself_through_another():
    """The top-level modules' imports (lazy ones too) form no circle."""
    modules = {path.stem: path for path in ROOT.glob("*.py")}
    imports = {}
    for name, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text())
        for block in ast.walk(tree):  # imports for type checkers alone run never
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING":
                block.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        imports[name] = found & set(modules) - {name}

    def circle_from(start: str, path: list[str]) -> list[str] | None:
        for other in sorted(imports[path[-1]]):
            if other == start:
                return [*path, start]
            if other not in path and (circle := circle_from(start, [*path, other])):
                return circle
        return None

    circles = [circle for name in modules if (circle := circle_from(name, [name]))]
    assert not circles, " -> ".join(circles[0])
