"""config.json, the Atari wrapper stack on real ALE games, the vector-env path, bad env input."""

from __future__ import annotations

import dataclasses
import json

import gymnasium as gym
import numpy as np
import pytest

from cli import parse_train_args
from environment import (
    AtariRescale,
    EnvSpec,
    EpisodicLifeEnv,
    FireResetEnv,
    GameScore,
    MaxAndSkipEnv,
    NoopResetEnv,
    NormalizedEnv,
    atari_env,
    env_config,
    episode_frames,
    find_wrapper,
    finished_games,
    frames_per_step,
    make_env,
    process_frame,
    protocol,
    read_config,
    register_games,
    saved_frame_skip,
    short_episode_warning,
    skip_flags,
    skip_text,
    vector_env,
    was_real_done,
)
from player_util import force_real_reset
from tests.conftest import ROOT
from utils import UsageError

register_games()


class Recorder(gym.Wrapper):
    """Records every action, raw observation and reward that passes through it."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.actions: list[int] = []
        self.frames: list[np.ndarray] = []
        self.rewards: list[float] = []
        self.resets = 0

    def reset(self, **kwargs):
        self.resets += 1
        obs, info = self.env.reset(**kwargs)
        self.frames.append(obs)
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.actions.append(int(action))
        self.frames.append(obs)
        self.rewards.append(float(reward))
        return obs, reward, terminated, truncated, info


def ale(env: gym.Env):
    return env.unwrapped.ale


def steps_until_done(env: gym.Env, action: int = 0) -> tuple[int, bool, bool]:
    """Play `action` until the episode ends: (agent steps, terminated, truncated)."""
    steps = 0
    while True:
        steps += 1
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return steps, terminated, truncated


def wrapper_types(env: gym.Env) -> list[type]:
    types = []
    while isinstance(env, gym.Wrapper):
        types.append(type(env))
        env = env.env
    return types


# -- the stack ---------------------------------------------------------------------------------


def test_noframeskip_stack_order_and_output(config):
    env = atari_env(EnvSpec("PongNoFrameskip-v4", env_config(config, "PongNoFrameskip-v4")))
    types = wrapper_types(env)
    ours = [t for t in types if t.__module__ == "environment" or t is gym.wrappers.TimeLimit]
    assert ours == [
        NormalizedEnv,
        AtariRescale,
        FireResetEnv,
        EpisodicLifeEnv,
        GameScore,
        MaxAndSkipEnv,
        NoopResetEnv,
        gym.wrappers.TimeLimit,
    ]
    # A random skip adds a cap in agent steps after the skip, under the lost-life wrapper.
    conf = env_config(config, "PongNoFrameskip-v4")
    random_skip = atari_env(EnvSpec("PongNoFrameskip-v4", conf, 50, (2, 4)))
    assert [t for t in wrapper_types(random_skip) if t in ours] == [
        *ours[:5], gym.wrappers.TimeLimit, *ours[5:]
    ]  # fmt: skip
    obs, _ = env.reset(seed=0)
    assert obs.shape == (1, 80, 80) and obs.dtype == np.float32
    obs, reward, terminated, truncated, _ = env.step(0)
    assert obs.shape == (1, 80, 80) and obs.dtype == np.float32
    assert env.observation_space.shape == (1, 80, 80)


def test_v5_ids_skip_frames_only_once(config):
    env = atari_env(EnvSpec("ALE/Pong-v5", env_config(config, "ALE/Pong-v5")))
    assert MaxAndSkipEnv not in wrapper_types(env)
    assert NoopResetEnv not in wrapper_types(env)
    env.reset(seed=0)
    before = ale(env).getEpisodeFrameNumber()
    env.step(0)
    assert ale(env).getEpisodeFrameNumber() - before == 4  # ALE's own skip, not 4 x 4


def test_same_seed_gives_same_observations(config):
    def rollout(seed: int) -> list[np.ndarray]:
        env = make_env(EnvSpec("PongNoFrameskip-v4", env_config(config, "PongNoFrameskip-v4")))
        obs, _ = env.reset(seed=seed)
        out = [obs]
        for action in [2, 3, 2, 2, 0, 3] * 5:
            out.append(env.step(action)[0])
        return out

    a, b = rollout(7), rollout(7)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# -- no-op reset -------------------------------------------------------------------------------


def test_noop_reset_plays_1_to_30_noops():
    env = Recorder(gym.make("PongNoFrameskip-v4"))
    noop = NoopResetEnv(env, 30)
    counts = []
    for game in range(120):
        env.actions.clear()
        noop.reset(seed=0 if game == 0 else None)  # seeded once: a seeded reset takes 0.27 s
        counts.append(noop.last_noops)
        assert env.actions == [0] * noop.last_noops
        assert ale(noop).getEpisodeFrameNumber() == noop.last_noops
    assert min(counts) >= 1 and max(counts) <= 30
    assert len(set(counts)) >= 20  # really random over the range, not a constant


# -- max and skip ------------------------------------------------------------------------------


def test_max_and_skip_returns_max_of_last_three_frames_and_sums_rewards():
    rec = Recorder(gym.make("PongNoFrameskip-v4"))
    env = MaxAndSkipEnv(rec, skip=4)
    env.reset(seed=3)
    differs_from_last = 0
    for step in range(120):
        start = len(rec.frames)
        obs, reward, terminated, truncated, _ = env.step([0, 2, 3][step % 3])
        window = rec.frames[start:]
        assert len(window) == 4 and rec.actions[-4:] == [rec.actions[-1]] * 4
        expected = np.maximum(np.maximum(window[1], window[2]), window[3])
        np.testing.assert_array_equal(obs, expected)
        assert reward == sum(rec.rewards[-4:])
        differs_from_last += not np.array_equal(obs, window[-1])
    assert differs_from_last > 0  # the max really combines frames


def test_random_skip_draws_each_steps_frames_from_the_range_reproducibly():
    def windows(seed: int) -> list[int]:
        rec = Recorder(gym.make("PongNoFrameskip-v4"))
        env = MaxAndSkipEnv(rec, skip=(2, 4))
        env.reset(seed=seed)
        counts = []
        for step in range(150):
            start, rewarded = len(rec.frames), len(rec.rewards)
            obs, reward, *_ = env.step([0, 2, 3][step % 3])
            window = rec.frames[start:]
            counts.append(len(window))
            expected = window[-3:][0]
            for frame in window[-3:][1:]:
                expected = np.maximum(expected, frame)
            np.testing.assert_array_equal(obs, expected)  # the max over the last (up to) 3
            assert reward == sum(rec.rewards[rewarded:])
        return counts

    counts = windows(seed=5)
    assert set(counts) == {2, 3, 4}  # every count of the range, and nothing outside it
    assert 2.7 < np.mean(counts) < 3.3  # uniform: a mean of 3
    assert windows(seed=5) == counts  # the game's own generator, seeded by reset
    assert windows(seed=6) != counts


def test_random_skip_counts_its_frames_and_caps_episodes_in_agent_steps(config):
    assert frames_per_step("PongNoFrameskip-v4", (2, 4)) == 3
    assert frames_per_step("PongNoFrameskip-v4", (2, 3)) == 2.5
    assert frames_per_step("PongNoFrameskip-v4", 4) == 4
    assert episode_frames("PongNoFrameskip-v4", 1000, (2, 5)) == (5000, 5)  # what ALE may count
    env = make_env(EnvSpec(
        "PongNoFrameskip-v4", env_config(config, "PongNoFrameskip-v4"), max_episode_length=60,
        skip_rate=(2, 4),
    ))  # fmt: skip
    env.reset(seed=0)
    steps, terminated, truncated = steps_until_done(env)
    # Cut at 60 agent steps (FIRE and action 2 at reset are two of them), as the protocol
    # says, where the cap of 60 x 4 raw frames alone would have allowed ~80.
    assert truncated and not terminated and steps == 60 - 2
    assert 60 * 2 < ale(env).getEpisodeFrameNumber() < 60 * 4
    played = protocol("PongNoFrameskip-v4", (2, 4), 10000, 0.25)
    assert played["frame_skip"] == [2, 4] and played["max_pool_frames"] is True
    assert played["noop_starts"] == 30 and played["repeat_action_probability"] == 0.25
    assert played["episode_cap_steps"] == 10000


def test_a_random_skip_cap_counts_the_whole_game_across_lives(config):
    env = make_env(EnvSpec(
        "BreakoutNoFrameskip-v4", env_config(config, "BreakoutNoFrameskip-v4"),
        max_episode_length=150, skip_rate=(2, 4),
    ))  # fmt: skip
    env.reset(seed=0)
    steps, lives_lost = 2, 0  # the reset's FIRE and action 2 are steps of the game
    while True:  # FIRE: the ball comes, and the idle paddle loses it, life after life
        _, _, terminated, truncated, _ = env.step(1)
        steps += 1
        if truncated:
            break
        if terminated:  # a lost life: the same game goes on after a no-op, FIRE and action 2
            lives_lost += 1
            env.reset()
            steps += 3
    assert lives_lost >= 2  # the cap's count ran on across them
    assert steps == 150 and was_real_done(env)


def test_a_random_skip_short_cap_is_warned_about():
    assert short_episode_warning(protocol("PongNoFrameskip-v4", (2, 4), 9)) is not None
    assert short_episode_warning(protocol("PongNoFrameskip-v4", (2, 4), 10)) is None


def test_a_saved_configuration_names_its_skip_and_the_flags_that_give_it():
    assert saved_frame_skip({"skip_rate": 4, "skip_rate_min": 2}, 4) == (2, 4)
    assert saved_frame_skip({"skip_rate": 4, "skip_rate_min": 4}, 4) == 4
    assert saved_frame_skip({"skip_rate": 3}, 4) == 3  # saved before --skip-rate-min existed
    assert saved_frame_skip({}, 4) == 4
    assert skip_flags((2, 4)) == "--skip-rate 4 --skip-rate-min 2"
    assert skip_flags(4) == "--skip-rate 4" and skip_text((2, 4)) == "2-4"


# -- episodic life -----------------------------------------------------------------------------


def test_life_loss_ends_episode_but_not_game():
    env = EpisodicLifeEnv(gym.make("BreakoutNoFrameskip-v4"))
    env.reset(seed=0)
    assert ale(env).lives() == 5
    life_losses = 0
    while True:
        # FIRE launches the ball; NOOP otherwise, so it is missed and a life is lost.
        _, _, terminated, truncated, _ = env.step(1)
        if not (terminated or truncated):
            continue
        if not was_real_done(env):
            life_losses += 1
            frame_before = ale(env).getEpisodeFrameNumber()
            lives_before = ale(env).lives()
            env.reset()
            # Same game: lives kept, frames keep counting.
            assert ale(env).lives() == lives_before
            assert ale(env).getEpisodeFrameNumber() > frame_before
        else:
            assert ale(env).lives() == 0 or truncated
            break
    assert life_losses == 4
    env.reset()
    assert ale(env).lives() == 5
    assert ale(env).getEpisodeFrameNumber() == 0


def test_was_real_done_is_reachable_from_the_full_stack(config):
    env = make_env(EnvSpec("BreakoutNoFrameskip-v4", env_config(config, "BreakoutNoFrameskip-v4")))
    env.reset(seed=1)
    steps_until_done(env)
    assert env.get_wrapper_attr("was_real_done") is False
    assert was_real_done(env) is False


def test_a_training_game_scores_every_life_and_a_cut_game_not_at_all(config):
    env = make_env(EnvSpec("BreakoutNoFrameskip-v4", env_config(config, "BreakoutNoFrameskip-v4")))
    env.action_space.seed(3)
    env.reset(seed=3)
    total, steps, lives_lost = 0.0, 0, 0
    while True:  # as a training worker plays: every lost life resets
        _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        total, steps = total + reward, steps + 1
        if terminated or truncated:
            if was_real_done(env):
                break
            lives_lost += 1
            env.reset()
    assert lives_lost == 4 and total > 0
    ((score, game_steps),) = finished_games([env])
    # Every life's reward; the steps also count the resets' presses: FIRE and 2 at the start,
    # then a no-op, FIRE and 2 after each lost life.
    assert score == total and game_steps == steps + 2 + 3 * lives_lost
    assert finished_games([env]) == []  # taken once
    env.reset()
    for _ in range(20):
        env.step(1)
    force_real_reset(env)  # as the test process does at a stall: the game is cut short
    env.reset(seed=4)
    steps_until_done(env)  # a lost life is no game's end either
    assert finished_games([env]) == []


def test_a_vector_games_score_is_its_episodes_reward(config):
    env = make_env(EnvSpec("CartPole-v1", {}))
    env.reset(seed=0)
    steps = 0
    while True:
        _, _, terminated, truncated, _ = env.step(0)
        steps += 1
        if terminated or truncated:
            break
    assert finished_games([env]) == [(float(steps), steps)]


# -- fire reset --------------------------------------------------------------------------------


def test_fire_reset_presses_fire_then_2_after_reset(config):
    rec = Recorder(gym.make("BreakoutNoFrameskip-v4"))
    env = FireResetEnv(rec)
    env.reset(seed=0)
    assert rec.actions == [1, 2]
    full = make_env(EnvSpec("BreakoutNoFrameskip-v4", env_config(config, "BreakoutNoFrameskip-v4")))
    assert FireResetEnv in wrapper_types(full)
    # Ms. Pac-Man has no FIRE action: no fire reset.
    assert FireResetEnv not in wrapper_types(
        make_env(EnvSpec("MsPacmanNoFrameskip-v4", env_config(config, "MsPacmanNoFrameskip-v4")))
    )


# -- rescale -----------------------------------------------------------------------------------


def hand_processed(frame: np.ndarray, crop1: int) -> np.ndarray:
    """Rows crop1:crop1+160 of a 160-wide frame, 2x2 block means, then the gray formula."""
    crop = frame[crop1 : crop1 + 160, :160].astype(np.float64)
    blocks = crop.reshape(80, 2, 80, 2, 3).mean(axis=(1, 3))
    gray = 0.2989 * blocks[..., 0] + 0.587 * blocks[..., 1] + 0.114 * blocks[..., 2]
    return gray.reshape(1, 80, 80)


def test_rescale_matches_a_frame_computed_by_hand(config):
    env = gym.make("PongNoFrameskip-v4")
    env.reset(seed=0)
    for _ in range(80):
        frame = env.step(2)[0]
    conf = env_config(config, "PongNoFrameskip-v4")
    out = process_frame(frame, conf)
    assert out.shape == (1, 80, 80) and out.dtype == np.float32
    # cv2 rounds the area average to uint8 before the gray step: at most 0.5 per channel.
    np.testing.assert_allclose(out, hand_processed(frame, 34), atol=0.51)
    # A different crop gives a clearly different frame: the crop really applies.
    assert np.abs(out - hand_processed(frame, 10)).max() > 20
    # Non-square crops (Asteroids keeps 178 rows) still give 80x80.
    assert process_frame(frame, {"crop1": 16, "crop2": 34, "dimension2": 94}).shape == (1, 80, 80)


# -- normalisation -----------------------------------------------------------------------------


def test_normaliser_statistics_after_n_frames(config):
    conf = env_config(config, "PongNoFrameskip-v4")
    inner = gym.make("PongNoFrameskip-v4")
    rec = Recorder(AtariRescale(inner, conf))
    env = NormalizedEnv(rec)
    obs, _ = env.reset(seed=5)
    outputs = [obs]
    for step in range(60):
        outputs.append(env.step(step % 6)[0])
    alpha, mean, std = 0.9999, 0.0, 0.0
    for t, frame in enumerate(rec.frames, start=1):
        mean = alpha * mean + (1 - alpha) * float(frame.mean())
        std = alpha * std + (1 - alpha) * float(frame.std())
        corr = 1 - alpha**t
        expected = (frame - mean / corr) / (std / corr + 1e-8)
        np.testing.assert_allclose(outputs[t - 1], expected, rtol=1e-4, atol=1e-4)
    assert env.num_steps == 61
    assert env.state_mean == pytest.approx(mean, rel=1e-9)
    assert env.state_std == pytest.approx(std, rel=1e-9)
    # The statistics round-trip for checkpoints.
    other = NormalizedEnv(AtariRescale(gym.make("PongNoFrameskip-v4"), conf))
    other.load_state_dict(env.state_dict())
    assert other.state_dict() == env.state_dict()
    pong = make_env(EnvSpec("PongNoFrameskip-v4", env_config(config, "PongNoFrameskip-v4")))
    assert find_wrapper(pong, NormalizedEnv) is not None


# -- time limit --------------------------------------------------------------------------------


def test_time_limit_binds_in_agent_steps(config):
    env = make_env(
        EnvSpec(
            "PongNoFrameskip-v4", env_config(config, "PongNoFrameskip-v4"), max_episode_length=50
        )
    )
    env.reset(seed=0)
    steps, terminated, truncated = steps_until_done(env)
    assert truncated and not terminated
    assert ale(env).getEpisodeFrameNumber() == 50 * 4
    assert steps < 50  # no-ops and FIRE at reset count towards the game's limit
    assert was_real_done(env)


def test_time_limit_binds_for_v5_ids(config):
    env = make_env(EnvSpec("ALE/Pong-v5", env_config(config, "ALE/Pong-v5"), max_episode_length=30))
    env.reset(seed=0)
    steps, _, truncated = steps_until_done(env)
    assert truncated and steps == 30 - 2  # FIRE and action 2 at reset are steps too


def test_long_limits_lift_ales_own_frame_cap(config):
    env = make_env(
        EnvSpec(
            "PongNoFrameskip-v4",
            env_config(config, "PongNoFrameskip-v4"),
            max_episode_length=40_000,
        )
    )
    assert ale(env).getInt("max_num_frames_per_episode") == 160_000
    env = make_env(EnvSpec("PongNoFrameskip-v4", env_config(config, "PongNoFrameskip-v4")))
    assert ale(env).getInt("max_num_frames_per_episode") == 108_000


# -- sticky actions and the protocol ------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_id", "requested", "in_ale"),
    [
        ("PongNoFrameskip-v4", None, 0.0),
        ("PongNoFrameskip-v4", 0.25, 0.25),
        ("BreakoutNoFrameskip-v4", 0.25, 0.25),
        ("ALE/Pong-v5", None, 0.25),
        ("ALE/Pong-v5", 0.0, 0.0),
    ],
)
def test_repeat_action_probability_reaches_ale(config, env_id, requested, in_ale):
    env = make_env(EnvSpec(env_id, env_config(config, env_id), repeat_action_probability=requested))
    assert ale(env).getFloat("repeat_action_probability") == pytest.approx(in_ale)
    assert protocol(env_id, 4, 10000, requested)["repeat_action_probability"] == in_ale


def test_sticky_actions_repeat_the_previous_action(config):
    # With probability 1 ALE never takes the agent's action (it repeats the reset's NOOP), so
    # the screens do not depend on the actions; with 0 they do.
    def screens(env_id, p, actions):
        env = make_env(EnvSpec(env_id, env_config(config, env_id), repeat_action_probability=p))
        obs, _ = env.reset(seed=3)
        frames = [obs]
        for action in actions:
            frames.append(env.step(action)[0])
        return np.stack(frames)

    ups, downs = [2] * 40, [3] * 40
    assert np.array_equal(
        screens("PongNoFrameskip-v4", 1.0, ups), screens("PongNoFrameskip-v4", 1.0, downs)
    )
    assert not np.array_equal(
        screens("PongNoFrameskip-v4", 0.0, ups), screens("PongNoFrameskip-v4", 0.0, downs)
    )


def test_protocol_says_how_games_are_played():
    assert protocol("PongNoFrameskip-v4", 4, 10000) == {
        "env": "PongNoFrameskip-v4",
        "repeat_action_probability": 0.0,
        "frame_skip": 4,
        "max_pool_frames": True,
        "noop_starts": 30,
        "episode_cap_steps": 10000,
    }
    v5 = protocol("ALE/Pong-v5", 3, 500)
    assert v5["frame_skip"] == 4 and v5["max_pool_frames"] is False and v5["noop_starts"] == 0
    assert v5["repeat_action_probability"] == 0.25 and v5["episode_cap_steps"] == 500
    assert protocol("Pong-v0", 4, 10000)["frame_skip"] == [2, 4]  # ALE draws 2..4
    assert protocol("CartPole-v1", 4, 200) == {"env": "CartPole-v1", "episode_cap_steps": 200}
    # --max-episode-length only shortens a non-ALE env's own limit: CartPole's 500 stays.
    assert protocol("CartPole-v1", 4, 10000)["episode_cap_steps"] == 500
    assert protocol("PongNoFrameskip-v4", 4, 10000, stall_steps=2000)["stall_steps"] == 2000


def test_an_episode_cap_past_what_ale_counts_is_refused_for_the_ids_own_skip():
    # --max-episode-length x the frames a step takes: ALE/Pong-v5 skips 4 itself.
    with pytest.raises(UsageError, match="--max-episode-length 536870911 or less"):
        parse_train_args(["--env", "ALE/Pong-v5", "--max-episode-length", "600000000"])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf")])
def test_bad_repeat_action_probability_is_rejected(config, bad):
    with pytest.raises(UsageError, match="--repeat-action-probability must be in \\[0, 1\\], got"):
        parse_train_args(["--repeat-action-probability", str(bad)])


def test_repeat_action_probability_outside_atari_is_refused(config):
    with pytest.raises(UsageError, match="applies to ALE games only, and 'CartPole-v1' is not"):
        parse_train_args(["--env", "CartPole-v1", "--repeat-action-probability", "0.1"])


# -- vector envs -------------------------------------------------------------------------------


def test_vector_env_has_no_image_wrappers(config):
    env = make_env(EnvSpec("CartPole-v1", env_config(config, "CartPole-v1")))
    assert not {AtariRescale, NormalizedEnv, EpisodicLifeEnv} & set(wrapper_types(env))
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4,)
    steps = 0
    while True:
        steps += 1
        if any(env.step(steps % 2)[2:4]):
            break
    assert was_real_done(env)
    assert make_env(
        EnvSpec("Acrobot-v1", env_config(config, "Acrobot-v1"))
    ).observation_space.shape == (6,)


def test_vector_env_time_limits(config):
    # CartPole keeps its own 500-step limit under the default --max-episode-length 10000 ...
    env = vector_env(EnvSpec("CartPole-v1"))
    assert env.get_wrapper_attr("_max_episode_steps") == 500
    # ... and a shorter one binds.
    env = vector_env(EnvSpec("CartPole-v1", max_episode_length=5))
    env.reset(seed=0)
    results = [env.step(0) for _ in range(5)]
    assert results[-1][3] or results[-1][2]


def test_vector_obs_norm_is_optional(config):
    plain = vector_env(EnvSpec("CartPole-v1"))
    normed = vector_env(EnvSpec("CartPole-v1", vector_obs_norm=True))
    assert gym.wrappers.NormalizeObservation not in wrapper_types(plain)
    assert gym.wrappers.NormalizeObservation in wrapper_types(normed)


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_id_suggests_close_ids(config):
    with pytest.raises(UsageError, match="unknown env id 'PongNoFrameSkip-v4'.*PongNoFrameskip-v4"):
        make_env(EnvSpec("PongNoFrameSkip-v4", env_config(config, "PongNoFrameSkip-v4")))


@pytest.mark.parametrize(
    ("builder", "env_id", "message"),
    [
        ("vector", "Pendulum-v1", "Discrete actions"),
        ("vector", "FrozenLake-v1", "flat vector observations"),
    ],
)
def test_wrong_kind_of_env_is_rejected(config, builder, env_id, message):
    with pytest.raises(UsageError, match=message):
        if builder == "atari":
            atari_env(EnvSpec(env_id, config["Default"]))
        else:
            vector_env(EnvSpec(env_id))


def test_bad_limits_are_rejected(config):
    # Both at once, a line each: every problem is said before anything starts.
    with pytest.raises(UsageError) as refused:
        parse_train_args(["--max-episode-length", "0", "--skip-rate", "-2"])
    assert str(refused.value).splitlines() == [
        "--max-episode-length must be at least 1, got 0",
        "--skip-rate must be at least 1, got -2",
    ]


# -- config.json ---------------------------------------------------------------------------------


# The original's config.json, entry by entry (crop1, crop2, dimension2).
ORIGINAL_CROPS = {
    "Default": (34, 34, 80),
    "Asteroids": (16, 34, 94),
    "BeamRider": (20, 20, 80),
    "Breakout": (34, 34, 80),
    "Centipede": (36, 56, 90),
    "MsPacman": (2, 10, 84),
    "Pong": (34, 34, 80),
    "Seaquest": (30, 30, 80),
    "SpaceInvaders": (8, 36, 94),
    "VideoPinball": (42, 60, 89),
    "Qbert": (12, 40, 94),
    "Boxing": (30, 30, 80),
}


def test_repository_config_has_the_original_entries(config):
    assert list(config) == list(ORIGINAL_CROPS)  # order matters: the last matching key wins
    for game, (crop1, crop2, dimension2) in ORIGINAL_CROPS.items():
        assert config[game] == {"crop1": crop1, "crop2": crop2, "dimension2": dimension2}, game


def test_env_config_matches_substrings_else_default(config):
    assert env_config(config, "PongNoFrameskip-v4") is config["Pong"]
    assert env_config(config, "ALE/SpaceInvaders-v5") is config["SpaceInvaders"]
    assert env_config(config, "TennisNoFrameskip-v4") is config["Default"]
    # The last matching key in file order wins, as in the original.
    both = {"Default": config["Default"], "Pong": {"crop1": 1}, "NoFrameskip": {"crop1": 2}}
    assert env_config(both, "PongNoFrameskip-v4") == {"crop1": 2}


def test_an_episode_cap_the_resets_no_ops_can_use_up_is_warned_of():
    warned = short_episode_warning(protocol("PongNoFrameskip-v4", 4, 9))
    assert warned == (
        "--max-episode-length 9 is 36 frames, which the reset's 1-30 random no-op frames and "
        "FIRE (counted, as in the original) can use up before the agent acts; give 10 or more"
    )
    assert short_episode_warning(protocol("PongNoFrameskip-v4", 4, 10)) is None
    assert "give 33 or more" in short_episode_warning(protocol("PongNoFrameskip-v4", 1, 32))
    assert short_episode_warning(protocol("ALE/Pong-v5", 4, 5)) is None  # no no-op starts
    assert short_episode_warning(protocol("CartPole-v1", 4, 5)) is None


def test_crop_settings_are_read_for_ale_games_only(tmp_path, config):
    """A missing or unrelated config.json (another project's, in the current folder) stops
    no CartPole run: only ALE games crop."""

    def crop(path, env_id):
        return EnvSpec.of(parse_train_args(["--env", env_id, "--env-config", str(path)])).crop

    unrelated = tmp_path / "config.json"
    unrelated.write_text('{"name": "my web app"}')
    for path in (unrelated, tmp_path / "missing.json"):
        assert crop(path, "CartPole-v1") == {}
        with pytest.raises(UsageError, match="--env-config"):
            crop(path, "PongNoFrameskip-v4")
    assert crop(ROOT / "config.json", "PongNoFrameskip-v4") == config["Pong"]
    pong = parse_train_args(["--env-config", str(unrelated)])
    unknown = dataclasses.replace(pong, env="PongNoFrameSkip-v4")  # past the flags' check
    with pytest.raises(UsageError, match="PongNoFrameSkip-v4"):  # the id first, then its file
        EnvSpec.of(unknown)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"is not valid JSON \(line 1"),
        ("[1, 2]", 'must hold a JSON object of game entries with a "Default" one'),
        ('{"Pong": {"crop1": 34, "crop2": 34, "dimension2": 80}}', 'with a "Default" one'),
        ('{"Default": {"crop1": 34}}', r"needs integers crop1 and crop2, got \{'crop1': 34\}"),
        ('{"Default": {"crop1": "34", "crop2": 34, "dimension2": 80}}', "integers crop1"),
        ('{"Default": {"crop1": true, "crop2": 34}}', "integers crop1"),
        ('{"Default": {"crop1": 200, "crop2": 0, "dimension2": 80}}', "which is empty"),
        ('{"Default": 5}', "entry 'Default' needs integers crop1 and crop2, got 5"),
    ],
)
def test_malformed_config_is_rejected_with_the_reason(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        read_config(path)


def test_a_config_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "Pong.dat"
    path.write_bytes(b"PK\x03\x04\x80\xff")  # a checkpoint given as --env-config
    with pytest.raises(UsageError, match=r"Pong\.dat' is not a text file; pass --env-config"):
        read_config(path)


def test_missing_config_names_the_path_and_the_flag(tmp_path):
    with pytest.raises(UsageError, match=r"nope\.json' not found; pass --env-config"):
        read_config(tmp_path / "nope.json")


def test_the_default_config_is_found_beside_the_code_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_config("config.json") == read_config(ROOT / "config.json")
    (tmp_path / "config.json").write_text('{"Default": {"crop1": 30, "crop2": 30}}')
    assert read_config("config.json") == {"Default": {"crop1": 30, "crop2": 30}}  # the user's own


def test_config_round_trips_through_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(json.loads((ROOT / "config.json").read_text())))
    assert read_config(path) == read_config(ROOT / "config.json")


def test_an_entry_without_the_unread_dimension2_is_accepted(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"Default": {"crop1": 34, "crop2": 34}, "Pong": {"crop1": 30, "crop2": 30}}')
    assert env_config(read_config(path), "PongNoFrameskip-v4") == {"crop1": 30, "crop2": 30}
