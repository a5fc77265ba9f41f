"""K envs per worker (`Agent` with K envs, ``--envs-per-worker``) and ``--precision bf16``."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from cli import parse_train_args
from environment import (
    EnvSpec,
    load_worker_normalizer_state,
    make_env,
    normalizer_state,
    worker_normalizer_state,
)
from model import build_model
from player_util import Agent
from tests.conftest import (
    ROOT,
    make_args,
    requires_bf16_cpu,
    requires_bf16_cuda,
)
from tests.test_train import every_parameter_changed, loss_rollout, worker_losses
from train import a3c_loss
from utils import UsageError
from validate import check_precision

# -- the masked loss ----------------------------------------------------------------------------


def random_rollout(steps: int, seed: int) -> dict:
    """One env's rollout inputs, (T, 1) leaves with grad: values, log-probs, entropies; rewards."""
    g = torch.Generator().manual_seed(seed)
    return {
        "values": torch.randn(steps, 1, generator=g).requires_grad_(),
        "log_probs": (-torch.rand(steps, 1, generator=g) * 2).requires_grad_(),
        "entropies": torch.rand(steps, 1, generator=g).requires_grad_(),
        "rewards": torch.randint(-1, 2, (steps, 1), generator=g).float(),
    }


def test_masked_loss_is_the_sum_of_each_envs_own_rollout_loss():
    # Env 0 plays all 6 steps and is bootstrapped; env 1's episode ends after 3 steps.
    lengths, bootstraps = [6, 3], [0.7, 0.0]
    rollouts = [random_rollout(n, seed) for seed, n in enumerate(lengths)]
    coefs = (0.99, 0.95, 0.01, 0.5)
    singles = [
        a3c_loss(
            loss_rollout(
                r["values"], r["log_probs"], r["entropies"], r["rewards"], torch.tensor([b])
            ),
            *coefs,
        )
        for r, b in zip(rollouts, bootstraps, strict=True)
    ]
    leaves = [t for r in rollouts for t in (r["values"], r["log_probs"], r["entropies"])]
    expected = singles[0].total + singles[1].total
    grads_expected = torch.autograd.grad(expected, leaves)

    def columns(key: str) -> torch.Tensor:  # (6, 2); env 1's rows 3-5 are zeros
        return torch.cat([rollouts[0][key], F.pad(rollouts[1][key], (0, 0, 0, 3))], dim=1)

    took = torch.tensor([[True, t < 3] for t in range(6)])
    batched = a3c_loss(
        loss_rollout(
            columns("values"), columns("log_probs"), columns("entropies"), columns("rewards"),
            torch.tensor([0.7, 0.0]), took,
        ),
        *coefs,
    )  # fmt: skip
    assert batched.total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert batched.value_loss.item() == pytest.approx(
        (singles[0].value_loss + singles[1].value_loss).item(), rel=1e-6
    )
    for got, want in zip(torch.autograd.grad(batched.total, leaves), grads_expected, strict=True):
        torch.testing.assert_close(got, want)
    entropy_taken = torch.cat([rollouts[0]["entropies"], rollouts[1]["entropies"]]).mean()
    assert batched.entropy.item() == pytest.approx(entropy_taken.item(), rel=1e-6)


# -- the agent with K envs on Pong ----------------------------------------------------------------


def batch_rollout(fast: bool, envs: int = 3, steps: int = 8, bf16: bool = False):
    """One K-env rollout on Pong from fixed seeds: loss, gradients, actions (T, K), steps."""
    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)
    games = [make_env(EnvSpec.of(args)) for _ in range(envs)]
    torch.manual_seed(0)
    model = build_model(games[0].observation_space, games[0].action_space, args.hidden_size)
    if fast:
        model.use_channels_last()
    agent = Agent(model, games, fast_path=fast, bf16=bf16)
    agent.reset(seeds=[3 + k for k in range(envs)])
    agent.start_rollout()
    torch.manual_seed(42)
    taken = agent.play_rollout(steps)
    terms = a3c_loss(agent.rollout(), args.gamma, args.tau, args.entropy_coef, args.value_coef)
    model.zero_grad(set_to_none=True)
    terms.total.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return terms.total.item(), grads, agent.record["actions"].tolist(), taken


def test_batch_agent_fast_path_gives_the_reference_loss_and_gradients():
    ref_loss, ref_grads, ref_actions, ref_taken = batch_rollout(fast=False)
    loss, grads, actions, taken = batch_rollout(fast=True)
    assert taken == ref_taken == 3 * 8
    assert actions == ref_actions
    assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    for ref, fast in zip(ref_grads, grads, strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-3, atol=1e-5)


class EndsAt(gym.Wrapper):
    """Ends the episode (terminated) at its `step`-th step; with `nan`, on a NaN frame."""

    def __init__(self, env: gym.Env, step: int, nan: bool = False):
        super().__init__(env)
        self.end, self.nan, self.t = step, nan, 0

    def reset(self, **kwargs):
        self.t = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.t += 1
        if self.t == self.end:
            terminated = True
            obs = np.full_like(obs, np.nan) if self.nan else obs
        return obs, reward, terminated, truncated, info


def scripted_sampling(monkeypatch, actions: list[int]) -> None:
    """Make the agent take `actions` in turn instead of sampling (one env)."""
    import player_util

    script = iter(actions)

    def sample(logits, probs=None):
        action = next(script)
        return torch.tensor([[action]], device=logits.device), [action]

    monkeypatch.setattr(player_util, "sample_actions", sample)


@pytest.mark.parametrize("nan", [False, True], ids=["clean", "nan-terminal-frame"])
def test_an_env_that_ends_mid_rollout_waits_inert_on_both_paths_and_as_one_env_agents(
    monkeypatch, nan
):
    """K=3, env 1's episode ends at step 3 of 8: the fast path, the reference path and three
    one-env agents taking the same actions give the same loss and gradients. With a NaN
    terminal frame, the waiting env is never forwarded on it: the other two rollouts go on
    and nothing reaches the gradients."""
    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)

    def game(k: int) -> gym.Env:
        env = make_env(EnvSpec.of(args))
        return EndsAt(env, 3, nan) if k == 1 else env

    def model(fast: bool):
        torch.manual_seed(0)
        net = build_model(game(0).observation_space, game(0).action_space, 32)
        return net.use_channels_last() if fast else net

    def update(agent: Agent, seeds: list[int], steps: int = 8):
        agent.reset(seeds=seeds)
        agent.start_rollout()
        taken = agent.play_rollout(steps)
        terms = a3c_loss(agent.rollout(), args.gamma, args.tau, args.entropy_coef, args.value_coef)
        agent.model.zero_grad(set_to_none=True)
        terms.total.backward()
        return taken, terms, [p.grad.clone() for p in agent.model.parameters()]

    results = {}
    for fast in (False, True):
        agent = Agent(model(fast), [game(k) for k in range(3)], fast_path=fast)
        torch.manual_seed(42)
        results[fast] = (*update(agent, [3, 4, 5]), agent.record["actions"].copy())
        assert agent.done == [False, True, False]
    (taken, ref_terms, ref_grads, actions), (fast_taken, fast_terms, fast_grads, fast_actions) = (
        results[False],
        results[True],
    )
    assert taken == fast_taken == 8 + 3 + 8 and (actions == fast_actions).all()
    assert fast_terms.total.item() == pytest.approx(ref_terms.total.item(), rel=1e-4, abs=1e-5)
    for ref, fast in zip(ref_grads, fast_grads, strict=True):
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, ref, rtol=1e-3, atol=1e-5)

    singles = []
    for k in range(3):
        scripted_sampling(monkeypatch, actions[: 3 if k == 1 else 8, k].tolist())
        single = Agent(model(False), [game(k)])
        singles.append(update(single, [3 + k]))
    assert [t for t, _, _ in singles] == [8, 3, 8]
    total = sum(terms.total.item() for _, terms, _ in singles)
    assert ref_terms.total.item() == pytest.approx(total, rel=1e-4, abs=1e-5)
    for i, ref in enumerate(ref_grads):
        torch.testing.assert_close(sum(g[i] for _, _, g in singles), ref, rtol=1e-3, atol=1e-5)


def test_agent_envs_are_independent_rollouts():
    """Each env's rows are what the model computes for that env alone, with the same actions."""
    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)
    games = [make_env(EnvSpec.of(args)) for _ in range(2)]
    torch.manual_seed(0)
    model = build_model(games[0].observation_space, games[0].action_space, args.hidden_size)
    batch = Agent(model, games)
    batch.reset(seeds=[5, 6])
    batch.start_rollout()
    batch.play_rollout(6)
    rollout = batch.rollout()
    actions = batch.record["actions"]  # (T, K)
    for k in range(2):
        env = make_env(EnvSpec.of(args))
        obs, _ = env.reset(seed=5 + k)
        hx, cx = model.initial_state(1, "cpu")
        for t in range(6):
            state = torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)
            value, _, hx, cx = model(state, hx, cx)
            torch.testing.assert_close(
                value.view(1), rollout.values[t, k : k + 1], rtol=1e-4, atol=1e-6
            )
            obs, reward, *_ = env.step(int(actions[t, k]))
            assert max(min(reward, 1.0), -1.0) == rollout.rewards[t, k].item()


def test_an_env_whose_episode_ends_waits_masked_and_restarts():
    args = make_args(env="CartPole-v1", hidden_size=16)
    games = [make_env(EnvSpec.of(args)) for _ in range(2)]
    model = build_model(games[0].observation_space, games[0].action_space, args.hidden_size)
    agent = Agent(model, games, fast_path=True)
    agent.reset(seeds=[0, 1])
    episode_ended = False
    for _ in range(40):  # random CartPole episodes end within a few dozen steps
        agent.start_rollout()
        taken = agent.play_rollout(20)
        rollout = agent.rollout()
        took = rollout.took.T  # (K, T)
        assert taken == agent.steps == int(took.sum())
        for k in range(2):
            row = took[k].tolist()
            assert row == sorted(row, reverse=True)  # taken steps, then only waiting
            if not all(row):
                episode_ended = True
                assert agent.done[k]
                assert rollout.terminated[took[k].sum() - 1, k]
        assert rollout.bootstrap[torch.tensor(agent.done)].abs().sum() == 0
    assert episode_ended


def test_tape_keeps_one_batch_size_per_rollout():
    from fast_path import EncoderTape

    tape = EncoderTape()
    tape.record({"x": torch.ones(3, 2)})
    tape.advance()
    tape.record({"x": 2 * torch.ones(3, 2)})
    tape.advance()
    assert tape.get("x").shape == (6, 2) and tape.get("x")[3:].eq(2).all()
    with pytest.raises(RuntimeError, match="one batch size"):
        tape.record({"x": torch.ones(2, 2)})
    tape.clear()
    tape.record({"x": torch.ones(2, 2)})  # a new rollout may change it
    tape.advance()
    assert tape.get("x").shape == (2, 2)


def test_worker_with_k_envs_counts_every_envs_steps_and_is_deterministic():
    args = make_args(
        env="PongNoFrameskip-v4", hidden_size=32, num_steps=5, envs_per_worker=3,
        env_config=str(ROOT / "config.json"),
    )  # fmt: skip
    first, _ = worker_losses(args, updates=2)
    second, _ = worker_losses(args, updates=2)
    # max_steps = updates * num_steps agent steps: one update of 3 envs x 5 steps covers it.
    assert len(first) == 1 and first == second and math.isfinite(first[0])


def test_normalizer_state_per_env_round_trips():
    args = make_args(env="PongNoFrameskip-v4")
    games = [make_env(EnvSpec.of(args)) for _ in range(2)]
    for k, env in enumerate(games):
        env.reset(seed=k)
        for _ in range(5 + 10 * k):
            env.step(0)
    state = worker_normalizer_state(games)
    assert state["kind"] == "per_env" and len(state["envs"]) == 2
    fresh = [make_env(EnvSpec.of(args)) for _ in range(3)]
    load_worker_normalizer_state(fresh, state)
    assert normalizer_state(fresh[0]) == normalizer_state(games[0])
    assert normalizer_state(fresh[1]) == normalizer_state(games[1])
    single = normalizer_state(games[1])  # a one-env run resumed with more envs
    load_worker_normalizer_state(fresh, single)
    assert all(normalizer_state(env) == single for env in fresh)


# -- bf16 ---------------------------------------------------------------------------------------


def assert_bf16_close(grads16: list[torch.Tensor], grads32: list[torch.Tensor]) -> None:
    """The stated bf16 tolerance: conv gradients within 25% relative L2 error of fp32's with a
    cosine of at least 0.97; LSTM and head gradients within 2%.

    Measured on a 2-env, 10-step Pong rollout: conv 0.9-8.7% (cosine >= 0.996), LSTM and heads
    0.2-0.6%. On one env's 12 steps after 30 sampled ones, from 4 seeds: conv1's weight
    10-17%, the other conv tensors 0.8-11%, LSTM and heads under 1%. The first layer is
    furthest off: its gradient sums the most bf16 products.
    """
    for i, (g16, g32) in enumerate(zip(grads16, grads32, strict=True)):
        assert g16.dtype == torch.float32
        error = ((g16 - g32).norm() / g32.norm()).item()
        cosine = torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0)
        conv = i < 8  # conv1..conv4 weight and bias come first
        assert error <= (0.25 if conv else 0.02), (i, error)
        assert cosine >= 0.97, (i, cosine)


@requires_bf16_cpu
@pytest.mark.parametrize("fast", [True, False])
def test_bf16_gradients_stay_close_to_fp32(fast: bool):
    loss32, grads32, actions32, _ = batch_rollout(fast=fast, envs=2, steps=10)
    loss16, grads16, actions16, _ = batch_rollout(fast=fast, envs=2, steps=10, bf16=True)
    assert actions16 == actions32  # same seed; the policy barely moves in bf16
    assert loss16 == pytest.approx(loss32, rel=1e-2)
    assert_bf16_close(grads16, grads32)


@requires_bf16_cpu
def test_bf16_single_env_fast_path_matches_its_reference_path():
    from tests.test_train import pong_rollout_grads

    ref_loss, ref_grads, _ = pong_rollout_grads(fast=False, bf16=True)
    loss, grads, _ = pong_rollout_grads(fast=True, bf16=True)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for ref, got in zip(ref_grads, grads, strict=True):  # both bf16: far closer than to fp32
        assert (got - ref).norm() <= 0.01 * ref.norm() + 1e-8
    _, grads32, _ = pong_rollout_grads(fast=True)
    assert_bf16_close(grads, grads32)


def test_bf16_is_refused_where_the_cpu_lacks_it(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(UsageError, match="--precision bf16 needs a CPU"):
        check_precision("bf16", [-1])
    check_precision("fp32", [-1])  # fp32 always works


@pytest.mark.gpu
@requires_bf16_cuda
def test_k_envs_bf16_worker_on_gpu():
    args = make_args(
        env="PongNoFrameskip-v4", hidden_size=32, num_steps=5, envs_per_worker=4, gpu_ids=[0],
        precision="bf16", env_config=str(ROOT / "config.json"),
    )  # fmt: skip
    losses, shared = worker_losses(args, updates=2)
    assert losses and all(math.isfinite(x) for x in losses)
    assert all(p.device.type == "cpu" for p in shared.parameters())
    assert every_parameter_changed(shared, args)  # the gradients came back from the GPU


def test_conv_backward_in_chunks_gives_the_one_batch_gradients(monkeypatch):
    import fast_path

    monkeypatch.setattr(fast_path, "BACKWARD_CHUNK", 10_000)
    _, whole, _, _ = batch_rollout(fast=True, envs=3, steps=8)
    monkeypatch.setattr(fast_path, "BACKWARD_CHUNK", 7)  # 24 rows: chunks of 7, 7, 7, 3
    _, chunked, _, _ = batch_rollout(fast=True, envs=3, steps=8)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


# -- through the CLI ----------------------------------------------------------------------------


# -- --bootstrap-truncated ------------------------------------------------------------------------


def always_noop(model):
    """Make the policy pick action 0 with probability 1, so sampling cannot tell K from 1."""
    with torch.no_grad():
        model.actor_linear.weight.zero_()
        model.actor_linear.bias.copy_(torch.tensor([0.0] + [-1e4] * 5))
    return model


def cut_pong(limit: int | None):
    args = make_args(env="PongNoFrameskip-v4", hidden_size=32)
    env = make_env(EnvSpec.of(args))
    return env if limit is None else gym.wrappers.TimeLimit(env, limit)


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize("flag", [False, True], ids=["off", "on"])
def test_a_time_limit_cut_bootstraps_from_its_last_state_only_with_the_flag(fast, flag):
    def model():
        torch.manual_seed(0)
        net = always_noop(build_model(cut_pong(None).observation_space, gym.spaces.Discrete(6), 32))
        return net.use_channels_last() if fast else net

    single = Agent(model(), [cut_pong(3)], fast_path=fast, bootstrap_truncated=flag)
    single.reset(seeds=[3])
    single.start_rollout()
    assert single.play_rollout(6) == 3 and single.done == [True]
    rollout = single.rollout()
    assert rollout.truncated[:, 0].tolist() == [False, False, True]
    assert not rollout.terminated.any()
    alone = rollout.bootstrap

    batch = Agent(model(), [cut_pong(3), cut_pong(None)], fast_path=fast, bootstrap_truncated=flag)
    batch.reset(seeds=[3, 4])
    batch.start_rollout()
    assert batch.play_rollout(6) == 3 + 6
    together = batch.rollout().bootstrap
    if flag:  # V(s_3) of the cut episode, with the LSTM state the cut left: as the one env's
        assert alone.item() != 0.0
        assert together[0].item() == pytest.approx(alone.item(), rel=1e-4, abs=1e-6)
    else:  # the original's computation: a cut ends the return at 0
        assert alone.item() == 0.0 and together[0].item() == 0.0
    assert together[1].item() != 0.0  # still playing: its own V(s_T) either way


def test_bootstrap_truncated_is_a_flag_off_by_default():
    assert parse_train_args([]).bootstrap_truncated is False
    assert parse_train_args(["--bootstrap-truncated"]).bootstrap_truncated is True
