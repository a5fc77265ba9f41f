"""The worker: the A3C loss by hand, step sizes, same-seed determinism, the gradient hand-off."""

from __future__ import annotations

from dataclasses import replace

import gymnasium as gym
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from environment import EnvSpec, make_env
from fast_path import sequence_from_features
from model import build_model
from player_util import Rollout
from shared_optim import SharedAdam, make_optimizer
from tests.conftest import ROOT, make_args, requires_cuda
from train import (
    a3c_loss,
    discounted_targets,
    ensure_shared_grads,
    pin_shared_memory,
    run_worker,
    step_size_for,
    sync_weights,
    unpin_shared_memory,
    worker_seeds,
)
from utils import FIRST_START, ProcessContext, ProcessStart


def loss_rollout(values, log_probs, entropies, rewards, bootstrap, took=None) -> Rollout:
    """A `Rollout` of hand-made (T, K) tensors for the loss (flags other than `took` unused)."""
    took = torch.ones_like(values, dtype=torch.bool) if took is None else took
    flags = torch.zeros_like(took)
    return Rollout(
        values=values, log_probs=log_probs, entropies=entropies, rewards=rewards, took=took,
        terminated=flags, truncated=flags, bootstrap=bootstrap,
    )  # fmt: skip


def rollout_tensors():
    """The hand-worked rollout: 3 steps of one env, leaves with grad, shape (3, 1)."""
    values = torch.tensor([[0.5], [0.2], [-0.3]], requires_grad=True)
    log_probs = torch.tensor([[-0.1], [-0.2], [-0.3]], requires_grad=True)
    entropies = torch.tensor([[0.6], [0.5], [0.4]], requires_grad=True)
    return values, log_probs, entropies, torch.tensor([[1.0], [0.0], [-1.0]])


def test_loss_matches_a_rollout_worked_by_hand():
    """gamma 0.9, tau 0.5, entropy 0.1, bootstrap 0.4 (worked out in the comments)."""
    values, log_probs, entropies, rewards = rollout_tensors()
    rollout = loss_rollout(values, log_probs, entropies, rewards, torch.tensor([0.4]))
    terms = a3c_loss(rollout, gamma=0.9, tau=0.5, entropy_coef=0.1, value_coef=0.5)
    # Backwards: R = -0.64, -0.576, 0.4816; advantages -0.34, -0.776, -0.0184
    # value loss = 0.5 * (0.34^2 + 0.776^2 + 0.0184^2) = 0.35905728
    # deltas -0.34, -0.47, 0.68; gae -0.34, -0.623, 0.39965
    # policy loss = -(sum log_prob * gae) - 0.1 * (0.6 + 0.5 + 0.4) = -0.336635
    assert terms.value_loss.item() == pytest.approx(0.35905728, abs=1e-6)
    assert terms.policy_loss.item() == pytest.approx(-0.336635, abs=1e-6)
    assert terms.total.item() == pytest.approx(-0.336635 + 0.5 * 0.35905728, abs=1e-6)
    assert terms.entropy.item() == pytest.approx(0.5, abs=1e-6)
    terms.total.backward()
    # d total / d log_prob_i = -gae_i; d total / d V_i = -value_coef * advantage_i
    for got, gae in zip(log_probs.grad.view(-1).tolist(), (0.39965, -0.623, -0.34), strict=True):
        assert got == pytest.approx(-gae, abs=1e-6)
    for got, adv in zip(values.grad.view(-1).tolist(), (-0.0184, -0.776, -0.34), strict=True):
        assert got == pytest.approx(-0.5 * adv, abs=1e-6)
    assert entropies.grad.view(-1).tolist() == pytest.approx([-0.1] * 3)


def test_the_returns_scan_is_float32_and_bit_for_bit_the_torch_scan():
    """The numpy scan against the torch ops it replaced, whatever type gamma and tau have."""
    import numpy as np

    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(20, 8, generator=generator)
    values = torch.randn(20, 8, generator=generator)
    bootstrap = torch.randn(8, generator=generator)
    took = torch.rand(20, 8, generator=generator) > 0.2
    gamma, tau = 0.99, 0.95
    ret, next_value, gae = bootstrap, bootstrap, torch.zeros(8)
    want_returns, want_advantages = torch.empty(20, 8), torch.empty(20, 8)
    for t in reversed(range(20)):  # the torch scan, step for step
        ret = torch.where(took[t], gamma * ret + rewards[t], ret)
        delta = rewards[t] + gamma * next_value - values[t]
        gae = torch.where(took[t], gae * gamma * tau + delta, gae)
        next_value = torch.where(took[t], values[t], next_value)
        want_returns[t], want_advantages[t] = ret, gae
    for discount, lam in ((gamma, tau), (np.float64(gamma), np.float64(tau))):
        returns, advantages = discounted_targets(rewards, values, bootstrap, took, discount, lam)
        assert returns.dtype == advantages.dtype == torch.float32
        assert torch.equal(returns, want_returns) and torch.equal(advantages, want_advantages)


def test_rows_of_steps_not_taken_reach_neither_loss_nor_gradients_even_as_nan():
    # Two envs; env 1 stopped after step 0. Its rows of steps 1-2 hold NaN (what a broken
    # frame could give a waiting env's row): 0 * NaN would be NaN.
    nan = float("nan")

    def columns(first, second):
        pairs = enumerate(zip(first, second, strict=True))
        return torch.tensor([[a, b if t == 0 else nan] for t, (a, b) in pairs], requires_grad=True)

    values = columns((0.5, 0.2, -0.3), (0.1, 0.0, 0.0))
    log_probs = columns((-0.1, -0.2, -0.3), (-0.7, 0.0, 0.0))
    entropies = columns((0.6, 0.5, 0.4), (0.9, 0.0, 0.0))
    rewards = torch.tensor([[1.0, 0.5], [0.0, nan], [-1.0, nan]])
    took = torch.tensor([[True, True], [True, False], [True, False]])
    rollout = loss_rollout(values, log_probs, entropies, rewards, torch.tensor([0.4, 0.0]), took)
    terms = a3c_loss(rollout, gamma=0.9, tau=0.5, entropy_coef=0.1, value_coef=0.5)
    terms.total.backward()
    # Env 0 is the hand-worked rollout above; env 1 a one-step episode: R = 0.5, adv 0.4.
    assert terms.value_loss.item() == pytest.approx(0.35905728 + 0.5 * 0.4**2, abs=1e-6)
    assert terms.policy_loss.item() == pytest.approx(-0.336635 + 0.7 * 0.4 - 0.09, abs=1e-6)
    for leaf in (values, log_probs, entropies):
        assert torch.isfinite(leaf.grad).all()
        assert leaf.grad[1:, 1].eq(0).all()  # env 1 did not take steps 1 and 2
    assert log_probs.grad[0, 1].item() == pytest.approx(-0.4, abs=1e-6)


def test_value_coef_is_really_used():
    totals = {}
    for coef in (0.0, 0.5, 2.0):
        rollout = loss_rollout(*rollout_tensors(), torch.zeros(1))
        terms = a3c_loss(rollout, gamma=0.9, tau=0.5, entropy_coef=0.1, value_coef=coef)
        totals[coef] = terms.total.item()
    assert totals[0.5] - totals[0.0] == pytest.approx(0.25 * (totals[2.0] - totals[0.0]))
    assert totals[2.0] != totals[0.0]


def test_terminal_rollout_bootstraps_from_zero():
    values, log_probs, entropies, _ = rollout_tensors()
    rollout = loss_rollout(
        values[:1], log_probs[:1], entropies[:1], torch.tensor([[1.0]]), torch.zeros(1)
    )
    terms = a3c_loss(rollout, gamma=1.0, tau=1.0, entropy_coef=0.0, value_coef=0.5)
    assert terms.value_loss.item() == pytest.approx(0.5 * (1.0 - 0.5) ** 2)


def test_distributed_step_sizes_are_dealt_round_robin():
    assert [step_size_for(rank, 20, [16, 32, 64]) for rank in range(5)] == [16, 32, 64, 16, 32]
    assert step_size_for(3, 7, []) == 7


# -- the real worker loop ----------------------------------------------------------------------


def shared_model_for(args) -> torch.nn.Module:
    """The shared-memory CPU model for `args`' env, as main.py builds it."""
    env = make_env(EnvSpec.of(args))
    shared = build_model(env.observation_space, env.action_space, args.hidden_size)
    env.close()
    return shared.share_memory()


def shared_cartpole_model() -> torch.nn.Module:
    return shared_model_for(
        make_args(env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"))
    )


def worker_losses(
    args, updates: int, start: ProcessStart = FIRST_START
) -> tuple[list[float], torch.nn.Module]:
    shared = untouched_model(args)
    optimizer = make_optimizer(shared.parameters(), args.optimizer, args.lr, args.amsgrad)
    optimizer.share_memory()
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=updates * args.num_steps)
    losses: list[float] = []
    run_worker(
        0, args, EnvSpec.of(args), shared, optimizer, ctx,
        on_update=lambda terms: losses.append(terms.total.item()), start=start,
    )  # fmt: skip
    return losses, shared


def untouched_model(args) -> torch.nn.Module:
    """The shared model `worker_losses` starts from (the same seed), before any update."""
    torch.manual_seed(args.seed)
    return shared_model_for(args)


def every_parameter_changed(shared: torch.nn.Module, args) -> bool:
    """Whether the updates reached every parameter of the shared model."""
    pairs = zip(shared.parameters(), untouched_model(args).parameters(), strict=True)
    return all(not torch.equal(p, q) for p, q in pairs)


def test_same_seed_gives_identical_losses_on_pong():
    args = make_args(
        env="PongNoFrameskip-v4", hidden_size=32, num_steps=10, env_config=str(ROOT / "config.json")
    )
    first, _ = worker_losses(args, updates=4)
    second, _ = worker_losses(args, updates=4)
    assert len(first) == 4
    assert first == second
    other, _ = worker_losses(replace(args, seed=2), updates=4)
    assert other != first
    # A resumed sitting's worker (same weights, same --seed) plays other games, and the same
    # state resumed again plays the same ones.
    resumed, _ = worker_losses(args, updates=4, start=ProcessStart(resumed_steps=4000))
    assert resumed != first
    assert worker_losses(args, updates=4, start=ProcessStart(resumed_steps=4000))[0] == resumed


def test_worker_seeds_are_the_originals_at_first_and_new_at_every_later_start():
    assert worker_seeds(7, 2, workers=3, envs=1, start=FIRST_START) == (9, [9])  # seed + rank
    assert worker_seeds(7, 2, workers=3, envs=4, start=FIRST_START) == (9, [9, 12, 15, 18])
    # Every env of a 3 x 4 run its own seed, and each later start (a restart, a resumed
    # sitting, both) seeds every process anew: no seed of one start is another's.
    starts = [FIRST_START, ProcessStart(0, 1), ProcessStart(0, 2), ProcessStart(5000, 0)]
    starts.append(ProcessStart(5000, 1))
    drawn = [worker_seeds(7, rank, 3, 4, start) for start in starts for rank in range(3)]
    env_seeds = [seed for _, seeds in drawn for seed in seeds]
    assert len(set(env_seeds)) == len(env_seeds) == 5 * 3 * 4
    assert len({torch_seed for torch_seed, _ in drawn}) == 5 * 3
    assert all(0 <= seed < 2**32 for seed in env_seeds)
    # Drawn from the seed, the process and the start alone: the same state resumed again, or
    # the same run started again, seeds alike; another --seed seeds otherwise.
    assert worker_seeds(7, 1, 3, 4, ProcessStart(5000, 0)) == drawn[3 * 3 + 1]
    assert worker_seeds(8, 1, 3, 4, ProcessStart(5000, 0)) != drawn[3 * 3 + 1]
    assert ProcessStart(5000, 0).seeds(7, None, 2) != ProcessStart(5000, 0).seeds(7, 0, 2)


def test_worker_changes_the_shared_model():
    args = make_args(env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"))
    _, shared = worker_losses(args, updates=3)
    assert every_parameter_changed(shared, args)


def test_worker_with_its_own_optimizer():
    args = make_args(env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"))
    torch.manual_seed(args.seed)
    env = make_env(EnvSpec.of(args))
    shared = build_model(env.observation_space, env.action_space, args.hidden_size)
    before = [p.clone() for p in shared.parameters()]
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=60)
    run_worker(0, args, EnvSpec.of(args), shared, None, ctx)
    assert ctx.total_steps() >= 60
    assert any(not torch.equal(p, q) for p, q in zip(shared.parameters(), before, strict=True))


def test_a_worker_that_fails_in_process_closes_its_envs(monkeypatch):
    import train

    made, closed = [], []

    def make_and_keep(*args, **kwargs):
        env = make_env(*args, **kwargs)
        close = env.close
        env.close = lambda: (closed.append(env), close())
        made.append(env)
        return env

    monkeypatch.setattr(train, "make_env", make_and_keep)
    args = make_args(
        env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"), envs_per_worker=2
    )
    env = make_env(EnvSpec.of(args))
    shared = build_model(env.observation_space, env.action_space, args.hidden_size)
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=1000)

    def fail(_terms):
        raise ValueError("a caller's hook failed")

    with pytest.raises(ValueError, match="hook failed"):
        run_worker(0, args, EnvSpec.of(args), shared, None, ctx, on_update=fail)
    assert len(made) == 2 and closed == made[::-1]  # each closed once, last made first
    # A failure while setting up (here building the worker's model) closes the envs made.
    made.clear(), closed.clear()

    def no_model(*args, **kwargs):
        raise MemoryError("no room for the model")

    monkeypatch.setattr(train, "build_model", no_model)
    with pytest.raises(MemoryError):
        run_worker(0, args, EnvSpec.of(args), shared, None, ctx)
    assert len(made) == 2 and closed == made[::-1]


def test_a_random_skip_reaches_every_env_a_run_and_an_evaluation_build(monkeypatch, tmp_path):
    """--skip-rate-min reaches the workers' envs, the test process's and gym_eval's."""
    import test as test_process
    import train
    from checkpoint import RunPaths
    from cli import parse_eval_args, parse_train_args

    made: list = []

    def make_and_keep(*args, **kwargs):
        env = make_env(*args, **kwargs)
        made.append(env)
        return env

    class BuiltError(Exception):
        """Stops the test process once its env is built."""

    def make_and_stop(*args, **kwargs):
        make_and_keep(*args, **kwargs)
        raise BuiltError

    def skips(env) -> tuple[int, int]:
        return env.get_wrapper_attr("skip_low"), env.get_wrapper_attr("skip")

    flags = ["--skip-rate-min", "2", "--hidden-size", "16", "--envs-per-worker", "2"]
    args = parse_train_args([*flags, "--log-dir", str(tmp_path)])
    monkeypatch.setattr(train, "make_env", make_and_keep)
    shared = build_model(*spaces_of(args), args.hidden_size)
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=1000)

    def stop(_terms):
        raise StopIteration

    with pytest.raises(StopIteration):
        run_worker(0, args, EnvSpec.of(args), shared, None, ctx, on_update=stop)
    assert [skips(env) for env in made] == [(2, 4), (2, 4)]

    made.clear()
    monkeypatch.setattr(test_process, "make_env", make_and_stop)
    paths = RunPaths.of(args.env, str(tmp_path), str(tmp_path), str(tmp_path), False)
    with pytest.raises(BuiltError):
        begin = test_process.TestStart(args, EnvSpec.of(args), paths, "run")
        test_process.run_test(begin, shared, ctx)
    assert [skips(env) for env in made] == [(2, 4)]

    evaluated = make_env(EnvSpec.of(parse_eval_args(["--skip-rate-min", "3"])))
    assert skips(evaluated) == (3, 4)


def spaces_of(args) -> tuple[gym.Space, gym.Space]:
    """The observation and action spaces of `args`'s env."""
    env = make_env(EnvSpec.of(args))
    env.close()
    return env.observation_space, env.action_space


@pytest.mark.parametrize(("schedule", "last_lr"), [("constant", 1e-3), ("linear", 0.0)])
def test_worker_follows_the_lr_schedule_down_to_the_budget(schedule, last_lr):
    """The last update of a run comes at the step budget: the linear schedule has reached 0
    there, and the one before it was on the line between --lr and 0."""
    args = make_args(
        env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"), lr=1e-3,
        lr_schedule=schedule, max_steps=100,
    )  # fmt: skip
    env = make_env(EnvSpec.of(args))
    shared = build_model(env.observation_space, env.action_space, args.hidden_size)
    env.close()
    optimizer = make_optimizer(shared.parameters(), args.optimizer, args.lr, args.amsgrad)
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=args.max_steps)
    lrs: list[float] = []
    run_worker(
        0, args, EnvSpec.of(args), shared, optimizer, ctx,
        on_update=lambda _: lrs.append(optimizer.param_groups[0]["lr"]),
    )  # fmt: skip
    assert len(lrs) >= 5 and lrs[-1] == last_lr
    if schedule == "linear":
        assert 0 < lrs[-2] < lrs[0] < 1e-3 and lrs == sorted(lrs, reverse=True)


@requires_cuda
@pytest.mark.gpu
def test_gpu_worker_updates_the_cpu_shared_model():
    args = make_args(
        env="CartPole-v1", hidden_size=16, gpu_ids=[0], env_config=str(ROOT / "config.json")
    )
    losses, shared = worker_losses(args, updates=3)
    assert len(losses) >= 3 and all(torch.isfinite(torch.tensor(losses)))
    assert all(p.device.type == "cpu" for p in shared.parameters())
    assert every_parameter_changed(shared, args)  # the gradients came back from the GPU


def test_pinning_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pin_shared_memory(shared_cartpole_model(), torch.device("cpu")) == []
    unpin_shared_memory([])  # nothing registered: nothing to undo, no CUDA call


@requires_cuda
@pytest.mark.gpu
def test_a_refused_pinning_leaves_no_error_behind_and_unpinning_releases():
    shared, device = shared_cartpole_model(), torch.device("cuda", 0)
    storages = {t.untyped_storage().data_ptr() for t in shared.state_dict().values()}
    pinned = pin_shared_memory(shared, device)
    assert sorted(pinned) == sorted(storages)
    # A second registration of the same pages is refused by CUDA: nothing is registered and
    # the refusal must not surface as the next kernel's error.
    assert pin_shared_memory(shared, device) == []
    assert torch.zeros((), device=device).item() == 0.0
    unpin_shared_memory(pinned)
    again = pin_shared_memory(shared, device)  # released: the same pages register again
    assert sorted(again) == sorted(storages)
    unpin_shared_memory(again)


# -- fast path against the reference path ------------------------------------------------------


def pong_rollout_grads(
    fast: bool, steps: int = 12, bf16: bool = False, channels_last: bool | None = None
) -> tuple[float, list[torch.Tensor], list[int]]:
    """One rollout from a fixed seed: loss, gradients and the actions taken.

    `channels_last` defaults to the CPU worker's choice: with the fast path.
    """
    from player_util import Agent

    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)
    env = make_env(EnvSpec.of(args))
    torch.manual_seed(0)
    model = build_model(env.observation_space, env.action_space, args.hidden_size)
    if fast if channels_last is None else channels_last:
        model.use_channels_last()
    agent = Agent(model, [env], fast_path=fast, bf16=bf16)
    agent.reset(seeds=[3])
    agent.start_rollout()
    agent.play_rollout(30)  # get into the game, with a non-zero LSTM state
    agent.start_rollout()
    torch.manual_seed(42)
    agent.play_rollout(steps)
    actions = agent.record["actions"][:, 0].tolist()
    terms = a3c_loss(agent.rollout(), args.gamma, args.tau, args.entropy_coef, args.value_coef)
    model.zero_grad(set_to_none=True)
    terms.total.backward()
    return terms.total.item(), [p.grad.clone() for p in model.parameters()], actions


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_fast_path_gives_the_reference_loss_and_gradients(channels_last):
    # NCHW is the layout an fp32 GPU worker keeps (`channels_last_suits`).
    ref_loss, ref_grads, _ = pong_rollout_grads(fast=False)
    fast_loss, fast_grads, actions = pong_rollout_grads(fast=True, channels_last=channels_last)
    assert len(actions) == 12
    assert fast_loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    for ref, fast in zip(ref_grads, fast_grads, strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-3, atol=1e-5)


def test_the_default_worker_computes_the_originals_losses_on_pong():
    # The defaults (one env, fp32, the fast path) against the original's computation
    # (--no-fast-path): same seeds, so the same games and losses, update after update.
    args = make_args(
        env="PongNoFrameskip-v4", hidden_size=32, num_steps=10, env_config=str(ROOT / "config.json")
    )
    assert (args.envs_per_worker, args.precision, args.fast_path) == (1, "fp32", True)
    reference, reference_shared = worker_losses(replace(args, fast_path=False), updates=4)
    fast, shared = worker_losses(args, updates=4)
    assert len(fast) == 4
    assert fast == pytest.approx(reference, rel=1e-4, abs=1e-5)
    for p, q in zip(shared.parameters(), reference_shared.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)  # after 4 Adam steps


def test_fused_lstm_sequence_matches_step_by_step_forward():
    import gymnasium as gym

    for obs_space in (
        gym.spaces.Box(-1, 1, (1, 80, 80)),
        gym.spaces.Box(-1, 1, (4,)),
    ):
        torch.manual_seed(0)
        model = build_model(obs_space, gym.spaces.Discrete(3), 16)
        x = torch.randn(7, *obs_space.shape)
        hx, cx = torch.randn(1, 16), torch.randn(1, 16)
        values, logits = sequence_from_features(model, model.encode(x), hx, cx)
        h, c = hx, cx
        for t in range(7):
            v, lg, h, c = model(x[t : t + 1], h, c)
            torch.testing.assert_close(values[t : t + 1], v, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(logits[t : t + 1], lg, rtol=1e-5, atol=1e-6)


# -- the gradient hand-off ------------------------------------------------------------------------


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))


def _backward(model: nn.Module, seed: int) -> list[torch.Tensor]:
    """Backward on made-up data, built on the model's device; returns the gradients."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    inputs, weights = torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)
    model.zero_grad(set_to_none=True)  # what torch 2.x optimizers and modules do by default
    (model(inputs.to(device)) * weights.to(device)).sum().backward()
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


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.gpu])],
)
def test_copying_hand_off_reuses_its_buffers_and_never_aliases(device):
    local, shared = _net().to(device), _net()
    first = _backward(local, 1)
    ensure_shared_grads(local, shared, copy=True)
    buffers = [p.grad for p in shared.parameters()]
    second = _backward(local, 2)
    ensure_shared_grads(local, shared, copy=True)
    for p, mine, b, g1, g2 in zip(
        shared.parameters(), local.parameters(), buffers, first, second, strict=True
    ):
        assert p.grad.device.type == "cpu" and p.grad.is_pinned() == (device == "cuda")
        assert p.grad is b  # the CPU buffer is reused
        assert p.grad.data_ptr() != mine.grad.data_ptr()  # a copy, not the worker's tensor
        assert torch.equal(p.grad, g2.cpu()) and not torch.equal(p.grad, g1.cpu())
    # A worker's later backward writes its own tensors, never the handed-over ones.
    with torch.no_grad():
        for mine in local.parameters():
            mine.grad.add_(1.0)
    for p, g2 in zip(shared.parameters(), second, strict=True):
        assert torch.equal(p.grad, g2.cpu())


def test_copying_hand_off_reallocates_after_a_missing_gradient():
    local, shared = _net(), _net()
    _backward(local, 1)
    ensure_shared_grads(local, shared, copy=True)
    local.zero_grad(set_to_none=True)
    ensure_shared_grads(local, shared, copy=True)
    assert all(p.grad is None for p in shared.parameters())
    third = _backward(local, 3)
    ensure_shared_grads(local, shared, copy=True)
    for p, mine, g in zip(shared.parameters(), local.parameters(), third, strict=True):
        assert torch.equal(p.grad, g) and p.grad is not mine.grad
    # A buffer that aliases the worker's gradient (left by the referencing hand-off) is
    # replaced, not written through.
    ensure_shared_grads(local, shared)
    ensure_shared_grads(local, shared, copy=True)
    for p, mine in zip(shared.parameters(), local.parameters(), strict=True):
        assert p.grad is not mine.grad


def test_copying_and_referencing_hand_offs_step_the_optimizer_alike():
    results = []
    for copy in (False, True):
        local, shared = _net(), _net()
        shared.share_memory()
        opt = SharedAdam(shared.parameters(), lr=1e-2, amsgrad=True)
        opt.share_memory()
        for seed in range(5):
            sync_weights(local, shared)
            _backward(local, seed)
            ensure_shared_grads(local, shared, copy=copy)
            opt.step()
        results.append([p.detach().clone() for p in shared.parameters()])
    for by_reference, by_copy in zip(*results, strict=True):
        assert torch.equal(by_reference, by_copy)


# -- device hygiene --------------------------------------------------------------------------------


@pytest.mark.parametrize("envs", [1, 3])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_every_tensor_of_an_update_is_made_on_the_agents_device(envs, fast):
    # With "meta" as the default device, a tensor made without device= lands there and the
    # first op that meets a CPU tensor fails: on a GPU such a tensor would be a silent
    # host/device copy, or an error only a GPU run shows.
    from player_util import Agent
    from train import TrainStats, update_is_finite

    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)
    games = [make_env(EnvSpec.of(args)) for _ in range(envs)]
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(games[0].observation_space, games[0].action_space, 32).to(cpu)
    shared = build_model(games[0].observation_space, games[0].action_space, 32)
    if fast:
        model.use_channels_last()
    with torch.device("meta"):
        agent = Agent(model, games, cpu, fast_path=fast)
        agent.reset(seeds=[1, 2, 3][:envs])
        stats = TrainStats(model)
        for _ in range(2):
            agent.start_rollout()
            agent.play_rollout(8)
            rollout = agent.rollout()
            terms = a3c_loss(rollout, args.gamma, args.tau, args.entropy_coef, args.value_coef)
            model.zero_grad(set_to_none=True)
            terms.total.backward()
            squares = stats.grad_squares(model)
            assert update_is_finite(terms, squares)
            ensure_shared_grads(model, shared, copy=True)
            stats.add(terms, squares)
        report = stats.flush(0)
    assert terms.total.device == cpu and report["updates"] == 2
    assert all(p.grad is not None and p.grad.device == cpu for p in shared.parameters())
