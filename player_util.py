"""The acting agent: one model, K >= 1 envs, their LSTM states, and the rollout they record.

`Agent` plays K envs in lockstep and records a `Rollout` of (T, K) tensors for the loss, on
`ReferencePath` (the original's) or `FastPath`. Greedy play is `GreedyPlayer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from environment import EpisodicLifeEnv, find_wrapper, was_real_done
from fast_path import EncoderTape, act_recorded, replay_features, sequence_from_features
from model import ActorCriticLSTM


class NonFiniteError(ArithmeticError):
    """The policy came out NaN or inf (a broken observation or model); nothing was sampled."""


def sample_actions(
    logits: torch.Tensor, probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """One action per row from softmax(logits), with one host/device synchronisation a step.

    Sampling from NaN probabilities trips a device assert on CUDA, which ends the process's
    CUDA context, so a non-finite row is sampled from a uniform stand-in and the finiteness
    check comes back in the actions' transfer. `probs`, when given, saves a second softmax.
    Returns the actions as a (K, 1) tensor and as a list.

    Raises:
        NonFiniteError: a row held a NaN or inf (the env must not be stepped).
    """
    logits = logits.detach()
    finite = torch.isfinite(logits).all(1, keepdim=True)
    if probs is None:
        probs = F.softmax(torch.where(finite, logits, torch.zeros_like(logits)), dim=1)
    else:
        probs = torch.where(finite, probs.detach(), torch.ones_like(logits))
    actions = probs.multinomial(1)
    *taken, all_finite = torch.cat([actions.view(-1), finite.all().view(1).long()]).tolist()
    if not all_finite:
        raise NonFiniteError("the policy's logits hold a NaN or inf")
    return actions, taken


def forward(
    model: ActorCriticLSTM, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``model(x, hx, cx)``, with the encoder under bfloat16 autocast when `bf16`."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        features = model.encode(x)
    return model.forward_features(features.float(), hx, cx)


def policy_terms(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs, log_probs, entropy)`` of the policy: (K, A), (K, A) and (K,), with grad."""
    probs = F.softmax(logits, dim=1)
    log_probs = F.log_softmax(logits, dim=1)
    return probs, log_probs, -(log_probs * probs).sum(1)


# The rollout


@dataclass
class Rollout:
    """K envs' rollout, what the loss needs, as (T, K) tensors.

    Row t, column k is env k's step t; T is the longest of the K rollouts. An env whose
    episode ended early waited for the rest: `took` is false on its later rows, which the loss
    drops before any arithmetic. The rewards and flags stay on the CPU; `bootstrap` is the (K,)
    detached V after each env's last step, 0 where it ended its episode.
    """

    values: torch.Tensor
    log_probs: torch.Tensor
    entropies: torch.Tensor
    rewards: torch.Tensor
    took: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    bootstrap: torch.Tensor


class StepRecord:
    """The host side of a rollout: per step and env, what acting learned, in numpy arrays.

    Kept across rollouts, so recording a step allocates nothing; the arrays go to the device
    once per rollout (`to_device`).
    """

    FIELDS = ("actions", "rewards", "took", "terminated", "truncated")
    DTYPES = (np.int64, np.float32, np.bool_, np.bool_, np.bool_)

    def __init__(self, envs: int, capacity: int = 20):
        """Room for `capacity` steps of `envs` envs; empty."""
        self.length = 0
        self.arrays = {
            name: np.zeros((capacity, envs), dtype)
            for name, dtype in zip(self.FIELDS, self.DTYPES, strict=True)
        }

    def __getitem__(self, name: str) -> np.ndarray:
        """Field `name` of the steps recorded so far, shape (length, K)."""
        return self.arrays[name][: self.length]

    def next_step(self) -> dict[str, np.ndarray]:
        """Rows of the next step (zeroed) for the caller to fill; the record grows by one step."""
        capacity = self.arrays["took"].shape[0]
        if self.length == capacity:
            for name, array in self.arrays.items():
                self.arrays[name] = np.concatenate([array, np.zeros_like(array)])
        rows = {name: array[self.length] for name, array in self.arrays.items()}
        for row in rows.values():
            row[:] = 0
        self.length += 1
        return rows

    def clear(self) -> None:
        """Forget the recorded steps (keeps the arrays)."""
        self.length = 0

    def to_device(self, name: str, device: torch.device) -> torch.Tensor:
        """Field `name` as a (length, K) tensor on `device` (a copy: the record is reused)."""
        return torch.tensor(self[name], device=device)


# How a training step acts: the two paths


class ReferencePath:
    """The original's way: every step's forward with autograd; the rollout keeps T graphs."""

    def __init__(self, bf16: bool = False):
        """Encoder under bfloat16 autocast with `bf16` (``--precision bf16``)."""
        self.bf16 = bf16
        self._values: list[torch.Tensor] = []
        self._log_probs: list[torch.Tensor] = []
        self._entropies: list[torch.Tensor] = []

    def begin(self, hx: torch.Tensor, cx: torch.Tensor) -> None:
        """A new rollout starts from LSTM state (`hx`, `cx`)."""
        self._values, self._log_probs, self._entropies = [], [], []

    def act(
        self, model: ActorCriticLSTM, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Sample an action per row of `x` and keep the step's graph; return the LSTM state too.

        Raises:
            NonFiniteError: the policy is NaN or inf (nothing was recorded).
        """
        value, logits, hx, cx = forward(model, x, hx, cx, self.bf16)
        probs, log_probs, entropy = policy_terms(logits)
        action, taken = sample_actions(logits, probs)
        self._values.append(value.view(-1))
        self._log_probs.append(log_probs.gather(1, action).view(-1))
        self._entropies.append(entropy)
        return taken, hx, cx

    def loss_inputs(
        self, model: ActorCriticLSTM, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(values, log_probs, entropies)``, each (T, K) with grad: the steps' own graphs."""
        return torch.stack(self._values), torch.stack(self._log_probs), torch.stack(self._entropies)


class FastPath:
    """Act without autograd recording the encoder, then replay the rollout at once (`fast_path`)."""

    def __init__(self, bf16: bool = False):
        """Encoder under bfloat16 autocast with `bf16`; the tape records in bfloat16 then."""
        self.bf16 = bf16
        self.tape = EncoderTape()
        self._start: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self, hx: torch.Tensor, cx: torch.Tensor) -> None:
        """A new rollout starts from LSTM state (`hx`, `cx`): the replay starts there too."""
        self.tape.clear()
        self._start = (hx.detach(), cx.detach())

    @torch.no_grad()
    def act(
        self, model: ActorCriticLSTM, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Sample an action per row of `x`, without autograd, recording the encoder.

        Raises:
            NonFiniteError: the policy is NaN or inf.
        """
        _, logits, hx, cx = act_recorded(model, x, hx, cx, self.tape, self.bf16)
        _, taken = sample_actions(logits)
        return taken, hx, cx

    def loss_inputs(
        self, model: ActorCriticLSTM, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(values, log_probs, entropies)``, each (T, K) with grad, from the tape.

        The recorded features go through the fused LSTM from the rollout's starting state: the
        weights have not changed since acting, so the loss is the reference path's.
        """
        features = replay_features(model, self.tape, self.bf16)
        hx, cx = self._start
        steps, envs = actions.shape
        values, logits = sequence_from_features(model, features, hx, cx)
        _, log_probs, entropy = policy_terms(logits)
        log_prob = log_probs.gather(1, actions.reshape(-1, 1))  # step-major, as the tape
        return values.view(steps, envs), log_prob.view(steps, envs), entropy.view(steps, envs)


# The training agent


class Agent:
    """Plays K >= 1 envs in lockstep with one model and records their rollout for the loss.

    Each env plays its own rollout with its own LSTM state; one batched forward acts for all.
    An env whose episode ended waits, fed a blank frame, never its terminal one: a broken
    terminal observation cannot make the batch's policy NaN. Rewards are clipped to [-1, 1], as
    in the original, then scaled by `reward_scale`. A rollout is `start_rollout`,
    `play_rollout`, `rollout`.
    """

    def __init__(
        self,
        model: ActorCriticLSTM,
        envs: Sequence[gym.Env],
        device: torch.device | str = "cpu",
        reward_scale: float = 1.0,
        fast_path: bool = False,
        bf16: bool = False,
        bootstrap_truncated: bool = False,
    ):
        """Create the agent; call `reset` before acting."""
        self.model = model
        self.envs = list(envs)
        self.device = torch.device(device)
        self.reward_scale = reward_scale
        self.bootstrap_truncated = bootstrap_truncated
        self.path: ReferencePath | FastPath = FastPath(bf16) if fast_path else ReferencePath(bf16)
        self.record = StepRecord(len(self.envs))
        self.hx, self.cx = model.initial_state(len(self.envs), self.device)
        self.done = [True] * len(self.envs)
        self._obs: list[np.ndarray] = []
        self._blank: np.ndarray | None = None
        # Per env cut by a time limit in this rollout: its LSTM state right after the cut
        # (the state it would have gone on with), for --bootstrap-truncated.
        self._cut: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- state ------------------------------------------------------------------------------

    def _frames(self, rows: Sequence[bool]) -> torch.Tensor:
        """The envs' current observations as one batch on the device; blank where not `rows`.

        A new tensor every step: the reference path's graphs keep the old ones.
        """
        assert self._blank is not None
        batch = np.stack(
            [obs if row else self._blank for obs, row in zip(self._obs, rows, strict=True)]
        )
        return torch.as_tensor(batch, device=self.device)

    def _observe(self, k: int, obs: np.ndarray) -> None:
        self._obs[k] = np.asarray(obs, dtype=np.float32)

    def reset(self, seeds: Sequence[int | None] | None = None) -> None:
        """Reset every env (env k with ``seeds[k]``) and zero every LSTM state."""
        self._obs = [
            np.asarray(env.reset(seed=None if seeds is None else seeds[k])[0], dtype=np.float32)
            for k, env in enumerate(self.envs)
        ]
        self._blank = np.zeros_like(self._obs[0])
        self.hx, self.cx = self.model.initial_state(len(self.envs), self.device)
        self.done = [False] * len(self.envs)

    def start_rollout(self) -> None:
        """Begin a rollout: envs whose episode ended start a new one (LSTM state zeroed)."""
        hx, cx = self.hx.detach(), self.cx.detach()
        if any(self.done):
            hx, cx = hx.clone(), cx.clone()
            for k, env in enumerate(self.envs):
                if self.done[k]:
                    self._observe(k, env.reset()[0])
                    hx[k] = 0.0
                    cx[k] = 0.0
                    self.done[k] = False
        self.hx, self.cx = hx, cx
        self.record.clear()
        self._cut = {}
        self.path.begin(hx, cx)

    def restart_episodes(self) -> None:
        """Zero every env's LSTM state at the next rollout (after a skipped update).

        An Atari game goes on from where it stands (a lost-life reset); what a NaN can have
        reached is the LSTM state, which starts afresh either way.
        """
        self.done = [True] * len(self.envs)

    @property
    def steps(self) -> int:
        """Agent steps recorded in this rollout, summed over the envs."""
        return int(self.record["took"].sum())

    # -- acting -----------------------------------------------------------------------------

    def play_rollout(self, num_steps: int) -> int:
        """Up to `num_steps` steps in every env, to the end of its episode; return the steps.

        Raises:
            NonFiniteError: the policy came out NaN or inf (no env was stepped that step).
        """
        for _ in range(num_steps):
            active = [not done for done in self.done]
            if not any(active):
                break
            taken, self.hx, self.cx = self.path.act(
                self.model, self._frames(active), self.hx, self.cx
            )
            self._step_envs(taken, active)
        return self.steps

    def _step_envs(self, actions: list[int], active: list[bool]) -> None:
        """Step the active envs; record the step on the host."""
        rows = self.record.next_step()
        rows["actions"][:] = actions
        rows["took"][:] = active
        for k, env in enumerate(self.envs):
            if not active[k]:
                continue
            obs, reward, terminated, truncated, _ = env.step(actions[k])
            self._observe(k, obs)
            cut = bool(truncated and not terminated)
            self.done[k] = bool(terminated or truncated)
            rows["terminated"][k] = bool(terminated)
            rows["truncated"][k] = cut
            rows["rewards"][k] = max(min(float(reward), 1.0), -1.0) * self.reward_scale  # clipped
            if cut and self.bootstrap_truncated:
                self._cut[k] = (self.hx[k].detach().clone(), self.cx[k].detach().clone())

    # -- the loss inputs --------------------------------------------------------------------

    def rollout(self) -> Rollout:
        """The rollout just played, as (T, K) tensors for the loss, on the chosen path."""
        actions = self.record.to_device("actions", self.device)
        values, log_probs, entropies = self.path.loss_inputs(self.model, actions)
        return Rollout(
            values=values,
            log_probs=log_probs,
            entropies=entropies,
            # The rewards and flags stay on the host: the returns' scan runs there
            # (`train.discounted_targets`) and the loss takes `took` to its device once.
            **{name: self.record.to_device(name, "cpu") for name in StepRecord.FIELDS[1:]},
            bootstrap=self.bootstrap_value(),
        )

    @torch.no_grad()
    def bootstrap_value(self) -> torch.Tensor:
        """V of each env's current state, 0 where its episode ended; shape (K,), detached.

        With ``bootstrap_truncated``, an env a time limit cut keeps the value of the state it
        was cut at, with the LSTM state the cut left it.
        """
        keep = [not done for done in self.done]
        hx, cx = self.hx.detach(), self.cx.detach()
        if self._cut:
            hx, cx = hx.clone(), cx.clone()
            for k, (cut_hx, cut_cx) in self._cut.items():
                keep[k] = True
                hx[k], cx[k] = cut_hx, cut_cx
        if not any(keep):
            return torch.zeros(len(self.envs), device=self.device)
        value, _, _, _ = forward(self.model, self._frames(keep), hx, cx, self.path.bf16)
        kept = torch.tensor(keep, device=self.device)
        return torch.where(kept, value.view(-1), torch.zeros((), device=self.device))


# Greedy play: the test process's and gym_eval.py's games


GAME_OVER, TIME_LIMIT, STALLED, STOPPED = "game over", "time limit", "stalled", "stopped"


@dataclass(frozen=True)
class GameResult:
    """One greedy game: its unclipped reward, agent steps over every life, and how it ended.

    `STALLED` is ``--stall-steps`` steps without a reward (say, Breakout waiting for a FIRE).
    """

    reward: float
    length: int
    ending: str
    steps_without_reward: int

    def note(self) -> str:
        """What the log says after the reward when the game did not end in a game over."""
        quiet = self.steps_without_reward
        if self.ending == STALLED:
            return f", stalled: no reward in {quiet} steps"
        if self.ending == TIME_LIMIT and quiet:
            return f", cut by the time limit (no reward in the last {quiet} steps)"
        if self.ending == TIME_LIMIT:  # rewarded to its last step (CartPole's every step)
            return ", cut by the time limit"
        return ""


class GreedyPlayer:
    """Plays whole games with the argmax action: what the test process and gym_eval.py score.

    A lost life goes on with the same game (the LSTM state starts afresh, as in training). A
    game that ended early is followed by a real reset, not the lost-life reset.
    """

    def __init__(self, model: nn.Module, env: gym.Env, device: torch.device | str = "cpu"):
        """A player for `model` (on `device`) in `env`."""
        self.model = model
        self.env = env
        self.device = torch.device(device)

    def _state(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device).unsqueeze(0)

    @torch.no_grad()
    def play_game(
        self,
        seed: int | None = None,
        stall_steps: int = 0,
        on_frame: Callable[[np.ndarray], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GameResult:
        """Play one game from a real reset; `on_frame` gets the screen before every action."""
        force_real_reset(self.env)
        obs, _ = self.env.reset(seed=seed)
        state = self._state(obs)
        hx, cx = self.model.initial_state(1, self.device)
        reward, length, since_reward = 0.0, 0, 0
        while True:
            if should_stop is not None and should_stop():
                force_real_reset(self.env)
                return GameResult(reward, length, STOPPED, since_reward)
            if on_frame is not None:
                on_frame(self.env.render())
            _, logits, hx, cx = self.model(state, hx, cx)
            obs, step_reward, terminated, truncated, _ = self.env.step(int(logits.argmax(1)))
            state = self._state(obs)
            reward += float(step_reward)
            length += 1
            since_reward = 0 if step_reward != 0 else since_reward + 1
            if terminated or truncated:
                if was_real_done(self.env):
                    ending = GAME_OVER if terminated and not truncated else TIME_LIMIT
                    return GameResult(reward, length, ending, since_reward)
                # Only it ends a life short of a game; looked up here, as `env` can be swapped
                # between games (gym_eval.py's window).
                life = find_wrapper(self.env, EpisodicLifeEnv)
                games = life.games
                obs, _ = self.env.reset()  # a lost life: the same game goes on,
                if life.games != games:  # unless the time limit fell in its no-op or FIRE
                    return GameResult(reward, length, TIME_LIMIT, since_reward)
                state = self._state(obs)
                hx, cx = self.model.initial_state(1, self.device)
            if stall_steps and since_reward >= stall_steps:
                force_real_reset(self.env)
                return GameResult(reward, length, STALLED, since_reward)


def force_real_reset(env: gym.Env) -> None:
    """Make the env's next reset a real one, also mid-game (Atari's lost-life reset is not)."""
    life = find_wrapper(env, EpisodicLifeEnv)
    if life is not None:
        life.was_real_done = True
