"""Shared optimizers: step-for-step equal to torch.optim, and really shared across processes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from shared_optim import SharedAdam, SharedRMSprop, scheduled_lr, set_lr


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def set_grads(model: nn.Module, step: int) -> None:
    """Gradients of a loss that changes every step (deterministic in `step`)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=gen)
    target = torch.randn(8, 3, generator=gen)
    model.zero_grad(set_to_none=True)
    ((model(x) - target) ** 2).mean().backward()


CASES = [
    (SharedAdam, torch.optim.Adam, dict(lr=1e-2, eps=1e-3)),
    (SharedAdam, torch.optim.Adam, dict(lr=1e-2, eps=1e-3, amsgrad=True)),
    (SharedAdam, torch.optim.Adam, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-8)),
    (SharedRMSprop, torch.optim.RMSprop, dict(lr=1e-2, alpha=0.99, eps=0.1)),
    (SharedRMSprop, torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9, eps=1e-5, centered=True)),
]


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), CASES)
def test_same_parameters_as_torch_optim_step_after_step(ours, theirs, kwargs):
    a, b = small_net(), small_net()
    opt_a = ours(a.parameters(), **kwargs)
    opt_a.share_memory()
    opt_b = theirs(b.parameters(), foreach=False, **kwargs)
    for step in range(12):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(pa, pb), f"step {step}"
    assert any(
        not torch.equal(p, q) for p, q in zip(a.parameters(), small_net().parameters(), strict=True)
    )


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), CASES[:2] + CASES[3:4])
def test_close_to_torch_default_foreach_path(ours, theirs, kwargs):
    a, b = small_net(), small_net()
    opt_a, opt_b = ours(a.parameters(), **kwargs), theirs(b.parameters(), **kwargs)
    for step in range(12):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)


def test_defaults_are_the_originals():
    params = list(small_net().parameters())
    adam = SharedAdam(params).defaults
    assert adam["lr"] == 1e-3 and adam["eps"] == 1e-3 and adam["betas"] == (0.9, 0.999)
    assert adam["amsgrad"] is False
    rms = SharedRMSprop(params).defaults
    assert rms["lr"] == 7e-4 and rms["eps"] == 0.1 and rms["alpha"] == 0.99
    assert rms["centered"] is False


def test_state_exists_up_front_and_moves_to_shared_memory():
    net = small_net()
    opt = SharedAdam(net.parameters(), amsgrad=True)
    for p in net.parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert state["step"].item() == 0
        assert not state["exp_avg"].is_shared()
    opt.share_memory()
    assert all(v.is_shared() for s in opt.state.values() for v in s.values())


def test_state_dict_round_trip_stays_shared():
    net = small_net()
    opt = SharedAdam(net.parameters())
    opt.share_memory()
    set_grads(net, 0)
    opt.step()
    saved = opt.state_dict()
    fresh_net = small_net()
    fresh = SharedAdam(fresh_net.parameters())
    fresh.share_memory()
    fresh.load_state_dict(saved)
    for p in fresh_net.parameters():
        assert fresh.state[p]["step"].item() == 1
        assert all(v.is_shared() for v in fresh.state[p].values())


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), [CASES[0], CASES[3]])
def test_loaded_statistics_keep_the_new_learning_rate(ours, theirs, kwargs):
    """Resuming with another lr: statistics from the file, lr (and the rest) from the caller."""
    a, b = small_net(), small_net()
    opt_a = ours(a.parameters(), **kwargs)
    opt_b = theirs(b.parameters(), foreach=False, **kwargs)
    for step in range(3):
        for net, opt in ((a, opt_a), (b, opt_b)):
            set_grads(net, step)
            opt.step()
    saved = opt_a.state_dict()

    resumed_net = small_net()
    resumed_net.load_state_dict(a.state_dict())
    new_lr = kwargs["lr"] / 10
    resumed = ours(resumed_net.parameters(), **{**kwargs, "lr": new_lr})
    resumed.share_memory()
    changed = resumed.load_statistics(saved)
    assert changed == {"lr": (kwargs["lr"], new_lr)}
    assert resumed.param_groups[0]["lr"] == new_lr
    assert all(v.is_shared() for s in resumed.state.values() for v in s.values())
    for p in resumed_net.parameters():
        assert resumed.state[p]["step"].item() == 3

    # The next step is torch's step with the statistics so far and the new lr.
    opt_b.param_groups[0]["lr"] = new_lr
    set_grads(resumed_net, 3)
    set_grads(b, 3)
    resumed.step()
    opt_b.step()
    for pa, pb in zip(resumed_net.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_loading_statistics_with_the_same_settings_reports_no_change():
    net = small_net()
    opt = SharedAdam(net.parameters(), lr=1e-4, amsgrad=True)
    saved = opt.state_dict()
    saved["param_groups"][0]["betas"] = list(saved["param_groups"][0]["betas"])
    assert SharedAdam(small_net().parameters(), lr=1e-4, amsgrad=True).load_statistics(saved) == {}


# -- the learning-rate schedule -----------------------------------------------------------------


def test_linear_schedule_falls_from_lr_to_zero_at_the_budget_and_stays():
    lr = 4e-4
    assert scheduled_lr(lr, "linear", 0, 1000) == lr
    assert scheduled_lr(lr, "linear", 250, 1000) == pytest.approx(3e-4)
    assert scheduled_lr(lr, "linear", 500, 1000) == pytest.approx(2e-4)
    assert scheduled_lr(lr, "linear", 1000, 1000) == 0.0
    assert scheduled_lr(lr, "linear", 1300, 1000) == 0.0  # the last rollouts overshoot
    assert [scheduled_lr(lr, "constant", s, m) for s, m in ((0, 0), (900, 1000))] == [lr, lr]


def test_schedule_misuse_is_an_error():
    with pytest.raises(ValueError, match="needs a step budget"):
        scheduled_lr(1e-3, "linear", 10, 0)
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'cosine'"):
        scheduled_lr(1e-3, "cosine", 10, 100)


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), [CASES[0], CASES[3]])
def test_set_lr_steps_as_an_optimizer_made_with_that_lr(ours, theirs, kwargs):
    """Changing the lr between steps matches torch.optim stepped with the same lrs, and leaves
    the statistics in shared memory."""
    a, b = small_net(), small_net()
    opt_a, opt_b = ours(a.parameters(), **kwargs), theirs(b.parameters(), **kwargs)
    opt_a.share_memory()
    for step, lr in enumerate((kwargs["lr"], kwargs["lr"] / 2, 0.0)):
        set_lr(opt_a, lr)
        for group in opt_b.param_groups:
            group["lr"] = lr
        set_grads(a, step)
        set_grads(b, step)
        before = [p.clone() for p in a.parameters()]
        opt_a.step()
        opt_b.step()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before, strict=True))  # lr 0
    assert all(v.is_shared() for s in opt_a.state.values() for v in s.values())


# -- across processes --------------------------------------------------------------------------


def _step_in_child(net: nn.Module, opt: SharedAdam, step: int) -> None:
    torch.set_num_threads(1)
    set_grads(net, step)
    opt.step()


def test_updates_from_two_processes_share_params_and_statistics():
    """Process A steps, then process B: B must see A's moments and step count."""
    shared = small_net()
    shared.share_memory()
    opt = SharedAdam(shared.parameters(), lr=1e-2, amsgrad=True)
    opt.share_memory()
    ctx = mp.get_context("spawn")
    for step in range(2):
        proc = ctx.Process(target=_step_in_child, args=(shared, opt, step))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0

    reference = small_net()
    ref_opt = torch.optim.Adam(
        reference.parameters(), lr=1e-2, eps=1e-3, amsgrad=True, foreach=False
    )
    for step in range(2):
        set_grads(reference, step)
        ref_opt.step()
    for p, q in zip(shared.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert opt.state[p]["step"].item() == 2


def _step_many(net: nn.Module, opt: SharedAdam, slot: int, steps: int, ready, go) -> None:
    torch.set_num_threads(1)
    opt.use_slot(slot)
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.01)
    with ready.get_lock():
        ready.value += 1
    while not go.value:  # start together, so the two really step at the same time
        time.sleep(0.001)
    for _ in range(steps):
        opt.step()


def test_two_processes_stepping_at_once_lose_no_step():
    # One shared `step += 1` lost ~10 of 40,000 counts this way; slots lose none.
    shared = nn.Linear(2, 2)
    shared.share_memory()
    opt = SharedAdam(shared.parameters(), lr=1e-4, slots=2)
    opt.share_memory()
    ctx = mp.get_context("spawn")
    ready, go = ctx.Value("i", 0), ctx.RawValue("b", 0)
    procs = [
        ctx.Process(target=_step_many, args=(shared, opt, slot, 20_000, ready, go))
        for slot in (0, 1)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 120
    while ready.value < 2 and time.monotonic() < deadline:  # both imported torch and set up
        time.sleep(0.01)
    go.value = 1
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    assert opt.steps_taken() == 40_000 and opt.step_counts.tolist() == [20_000, 20_000]
    saved = opt.state_dict()
    assert {entry["step"].item() for entry in saved["state"].values()} == {40_000}
    assert all(torch.isfinite(p).all() for p in shared.parameters())

    resumed = SharedAdam(nn.Linear(2, 2).parameters(), lr=1e-4, slots=2)
    resumed.share_memory()
    resumed.load_state_dict(saved)
    assert resumed.steps_taken() == 40_000 and resumed.step_counts.is_shared()
    with pytest.raises(ValueError, match="expected slot in 0..1, got 2"):
        resumed.use_slot(2)


@pytest.mark.parametrize("make", [SharedAdam, SharedRMSprop])
def test_a_saved_step_count_past_float32s_exact_range_comes_back_exact(make, tmp_path):
    opt = make(nn.Linear(2, 2).parameters(), slots=2)
    opt.step_counts[:] = torch.tensor([2**24, 2**24 + 1], dtype=torch.float64)  # 2**25 + 1
    torch.save(opt.state_dict(), tmp_path / "state.pt")
    resumed = make(nn.Linear(2, 2).parameters(), slots=2)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.steps_taken() == 2**25 + 1  # float32 would give 2**25
