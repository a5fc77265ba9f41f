"""config.json reading, logging, weight init and the gradient hand-off regression."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from shared_optim import SharedAdam
from tests.conftest import ROOT, requires_cuda
from utils import (
    ProcessContext,
    UsageError,
    child_process,
    ensure_shared_grads,
    env_config,
    env_file_stem,
    norm_col_init,
    read_config,
    save_atomic,
    setup_logger,
)

# -- config.json -------------------------------------------------------------------------------


def test_repository_config_has_the_original_entries(config):
    assert config["Pong"] == {"crop1": 34, "crop2": 34, "dimension2": 80}
    assert config["Asteroids"] == {"crop1": 16, "crop2": 34, "dimension2": 94}
    assert config["VideoPinball"] == {"crop1": 42, "crop2": 60, "dimension2": 89}
    assert len(config) == 12


def test_env_config_matches_substrings_else_default(config):
    assert env_config(config, "PongNoFrameskip-v4") is config["Pong"]
    assert env_config(config, "ALE/SpaceInvaders-v5") is config["SpaceInvaders"]
    assert env_config(config, "TennisNoFrameskip-v4") is config["Default"]
    # The last matching key in file order wins, as in the original.
    both = {"Default": config["Default"], "Pong": {"crop1": 1}, "NoFrameskip": {"crop1": 2}}
    assert env_config(both, "PongNoFrameskip-v4") == {"crop1": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"is not valid JSON \(line 1"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"Pong": {"crop1": 34, "crop2": 34, "dimension2": 80}}', 'no "Default" entry'),
        ('{"Default": {"crop1": 34, "crop2": 34}}', "needs an integer 'dimension2', got None"),
        ('{"Default": {"crop1": "34", "crop2": 34, "dimension2": 80}}', "integer 'crop1'"),
        ('{"Default": {"crop1": 200, "crop2": 0, "dimension2": 80}}', "which is empty"),
        ('{"Default": 5}', "entry 'Default' must be an object"),
    ],
)
def test_malformed_config_is_rejected_with_the_reason(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        read_config(path)


def test_missing_config_names_the_path_and_the_flag(tmp_path):
    with pytest.raises(UsageError, match=r"nope\.json' not found; pass --env-config"):
        read_config(tmp_path / "nope.json")


def test_config_round_trips_through_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(json.loads((ROOT / "config.json").read_text())))
    assert read_config(path) == read_config(ROOT / "config.json")


# -- logging -----------------------------------------------------------------------------------


def test_logger_writes_the_original_format_once(tmp_path):
    log_file = tmp_path / "logs" / "PongNoFrameskip-v4_log"
    setup_logger("a3g.test", log_file)
    log = setup_logger("a3g.test", log_file)  # twice: must not duplicate lines
    log.info("episode reward -21.0")
    for handler in log.handlers:
        handler.flush()
    lines = log_file.read_text().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} : episode reward -21.0", lines[0])


# -- init --------------------------------------------------------------------------------------


def test_norm_col_init_rescales_each_row():
    out = norm_col_init(torch.empty(7, 40), 0.25)
    torch.testing.assert_close(out.norm(dim=1), torch.full((7,), 0.25))


# -- gradient hand-off -------------------------------------------------------------------------


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))


def _backward(model: nn.Module, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)  # what torch 2.x optimizers and modules do by default
    (model(torch.randn(4, 5, generator=gen)) * torch.randn(4, 2, generator=gen)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_two_updates_in_a_row_hand_over_the_second_gradient():
    """Regression for the original's defect: the shared model kept the first gradient."""
    local, shared = _net(), _net()
    shared.share_memory()
    first = _backward(local, seed=1)
    ensure_shared_grads(local, shared)
    second = _backward(local, seed=2)
    ensure_shared_grads(local, shared)
    for shared_param, g1, g2 in zip(shared.parameters(), first, second, strict=True):
        assert not torch.equal(g1, g2)
        assert torch.equal(shared_param.grad, g2)


def test_hand_off_drives_the_shared_optimizer_like_a_local_one():
    local, shared, reference = _net(), _net(), _net()
    shared.share_memory()
    opt = SharedAdam(shared.parameters(), lr=1e-2)
    opt.share_memory()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-3, foreach=False)
    for seed in range(5):
        local.load_state_dict(shared.state_dict())
        _backward(local, seed)
        ensure_shared_grads(local, shared)
        opt.step()
        _backward(reference, seed)
        ref_opt.step()
    for p, q in zip(shared.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_missing_local_gradient_clears_the_shared_one():
    local, shared = _net(), _net()
    _backward(local, 1)
    ensure_shared_grads(local, shared)
    local.zero_grad(set_to_none=True)
    ensure_shared_grads(local, shared)
    assert all(p.grad is None for p in shared.parameters())


@requires_cuda
@pytest.mark.gpu
def test_hand_off_from_gpu_copies_every_update():
    local, shared = _net().cuda(), _net()
    first = _backward(local, 1)
    ensure_shared_grads(local, shared, gpu=True)
    buffers = [p.grad for p in shared.parameters()]
    second = _backward(local, 2)
    ensure_shared_grads(local, shared, gpu=True)
    for p, b, g1, g2 in zip(shared.parameters(), buffers, first, second, strict=True):
        assert p.grad.device.type == "cpu" and p.grad.is_pinned()
        assert p.grad is b  # the pinned CPU buffer is reused
        assert torch.equal(p.grad, g2.cpu()) and not torch.equal(p.grad, g1.cpu())


def test_logger_leaves_the_root_logger_alone(tmp_path):
    before = list(logging.getLogger().handlers)
    log = setup_logger("a3g.root_check", tmp_path / "x_log")
    assert logging.getLogger().handlers == before
    assert not log.propagate  # lines are not printed twice through the root logger


# -- child processes ---------------------------------------------------------------------------


def _failing_child(ctx: ProcessContext) -> None:
    with child_process("Train Agent: 7", ctx):
        raise RuntimeError("disk on fire")


def test_child_failure_reaches_the_launcher_as_one_line_and_exit_1():
    spawn = mp.get_context("spawn")
    ctx = ProcessContext.create(spawn)
    proc = spawn.Process(target=_failing_child, args=(ctx,))
    proc.start()
    title, cause, trace = ctx.errors.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 1
    assert title == "Train Agent: 7" and cause == "RuntimeError: disk on fire"
    assert "Traceback" in trace and "_failing_child" in trace


def test_step_counter_and_budget():
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=30)
    assert not ctx.should_stop()
    ctx.add_steps(20)
    assert ctx.total_steps() == 20 and not ctx.budget_reached()
    ctx.add_steps(10)
    assert ctx.budget_reached() and ctx.should_stop()
    unlimited = ProcessContext.create(mp.get_context("spawn"))
    unlimited.add_steps(10**9)
    assert not unlimited.should_stop()
    unlimited.stop_event.set()
    assert unlimited.should_stop()


def test_save_atomic_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "Pong.dat"
    save_atomic({"w": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(TypeError):
        save_atomic({"w": Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["Pong.dat"]  # no temporary file left


@pytest.mark.parametrize(
    ("env_id", "stem"),
    [("PongNoFrameskip-v4", "PongNoFrameskip-v4"), ("ALE/Pong-v5", "ALE_Pong-v5"),
     ("../../etc/passwd", "_.._etc_passwd")],
)  # fmt: skip
def test_env_ids_become_safe_file_names(env_id, stem):
    assert env_file_stem(env_id) == stem
    assert "/" not in env_file_stem(env_id)
