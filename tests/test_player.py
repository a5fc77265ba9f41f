"""The acting agent: rollout buffers, sampling vs greedy, reward clipping, LSTM state, lives."""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import pytest
import torch

from environment import EnvSpec, env_config, make_env
from model import build_model
from player_util import Agent, StepRecord
from tests.conftest import requires_cuda


class ScriptedEnv(gym.Env):
    """Vector observations, 3 actions, rewards from a script; records the actions it gets."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, rewards: list[float]):
        self.script = rewards
        self.actions: list[int] = []
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full(4, 0.1, np.float32), {}

    def step(self, action):
        self.actions.append(int(action))
        reward = self.script[self.t]
        self.t += 1
        obs = np.full(4, 0.1 * self.t, np.float32)
        return obs, reward, self.t == len(self.script), False, {"t": self.t}


def make_agent(env: gym.Env, **kwargs) -> Agent:
    torch.manual_seed(0)
    model = build_model(env.observation_space, env.action_space, 16)
    return Agent(model, [env], **kwargs)


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_a_rollout_records_one_row_per_step_and_clips_rewards(fast):
    env = ScriptedEnv([5.0, -3.0, 0.5, 0.0])
    agent = make_agent(env, fast_path=fast)
    agent.reset(seeds=[0])
    agent.start_rollout()
    assert agent.play_rollout(10) == 4  # the episode ends after 4 steps
    rollout = agent.rollout()
    assert rollout.rewards[:, 0].tolist() == [1.0, -1.0, 0.5, 0.0]
    assert rollout.terminated[:, 0].tolist() == [False, False, False, True]
    assert agent.done == [True] and agent.record["actions"][:, 0].tolist() == env.actions
    for tensor in (rollout.values, rollout.log_probs, rollout.entropies):
        assert tensor.shape == (4, 1) and tensor.requires_grad
    # Entropy of a near-uniform 3-way policy is close to log 3.
    assert rollout.entropies[0, 0].item() == pytest.approx(np.log(3), abs=0.01)
    assert rollout.bootstrap.tolist() == [0.0]  # the episode ended: no value after it

    agent.start_rollout()  # a new episode, a new LSTM state, an empty record
    assert agent.steps == 0 and agent.done == [False]
    assert agent.hx.abs().sum() == 0 and agent.cx.abs().sum() == 0


def test_rewards_are_scaled_after_clipping():
    agent = make_agent(ScriptedEnv([5.0, -0.5]), reward_scale=0.1)
    agent.reset()
    agent.start_rollout()
    agent.play_rollout(2)
    assert agent.record["rewards"][:, 0].tolist() == pytest.approx([0.1, -0.05])


def test_the_lstm_state_carries_over_between_rollouts_cut_from_the_graph():
    agent = make_agent(ScriptedEnv([0.0] * 10))
    agent.reset()
    agent.start_rollout()
    agent.play_rollout(3)
    assert agent.hx.requires_grad  # the reference path's graph
    before = agent.hx.detach().clone()
    agent.start_rollout()
    assert not agent.hx.requires_grad and torch.equal(agent.hx, before)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_agent_runs_on_gpu(fast):
    env = ScriptedEnv([1.0] * 5)
    model = build_model(env.observation_space, env.action_space, 16)
    agent = Agent(model.cuda(), [env], device="cuda", fast_path=fast)
    agent.reset()
    agent.start_rollout()
    agent.play_rollout(2)
    rollout = agent.rollout()
    assert rollout.values.device.type == "cuda" and agent.hx.device.type == "cuda"
    assert rollout.bootstrap.device.type == "cuda"
    assert rollout.rewards.device.type == "cpu" and rollout.took.device.type == "cpu"  # host's


def test_fast_path_tape_buffers_are_reused_across_rollouts():
    """Acting records into buffers kept across rollouts; a new buffer per rollout is slow."""
    from model import A3Clstm

    torch.manual_seed(0)
    model = A3Clstm(1, gym.spaces.Discrete(3), 16).use_channels_last()

    class Frames(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1, 80, 80), np.float32)
        action_space = gym.spaces.Discrete(3)

        def reset(self, *, seed=None, options=None):
            return np.zeros((1, 80, 80), np.float32), {}

        def step(self, action):
            return np.random.rand(1, 80, 80).astype(np.float32), 0.0, False, False, {}

    agent = Agent(model, [Frames()], fast_path=True)
    agent.reset()
    tape = agent.path.tape
    pointers = []
    for _ in range(3):
        agent.start_rollout()
        assert len(tape) == 0
        assert agent.play_rollout(5) == 5
        agent.rollout()
        pointers.append(tape.get("relu0").data_ptr())
        assert len(tape) == 5
    assert pointers[0] == pointers[1] == pointers[2]


def test_the_step_record_grows_past_its_first_capacity():
    env = ScriptedEnv([0.0] * 50)
    agent = make_agent(env)
    agent.record = StepRecord(1, capacity=4)
    agent.reset()
    agent.start_rollout()
    assert agent.play_rollout(30) == 30
    assert agent.rollout().values.shape == (30, 1)
    assert agent.record["took"].all() and agent.record["actions"][:, 0].tolist() == env.actions


# -- greedy games ------------------------------------------------------------------------------


def breakout(config, **kwargs):
    return make_env(
        EnvSpec("BreakoutNoFrameskip-v4", env_config(config, "BreakoutNoFrameskip-v4"), **kwargs)
    )


def random_model(env, hidden: int = 32):
    torch.manual_seed(0)
    return build_model(env.observation_space, env.action_space, hidden).eval()


def test_a_game_waiting_for_fire_ends_as_stalled_and_the_next_starts_afresh(config):
    # Sticky actions of probability 1 turn the reset's FIRE into the NOOP before it: the ball
    # never comes, and without a stall limit the game would last until the time limit.
    from player_util import STALLED, GreedyPlayer

    env = breakout(config, repeat_action_probability=1.0)
    player = GreedyPlayer(random_model(env), env)
    game = player.play_game(seed=0, stall_steps=150)
    assert (game.ending, game.reward, game.length) == (STALLED, 0.0, 150)
    assert game.steps_without_reward == 150
    assert game.note() == ", stalled: no reward in 150 steps"
    assert env.unwrapped.ale.lives() == 5
    again = player.play_game(stall_steps=40)
    assert again.length == 40 and env.unwrapped.ale.getEpisodeFrameNumber() < 40 * 4 + 200


def test_greedy_games_end_at_game_over_or_the_time_limit(config):
    from player_util import GAME_OVER, TIME_LIMIT, GreedyPlayer

    capped = breakout(config, max_episode_length=120)
    game = GreedyPlayer(random_model(capped), capped).play_game(seed=0)
    assert game.ending == TIME_LIMIT and game.length <= 120
    assert game.note().startswith(", cut by the time limit (no reward in the last ")
    rewarded_to_the_end = dataclasses.replace(game, steps_without_reward=0)  # CartPole's games
    assert rewarded_to_the_end.note() == ", cut by the time limit"

    # The paddle never moves (sticky NOOP), so every point is lost: a real game over.
    pong = make_env(
        EnvSpec(
            "PongNoFrameskip-v4",
            env_config(config, "PongNoFrameskip-v4"),
            repeat_action_probability=1.0,
        )
    )
    game = GreedyPlayer(random_model(pong), pong).play_game(seed=0)
    assert (game.ending, game.reward, game.note()) == (GAME_OVER, -21.0, "")


def test_a_lost_life_goes_on_with_the_same_game_and_fire_relaunches_the_ball(config):
    # NOOP every step: each ball is missed. Only FIRE launches one, so a game over within the
    # cap means the wrappers pressed FIRE after every lost life.
    from player_util import GAME_OVER, GreedyPlayer

    class AlwaysNoop(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def initial_state(self, batch, device=None):
            return self.inner.initial_state(batch, device)

        def forward(self, x, hx, cx):
            value, logits, hx, cx = self.inner(x, hx, cx)
            noop = torch.full_like(logits, -1e9)
            noop[:, 0] = 0.0
            return value, noop, hx, cx

    env = breakout(config)
    lives_seen = []
    real_step = env.step

    def step(action):
        result = real_step(action)
        lives_seen.append(env.unwrapped.ale.lives())
        return result

    env.step = step
    game = GreedyPlayer(AlwaysNoop(random_model(env)), env).play_game(seed=0)
    assert game.ending == GAME_OVER and game.length < 5000
    assert sorted(set(lives_seen), reverse=True) == [5, 4, 3, 2, 1, 0]


def test_a_time_limit_in_a_lost_lifes_reset_ends_the_game_there(config):
    """The reset after a lost life steps the game (a no-op, FIRE): a time limit there starts a
    new game, which must end the one being scored, not be added to it."""
    from player_util import TIME_LIMIT, GreedyPlayer

    model = random_model(breakout(config))
    player = GreedyPlayer(model, breakout(config))  # gym_eval.py swaps its env between games
    cut_in_reset = 0
    for cap in range(29, 35):  # around the first lost life (its reset takes steps 31-33 here)
        env = breakout(config, max_episode_length=cap)
        resets = []
        real_reset = env.unwrapped.reset

        def counted(*, seed=None, options=None, real_reset=real_reset, resets=resets):
            resets.append(seed)
            return real_reset(seed=seed, options=options)

        env.unwrapped.reset = counted
        player.env = env
        game = player.play_game(seed=0)
        assert game.ending == TIME_LIMIT and game.length <= cap, (cap, game)
        cut_in_reset += len(resets) > 1  # the emulator started a second game: the case met
        env.close()
    assert cut_in_reset >= 1


def test_sampling_draws_as_softmax_does_and_refuses_a_nan_row():
    from player_util import NonFiniteError, sample_actions

    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    actions, taken = sample_actions(logits)
    torch.manual_seed(7)
    expected = torch.softmax(logits, 1).multinomial(1)
    assert torch.equal(actions, expected) and taken == expected.view(-1).tolist()
    logits[3, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN or inf"):
        sample_actions(logits)  # refused without a device assert or a sampling error
