"""The worker: the A3C loss on a hand-worked rollout, step sizes, same-seed determinism."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from environment import make_env
from model import build_model
from tests.conftest import ROOT, make_args, requires_cuda
from train import a3c_loss, make_optimizer, run_worker, step_size_for
from utils import ProcessContext, read_config


def rollout_tensors():
    values = [torch.tensor([[v]], requires_grad=True) for v in (0.5, 0.2, -0.3)]
    log_probs = [torch.tensor([[lp]], requires_grad=True) for lp in (-0.1, -0.2, -0.3)]
    entropies = [torch.tensor([e], requires_grad=True) for e in (0.6, 0.5, 0.4)]
    return values, log_probs, [1.0, 0.0, -1.0], entropies


def test_loss_matches_a_rollout_worked_by_hand():
    """gamma 0.9, tau 0.5, entropy 0.1, bootstrap 0.4 (worked out in the comments)."""
    values, log_probs, rewards, entropies = rollout_tensors()
    args = make_args(gamma=0.9, tau=0.5, entropy_coef=0.1, value_coef=0.5)
    terms = a3c_loss(values, log_probs, rewards, entropies, torch.tensor([[0.4]]), args)
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
    for lp, gae in zip(log_probs, (0.39965, -0.623, -0.34), strict=True):
        assert lp.grad.item() == pytest.approx(-gae, abs=1e-6)
    for v, adv in zip(values, (-0.0184, -0.776, -0.34), strict=True):
        assert v.grad.item() == pytest.approx(-0.5 * adv, abs=1e-6)
    for e in entropies:
        assert e.grad.item() == pytest.approx(-0.1)


def test_value_coef_is_really_used():
    args = make_args(gamma=0.9, tau=0.5, entropy_coef=0.1)
    totals = {}
    for coef in (0.0, 0.5, 2.0):
        args.value_coef = coef
        values, log_probs, rewards, entropies = rollout_tensors()
        totals[coef] = a3c_loss(
            values, log_probs, rewards, entropies, torch.zeros(1, 1), args
        ).total.item()
    assert totals[0.5] - totals[0.0] == pytest.approx(0.25 * (totals[2.0] - totals[0.0]))
    assert totals[2.0] != totals[0.0]


def test_terminal_rollout_bootstraps_from_zero():
    values, log_probs, _, entropies = rollout_tensors()
    args = make_args(gamma=1.0, tau=1.0, entropy_coef=0.0)
    terms = a3c_loss(values[:1], log_probs[:1], [1.0], entropies[:1], torch.zeros(1, 1), args)
    assert terms.value_loss.item() == pytest.approx(0.5 * (1.0 - 0.5) ** 2)


def test_distributed_step_sizes_are_dealt_round_robin():
    args = make_args(distributed_step_size=[16, 32, 64])
    assert [step_size_for(rank, args) for rank in range(5)] == [16, 32, 64, 16, 32]
    assert step_size_for(3, make_args(num_steps=7)) == 7


# -- the real worker loop ----------------------------------------------------------------------


def worker_losses(args, updates: int, device: str = "cpu") -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(args.seed)
    env = make_env(args.env, read_config(ROOT / "config.json"), args)
    shared = build_model(env.observation_space, env.action_space, args)
    env.close()
    shared.share_memory()
    optimizer = make_optimizer(shared.parameters(), args)
    optimizer.share_memory()
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=updates * args.num_steps)
    losses: list[float] = []
    run_worker(0, args, shared, optimizer, ctx, losses)
    return losses, shared


def test_same_seed_gives_identical_losses_on_pong():
    args = make_args(
        env="PongNoFrameskip-v4", hidden_size=32, num_steps=10, env_config=str(ROOT / "config.json")
    )
    first, _ = worker_losses(args, updates=4)
    second, _ = worker_losses(args, updates=4)
    assert len(first) == 4
    assert first == second
    args.seed = 2
    other, _ = worker_losses(args, updates=4)
    assert other != first


def test_worker_changes_the_shared_model():
    args = make_args(env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"))
    torch.manual_seed(args.seed)
    _, shared = worker_losses(args, updates=3)
    torch.manual_seed(args.seed)
    env = make_env(args.env, read_config(ROOT / "config.json"), args)
    untouched = build_model(env.observation_space, env.action_space, args)
    changed = [
        not torch.equal(p, q)
        for p, q in zip(shared.parameters(), untouched.parameters(), strict=True)
    ]
    assert all(changed)


def test_worker_with_its_own_optimizer():
    args = make_args(env="CartPole-v1", hidden_size=16, env_config=str(ROOT / "config.json"))
    torch.manual_seed(args.seed)
    env = make_env(args.env, read_config(ROOT / "config.json"), args)
    shared = build_model(env.observation_space, env.action_space, args)
    before = [p.clone() for p in shared.parameters()]
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=60)
    run_worker(0, args, shared, None, ctx)
    assert ctx.total_steps() >= 60
    assert any(not torch.equal(p, q) for p, q in zip(shared.parameters(), before, strict=True))


@requires_cuda
@pytest.mark.gpu
def test_gpu_worker_updates_the_cpu_shared_model():
    args = make_args(
        env="CartPole-v1", hidden_size=16, gpu_ids=[0], env_config=str(ROOT / "config.json")
    )
    losses, shared = worker_losses(args, updates=3)
    assert len(losses) >= 3 and all(torch.isfinite(torch.tensor(losses)))
    assert all(p.device.type == "cpu" for p in shared.parameters())


# -- fast path against the reference path ------------------------------------------------------


def pong_rollout_grads(fast: bool, steps: int = 12) -> tuple[float, list[torch.Tensor], list[int]]:
    """One rollout from a fixed seed: loss, gradients and the actions taken."""
    from player_util import Agent

    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)
    env = make_env(args.env, read_config(ROOT / "config.json"), args)
    torch.manual_seed(0)
    model = build_model(env.observation_space, env.action_space, args)
    if fast:
        model.use_channels_last()
    agent = Agent(model, env)
    agent.reset(seed=3)
    for _ in range(30):  # get into the game, with a non-zero LSTM state
        agent.action_test()
    agent.detach_lstm()
    torch.manual_seed(42)
    actions = []
    for _ in range(steps):
        if fast:
            agent.action_explore()
            actions.append(agent.explored_actions[-1])
        else:
            agent.action_train()
        if agent.done:
            break
    if fast:
        agent.replay_rollout()
    terms = a3c_loss(
        agent.values, agent.log_probs, agent.rewards, agent.entropies,
        agent.bootstrap_value(), args,
    )  # fmt: skip
    model.zero_grad(set_to_none=True)
    terms.total.backward()
    return terms.total.item(), [p.grad.clone() for p in model.parameters()], actions


def test_fast_path_gives_the_reference_loss_and_gradients():
    ref_loss, ref_grads, _ = pong_rollout_grads(fast=False)
    fast_loss, fast_grads, actions = pong_rollout_grads(fast=True)
    assert len(actions) == 12
    assert fast_loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    for ref, fast in zip(ref_grads, fast_grads, strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-3, atol=1e-5)


def test_fast_and_reference_workers_give_the_same_losses_on_pong():
    args = make_args(
        env="PongNoFrameskip-v4", hidden_size=32, num_steps=10, env_config=str(ROOT / "config.json")
    )
    args.fast_path = False
    reference, _ = worker_losses(args, updates=4)
    args.fast_path = True
    fast, _ = worker_losses(args, updates=4)
    assert fast == pytest.approx(reference, rel=1e-4, abs=1e-5)


def test_forward_sequence_matches_step_by_step_forward():
    args = make_args(hidden_size=16)
    import gymnasium as gym

    for obs_space in (
        gym.spaces.Box(-1, 1, (1, 80, 80)),
        gym.spaces.Box(-1, 1, (4,)),
    ):
        torch.manual_seed(0)
        model = build_model(obs_space, gym.spaces.Discrete(3), args)
        x = torch.randn(7, *obs_space.shape)
        hx, cx = torch.randn(1, 16), torch.randn(1, 16)
        values, logits = model.forward_sequence(x, hx, cx)
        h, c = hx, cx
        for t in range(7):
            v, lg, h, c = model(x[t : t + 1], h, c)
            torch.testing.assert_close(values[t : t + 1], v, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(logits[t : t + 1], lg, rtol=1e-5, atol=1e-6)
