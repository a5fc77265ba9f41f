"""Environments: config.json, the original A3G Atari wrapper stack on gymnasium 1.x, vector envs.

Every process builds its envs from one `EnvSpec` with `make_env`, which registers the ALE games
first: spawned processes start with an empty gymnasium registry.
"""

from __future__ import annotations

import difflib
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, SupportsFloat

import cv2
import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import EnvSpec as RegisteredSpec

from utils import UsageError

ATARI_ENTRY_POINT = "ale_py.env:AtariEnv"
MAX_EPISODE_FRAMES = 2**31 - 1
"""ALE takes the episode cap in raw frames as a 32-bit int (``max_num_frames_per_episode``)."""
ALE_DEFAULT_MAX_FRAMES = 108_000
"""ALE cuts every episode at this many raw frames unless told otherwise."""
NOOP_MAX = 30
GRAY_WEIGHTS = np.array([0.2989, 0.587, 0.114], dtype=np.float32)
FRAME_SIZE = 80

StepResult = tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]

FrameSkip = int | tuple[int, int]
"""Raw frames per agent step on NoFrameskip ids: a fixed count, or ``(low, high)``, drawn from
low..high (both included) at every step, as the original's ``-v0`` ids do."""


def skip_bounds(skip: FrameSkip) -> tuple[int, int]:
    """The fewest and the most raw frames one agent step takes under `skip`."""
    return (skip, skip) if isinstance(skip, int) else skip


def skip_from_flags(skip_rate: int, skip_rate_min: int | None) -> FrameSkip:
    """The skip ``--skip-rate`` and ``--skip-rate-min`` give: fixed, or ``(min, skip_rate)``."""
    return skip_rate if skip_rate_min in (None, skip_rate) else (skip_rate_min, skip_rate)


def skip_text(skip: FrameSkip) -> str:
    """`skip` as its flags give it: ``4``, or ``2-4`` for a random skip."""
    low, high = skip_bounds(skip)
    return str(high) if low == high else f"{low}-{high}"


# config.json: per-game crop settings


CONFIG_KEYS = ("crop1", "crop2")
"""Fields every `config.json` entry must hold (rows crop1:crop2+160 are kept); others are unread."""


DEFAULT_CONFIG = "config.json"
"""`--env-config`'s default: that file in the current folder, else the one beside this module."""


def read_config(path: str | Path) -> dict[str, dict[str, int]]:
    """Read and validate the per-game crop settings: game-name fragment -> entry, with "Default".

    Raises:
        UsageError: the file is missing, is not JSON, or an entry is malformed.
    """
    path = Path(path)
    if path == Path(DEFAULT_CONFIG) and not path.exists():
        path = Path(__file__).with_name(DEFAULT_CONFIG)
    where = f"env config {str(path)!r}"
    fix = "pass --env-config with the path of the project's config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{where} not found; {fix}") from None
    except OSError as err:
        raise UsageError(f"{where} cannot be read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where} is not a text file; {fix}") from None
    except json.JSONDecodeError as err:
        raise UsageError(
            f"{where} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); {fix}"
        ) from None
    if not isinstance(config, dict) or "Default" not in config:
        raise UsageError(
            f'{where} must hold a JSON object of game entries with a "Default" one, such as '
            f'"Default": {{"crop1": 34, "crop2": 34}}; {fix}'
        )
    for name, entry in config.items():
        crops = [entry.get(key) if isinstance(entry, dict) else None for key in CONFIG_KEYS]
        if not all(type(crop) is int for crop in crops):
            raise UsageError(
                f"{where}: entry {name!r} needs integers crop1 and crop2, got {entry!r}"
            )
        # Rows past the 210-row screen are clipped (the original's VideoPinball entry ends at
        # row 220), so only an empty crop is an error.
        if not 0 <= crops[0] < min(crops[1] + 160, 210):
            raise UsageError(
                f"{where}: entry {name!r} keeps rows {crops[0]}:{crops[1] + 160} of the 210-row "
                "screen, which is empty; use 0 <= crop1 < min(crop2 + 160, 210)"
            )
    return config


def env_config(config: dict[str, dict[str, int]], env_id: str) -> dict[str, int]:
    """Pick the entry of `config` for `env_id`.

    As in the original, an entry applies when its key is a substring of the id, and the last
    such key in file order wins; with no match the ``"Default"`` entry is used.
    """
    chosen = config["Default"]
    for key, entry in config.items():
        if key != "Default" and key in env_id:
            chosen = entry
    return chosen


def register_games() -> None:
    """Register the ALE games with gymnasium (once per process) and silence ALE's banner."""
    import ale_py

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    gym.register_envs(ale_py)


def lookup_spec(env_id: str) -> RegisteredSpec:
    """Return the registered spec of `env_id`.

    Raises:
        UsageError: the id is unknown; the message suggests close registered ids.
    """
    register_games()
    try:
        return gym.spec(env_id)
    except gym.error.Error:
        close = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=3, cutoff=0.6)
        # A game's bare name (any case): the id A3G trains on first.
        wanted = f"{env_id}NoFrameskip-v4".lower()
        ours = [name for name in gym.registry if name.lower() == wanted]
        close = [*ours, *(c for c in close if c not in ours)][:3]
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. PongNoFrameskip-v4"
        raise UsageError(f"unknown env id {env_id!r}; {hint}") from None


def is_atari(env_id: str) -> bool:
    """Whether `env_id` is an ALE game (raises UsageError for an unknown id)."""
    return lookup_spec(env_id).entry_point == ATARI_ENTRY_POINT


def sticky_probability(env_id: str, requested: float | None = None) -> float:
    """The probability that ALE repeats the previous action instead of the agent's (sticky actions).

    `requested` None keeps the id's own: 0 for ``*NoFrameskip-v4``, 0.25 for ``ALE/*-v5``.
    """
    if requested is not None:
        return requested
    return float(lookup_spec(env_id).kwargs.get("repeat_action_probability", 0.25))


def protocol(
    env_id: str,
    skip_rate: FrameSkip,
    max_episode_length: int,
    repeat_action_probability: float | None = None,
    stall_steps: int = 0,
) -> dict[str, Any]:
    """How games are played, for every result that gives a score: the evaluation protocol.

    Scores on one game differ a lot between protocols, so a number means something only with
    these beside it. ``frame_skip`` is ``[low, high]`` for a random skip; outside Atari only
    ``env`` and ``episode_cap_steps`` are given.
    """
    spec = lookup_spec(env_id)
    stall = {"stall_steps": stall_steps} if stall_steps else {}
    if spec.entry_point != ATARI_ENTRY_POINT:
        cap = vector_episode_cap(spec, max_episode_length)
        return {"env": env_id, "episode_cap_steps": cap, **stall}
    low, high = step_frames(env_id, skip_rate)
    we_skip = spec.kwargs.get("frameskip", 1) == 1
    skip: int | list[int] = high if low == high else [low, high]
    return {
        "env": env_id,
        "repeat_action_probability": sticky_probability(env_id, repeat_action_probability),
        "frame_skip": skip,
        "max_pool_frames": we_skip,
        "noop_starts": NOOP_MAX if we_skip else 0,
        "episode_cap_steps": max_episode_length,
        **stall,
    }


def short_episode_warning(played: dict[str, Any]) -> str | None:
    """What to warn where a `protocol`'s episode cap can cut games before the agent acts, or None.

    The cap is in raw frames (the most a step takes, for a random skip), and the reset's no-ops
    and FIRE count toward it, as in the original.
    """
    noops, cap = played.get("noop_starts", 0), played["episode_cap_steps"]
    skip = skip_bounds(played.get("frame_skip", 1))[1]  # a random skip's [low, high] too
    reset_frames = noops + 2 * skip  # the most no-ops, then FIRE and the step after it
    if not noops or cap * skip > reset_frames:
        return None
    return (
        f"--max-episode-length {cap} is {cap * skip} frames, which the reset's 1-{noops} random "
        "no-op frames and FIRE (counted, as in the original) can use up before the agent acts; "
        f"give {reset_frames // skip + 1} or more"
    )


def step_frames(env_id: str, skip_rate: FrameSkip) -> tuple[int, int]:
    """The fewest and the most raw frames one agent step of `env_id` takes ((1, 1) outside Atari).

    NoFrameskip ids skip as the flags say; the others skip in ALE, a fixed count or a random
    ``[low, high)`` (the old ``-v0`` ids: 2-4).
    """
    spec = lookup_spec(env_id)
    if spec.entry_point != ATARI_ENTRY_POINT:
        return 1, 1
    ale_skip = spec.kwargs.get("frameskip", 1)
    if ale_skip == 1:
        return skip_bounds(skip_rate)
    return (ale_skip[0], ale_skip[1] - 1) if isinstance(ale_skip, tuple) else (ale_skip, ale_skip)


def episode_frames(env_id: str, max_episode_length: int, skip_rate: FrameSkip) -> tuple[int, int]:
    """The most raw frames an episode of `env_id` can take, and the most one agent step takes.

    ALE takes the cap in raw frames: ``--max-episode-length`` times the top of the skip's
    range. (0, 1) outside Atari.
    """
    if not is_atari(env_id):
        return 0, 1
    high = step_frames(env_id, skip_rate)[1]
    return max_episode_length * high, high


def saved_frame_skip(saved: dict[str, Any], default: int) -> FrameSkip:
    """The skip a run record's or training state's ``config`` played (`default` if unsaid)."""
    return skip_from_flags(saved.get("skip_rate", default), saved.get("skip_rate_min"))


def skip_flags(skip: FrameSkip) -> str:
    """The flags that give `skip`: ``--skip-rate 4``, plus ``--skip-rate-min 2`` if random."""
    low, high = skip_bounds(skip)
    return f"--skip-rate {high}" + ("" if low == high else f" --skip-rate-min {low}")


def frames_per_step(env_id: str, skip_rate: FrameSkip) -> float:
    """Raw emulator frames behind one agent step, on average (1 outside Atari).

    A random skip gives the middle of its range (3 for 2-4, and for the old ``-v0`` ids).
    """
    low, high = step_frames(env_id, skip_rate)
    return high if low == high else (low + high) / 2


# Atari wrappers, innermost first


class NoopResetEnv(gym.Wrapper):
    """After each reset, play 1..noop_max no-ops, so a deterministic game opens differently."""

    def __init__(self, env: gym.Env, noop_max: int = NOOP_MAX):
        super().__init__(env)
        self.noop_max = noop_max
        self.last_noops = 0

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Reset, then step action 0 a random 1..noop_max times."""
        obs, info = self.env.reset(**kwargs)
        self.last_noops = int(self.unwrapped.np_random.integers(1, self.noop_max + 1))
        for _ in range(self.last_noops):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class MaxAndSkipEnv(gym.Wrapper):
    """Repeat each action `skip` times, sum the rewards, max-pool the last frames.

    Atari sprites flicker; the max of the window's last 3 raw frames shows them all. A random
    skip ``(low, high)`` draws each step's count with the game's own seeded generator.
    """

    def __init__(self, env: gym.Env, skip: FrameSkip = 4):
        super().__init__(env)
        self.skip_low, self.skip = skip_bounds(skip)
        self._frames: deque[np.ndarray] = deque(maxlen=3)

    def step(self, action: Any) -> StepResult:
        """Play `action` for up to `skip` raw frames (fewer when the episode ends)."""
        self._frames.clear()
        total_reward = 0.0
        terminated = truncated = False
        info: dict[str, Any] = {}
        frames = self.skip
        if self.skip_low != self.skip:
            frames = int(self.unwrapped.np_random.integers(self.skip_low, self.skip + 1))
        for _ in range(frames):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self._frames.append(obs)
            total_reward += float(reward)
            if terminated or truncated:
                break
        return self._max_frame(), total_reward, terminated, truncated, info

    def _max_frame(self) -> np.ndarray:
        """The element-wise max of the frames kept, in place (faster than np.stack then max)."""
        frames = iter(self._frames)
        frame = next(frames)
        if len(self._frames) == 1:
            return frame
        frame = np.maximum(frame, next(frames))
        for other in frames:
            np.maximum(frame, other, out=frame)
        return frame


class EpisodicLifeEnv(gym.Wrapper):
    """Losing a life ends the training episode; the game itself resets only at game over.

    Bootstrapping then treats a life loss as terminal, which helps learning. The real game
    over is in `was_real_done` (reach it with `was_real_done(env)`).
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.lives = 0
        self.was_real_done = True
        self.games = 0  # real resets so far: a lost life's reset that started a new game shows

    def step(self, action: Any) -> StepResult:
        """Step, ending the episode early when a life is lost."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.was_real_done = terminated or truncated
        lives = self.unwrapped.ale.lives()
        # Some games (Qbert) show lives == 0 for a few frames before the real game over, so
        # only a drop to a positive count is a life loss.
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Reset the game after a real game over; after a lost life just step a no-op."""
        if self.was_real_done:
            obs, info = self.env.reset(**kwargs)
            self.games += 1
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:  # the time limit fell on the no-op: a new game
                obs, info = self.env.reset(**kwargs)
                self.games += 1
        self.was_real_done = False
        self.lives = self.unwrapped.ale.lives()
        return obs, info


class GameScore(gym.Wrapper):
    """Adds up each game's raw reward over all its lives and keeps the finished games.

    Below `EpisodicLifeEnv` it sees every step of a game and only the real resets. A game a
    real reset cuts short is not kept. Workers send the finished games on (`finished_games`).
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.score = 0.0
        self.steps = 0
        self.finished: list[tuple[float, int]] = []  # (score, steps) of each finished game

    def step(self, action: Any) -> StepResult:
        """Step, adding the reward; at the game's end keep its score and steps."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.score += float(reward)
        self.steps += 1
        if terminated or truncated:
            self.finished.append((self.score, self.steps))
            self.score, self.steps = 0.0, 0
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """A real reset: a new game starts at 0."""
        self.score, self.steps = 0.0, 0
        return self.env.reset(**kwargs)


def finished_games(envs: list[gym.Env]) -> list[tuple[float, int]]:
    """The (score, steps) of the games the envs finished since the last call, then forgotten."""
    games = []
    for env in envs:
        score = find_wrapper(env, GameScore)
        games.extend(score.finished)
        score.finished = []
    return games


class FireResetEnv(gym.Wrapper):
    """Press FIRE (action 1) then action 2 after every reset: some games wait for FIRE."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Reset, then play actions 1 and 2, resetting again if either ends the episode."""
        self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self.env.step(1)
        if terminated or truncated:
            self.env.reset()
        obs, _, terminated, truncated, info = self.env.step(2)
        if terminated or truncated:
            obs, info = self.env.reset()
        return obs, info


def process_frame(frame: np.ndarray, conf: dict[str, int]) -> np.ndarray:
    """Crop, shrink and gray one RGB Atari frame to a (1, 80, 80) float32 array in [0, 255].

    Keeps rows ``crop1 : crop2 + 160`` and the first 160 columns, with area averaging.
    """
    frame = frame[conf["crop1"] : conf["crop2"] + 160, :160]
    small = cv2.resize(frame, (FRAME_SIZE, FRAME_SIZE), interpolation=cv2.INTER_AREA)
    return (small.astype(np.float32) @ GRAY_WEIGHTS).reshape(1, FRAME_SIZE, FRAME_SIZE)


class AtariRescale(gym.ObservationWrapper):
    """Turn RGB screens into (1, 80, 80) float32 frames with `process_frame`."""

    def __init__(self, env: gym.Env, env_conf: dict[str, int]):
        super().__init__(env)
        self.conf = env_conf
        self.observation_space = gym.spaces.Box(
            0.0, 255.0, (1, FRAME_SIZE, FRAME_SIZE), dtype=np.float32
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """Process one screen."""
        return process_frame(observation, self.conf)


class NormalizedEnv(gym.ObservationWrapper):
    """Standardise frames with running averages of each frame's mean and std.

    The averages are bias-corrected by ``1 - alpha**t`` as in Adam.
    """

    def __init__(self, env: gym.Env, alpha: float = 0.9999):
        super().__init__(env)
        self.alpha = alpha
        self.state_mean = 0.0
        self.state_std = 0.0
        self.num_steps = 0
        self.observation_space = gym.spaces.Box(
            -np.inf, np.inf, env.observation_space.shape, dtype=np.float32
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """Update the running statistics with this frame and return it standardised."""
        self.num_steps += 1
        alpha = self.alpha
        self.state_mean = self.state_mean * alpha + float(observation.mean()) * (1 - alpha)
        self.state_std = self.state_std * alpha + float(observation.std()) * (1 - alpha)
        correction = 1 - alpha**self.num_steps
        mean = self.state_mean / correction
        std = self.state_std / correction
        return ((observation - mean) / (std + 1e-8)).astype(np.float32)

    def state_dict(self) -> dict[str, float]:
        """The running statistics, for a checkpoint."""
        return {key: getattr(self, key) for key in ("state_mean", "state_std", "num_steps")}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue from statistics saved by `state_dict`."""
        self.state_mean = float(state["state_mean"])
        self.state_std = float(state["state_std"])
        self.num_steps = int(state["num_steps"])


# Builders


@dataclass(frozen=True)
class EnvSpec:
    """How every env of a run is built: made once from the configuration, given to each process.

    `crop` is the game's `config.json` entry (empty outside Atari); a None
    `repeat_action_probability` keeps the id's own.
    """

    env_id: str
    crop: dict[str, int] = field(default_factory=dict)
    max_episode_length: int = 10000
    skip_rate: FrameSkip = 4
    vector_obs_norm: bool = False
    repeat_action_probability: float | None = None

    @classmethod
    def of(cls, config: Any) -> EnvSpec:
        """The spec of a `cli` configuration; reads ``--env-config`` (once, here) for ALE games."""
        atari = is_atari(config.env)
        crop = env_config(read_config(config.env_config), config.env) if atari else {}
        return cls(
            config.env, crop, config.max_episode_length, config.frame_skip,
            config.vector_obs_norm, config.repeat_action_probability,
        )  # fmt: skip


def make_env(spec: EnvSpec, render_mode: str | None = None) -> gym.Env:
    """Build `spec`'s env: the Atari stack for ALE games, `vector_env` otherwise.

    Raises:
        UsageError: `vector_env`'s: a missing package, or spaces A3G cannot use.
    """
    build = atari_env if is_atari(spec.env_id) else vector_env
    return build(spec, render_mode)


def atari_env(spec: EnvSpec, render_mode: str | None = None) -> gym.Env:
    """Build an ALE game with the original A3G wrapper stack.

    For ``*NoFrameskip*`` ids: a raw-frame time limit, no-op reset, max-and-skip, game score,
    episodic life, fire reset, rescale, normalise. Where ALE skips frames itself
    (``ALE/*-v5``) an agent-step time limit replaces the first three. The spec's values are
    taken as `validate` passed them.
    """
    env_id, length, skip = spec.env_id, spec.max_episode_length, spec.skip_rate
    registered = lookup_spec(env_id).kwargs
    low, high = skip_bounds(skip)
    we_skip = registered.get("frameskip", 1) == 1
    # Raised past ALE's own cap, which would otherwise end episodes before ours does.
    max_frames = max(episode_frames(env_id, length, skip)[0], ALE_DEFAULT_MAX_FRAMES)
    env = gym.make(
        env_id,
        render_mode=render_mode,
        repeat_action_probability=sticky_probability(env_id, spec.repeat_action_probability),
        max_num_frames_per_episode=max_frames,
    )
    if we_skip:
        env = gym.wrappers.TimeLimit(env, length * high)
        env = MaxAndSkipEnv(NoopResetEnv(env, NOOP_MAX), skip)
    if not we_skip or low != high:  # a random skip: the frame cap alone allows more agent steps
        env = gym.wrappers.TimeLimit(env, length)
    env = EpisodicLifeEnv(GameScore(env))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireResetEnv(env)
    env = AtariRescale(env, spec.crop)
    return NormalizedEnv(env)


def vector_episode_cap(spec: RegisteredSpec, max_episode_length: int) -> int:
    """Agent steps before a non-Atari game is cut: `max_episode_length` only shortens its own."""
    own = spec.max_episode_steps
    return max_episode_length if own is None else min(own, max_episode_length)


def vector_env(spec: EnvSpec, render_mode: str | None = None) -> gym.Env:
    """Build a gymnasium env with flat vector observations and discrete actions.

    With `vector_obs_norm` observations are standardised per feature by running statistics.

    Raises:
        UsageError: a package the env needs is missing, or spaces A3G cannot use.
    """
    env_id = spec.env_id
    try:
        env = gym.make(env_id, render_mode=render_mode)
    except gym.error.DependencyNotInstalled as err:
        raise UsageError(f"{env_id!r} needs a package that is not installed: {err}") from None
    obs_space, act_space = env.observation_space, env.action_space
    flat = isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1
    if not (flat and isinstance(act_space, gym.spaces.Discrete)):
        env.close()
        raise UsageError(
            f"{env_id!r} has observations {obs_space} and actions {act_space}; outside Atari, "
            "A3G takes flat vector observations and Discrete actions (e.g. CartPole-v1)"
        )
    registered = lookup_spec(env_id)
    cap = vector_episode_cap(registered, spec.max_episode_length)
    if cap != registered.max_episode_steps:
        env = gym.wrappers.TimeLimit(env, cap)
    if spec.vector_obs_norm:
        env = gym.wrappers.NormalizeObservation(env)
    return GameScore(env)


def was_real_done(env: gym.Env) -> bool:
    """Whether the last episode end was a real game over (always true outside Atari)."""
    life = find_wrapper(env, EpisodicLifeEnv)
    return life is None or bool(life.was_real_done)


def find_wrapper(env: gym.Env, kind: type[gym.Wrapper]) -> Any:
    """The outermost wrapper of type `kind` around `env`, if there is one."""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, kind):
            return env
        env = env.env
    return None


def normalizer_state(env: gym.Env) -> dict[str, Any] | None:
    """The running statistics of the env's observation normaliser (None if it has none).

    Plain numbers and lists only, so a training-state file holding them loads with
    ``weights_only=True``.
    """
    norm = find_wrapper(env, NormalizedEnv)
    if norm is not None:
        return {"kind": "frames", **norm.state_dict()}
    vector = find_wrapper(env, gym.wrappers.NormalizeObservation)
    if vector is None:
        return None
    rms = vector.obs_rms
    return {
        "kind": "vector",
        "mean": np.asarray(rms.mean, dtype=np.float64).tolist(),
        "var": np.asarray(rms.var, dtype=np.float64).tolist(),
        "count": float(rms.count),
    }


def load_normalizer_state(env: gym.Env, state: dict[str, Any] | None) -> bool:
    """Continue the env's normaliser from `normalizer_state` output; False if they do not fit."""
    if not state:
        return False
    if state.get("kind") == "frames":
        norm = find_wrapper(env, NormalizedEnv)
        if norm is not None:
            norm.load_state_dict(state)
        return norm is not None
    vector = find_wrapper(env, gym.wrappers.NormalizeObservation)
    if vector is None or len(state["mean"]) != np.size(vector.obs_rms.mean):
        return False
    rms = vector.obs_rms
    rms.mean = np.asarray(state["mean"], dtype=rms.mean.dtype)
    rms.var = np.asarray(state["var"], dtype=rms.var.dtype)
    rms.count = float(state["count"])
    return True


def worker_normalizer_state(envs: list[gym.Env]) -> dict[str, Any] | None:
    """A worker's normaliser statistics: its one env's `normalizer_state`, or each of K envs'.

    K envs give ``{"kind": "per_env", "envs": [...]}``.
    """
    if len(envs) == 1:
        return normalizer_state(envs[0])
    return {"kind": "per_env", "envs": [normalizer_state(env) for env in envs]}


def load_worker_normalizer_state(envs: list[gym.Env], state: dict[str, Any] | None) -> None:
    """Continue a worker's envs from `worker_normalizer_state` output.

    A per-env state gives env k its own statistics; a single-env state goes to every env.
    """
    per_env = state["envs"] if state and state.get("kind") == "per_env" else [state] * len(envs)
    for env, env_state in zip(envs, per_env, strict=False):
        load_normalizer_state(env, env_state)
