"""The acting agent: one model, one env, its LSTM state and the rollout buffers."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from environment import was_real_done
from model import EncoderTape


class NonFiniteError(ArithmeticError):
    """The policy came out NaN or inf (a broken observation or model); nothing was sampled."""


def _check_finite(logits: torch.Tensor) -> None:
    # Sampling from NaN probabilities fails on CPU and trips a device assert on CUDA, which
    # would end the process's CUDA context; a small check per step avoids both.
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError("the policy's logits hold a NaN or inf")


class Agent:
    """Plays one env with one model, on any device, and records a rollout for the loss.

    Attributes:
        model: the network (the worker's own copy, or the test process's).
        env: the environment it acts in.
        device: where the model, the state and the rollout tensors live.
        state: the current observation as a float32 tensor on `device`.
        hx, cx: LSTM state, shape (1, hidden_size).
        done: the last step ended the episode (a lost life counts in Atari training).
        info: the info dict of the last step.
        reward: the last step's training reward: clipped to [-1, 1] when ``clip_rewards``,
            then times ``reward_scale``.
        raw_reward: the last step's reward as the game gave it.
        eps_len: steps since the episode (life) began.
        values, log_probs, rewards, entropies: the rollout since `clear_actions`.
        tape, explored_actions, rollout_start: what the fast path's `action_explore`
            records for `replay_rollout` (the encoder's activations, the actions, and the
            LSTM state the rollout started from).
    """

    def __init__(
        self,
        model: nn.Module,
        env: gym.Env,
        device: torch.device | str = "cpu",
        clip_rewards: bool = True,
        reward_scale: float = 1.0,
    ):
        """Create an agent; call `reset` before acting.

        Args:
            model: the network.
            env: the environment.
            device: where the model lives.
            clip_rewards: clip training rewards to [-1, 1] (the original's rule).
            reward_scale: multiply the (clipped) training rewards by this.
        """
        self.model = model
        self.env = env
        self.device = torch.device(device)
        self.clip_rewards = clip_rewards
        self.reward_scale = reward_scale
        self.state = torch.zeros(0)
        self.hx, self.cx = model.initial_state(1, self.device)
        self.done = True
        self.info: dict[str, Any] = {}
        self.reward = 0.0
        self.raw_reward = 0.0
        self.eps_len = 0
        self.values: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.rewards: list[float] = []
        self.entropies: list[torch.Tensor] = []
        # Fast path: what `action_explore` records for `replay_rollout`.
        self.tape = EncoderTape()
        self.explored_actions: list[int] = []
        self.rollout_start: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- state ------------------------------------------------------------------------------

    def _to_state(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)

    def reset(self, seed: int | None = None) -> None:
        """Reset the env, the LSTM state and the episode counters."""
        obs, self.info = self.env.reset(seed=seed)
        self.state = self._to_state(obs)
        self.reset_lstm()
        self.done = False
        self.eps_len = 0

    def reset_lstm(self) -> None:
        """Zero the LSTM state (at the start of an episode)."""
        self.hx, self.cx = self.model.initial_state(1, self.device)

    def detach_lstm(self) -> None:
        """Cut the graph between rollouts while keeping the LSTM's memory."""
        self.hx = self.hx.detach()
        self.cx = self.cx.detach()

    @property
    def real_done(self) -> bool:
        """The episode ended with a real game over (not just a lost life)."""
        return self.done and was_real_done(self.env)

    # -- acting -----------------------------------------------------------------------------

    def _step_env(self, action: int) -> None:
        obs, reward, terminated, truncated, self.info = self.env.step(action)
        self.state = self._to_state(obs)
        self.done = bool(terminated or truncated)
        self.raw_reward = float(reward)
        reward = max(min(self.raw_reward, 1.0), -1.0) if self.clip_rewards else self.raw_reward
        self.reward = reward * self.reward_scale
        self.eps_len += 1

    def action_train(self) -> Agent:
        """Sample an action from the policy, step the env, and record the step for the loss.

        Raises:
            NonFiniteError: the policy is NaN or inf (the env was not stepped).
        """
        value, logits, self.hx, self.cx = self.model(self.state.unsqueeze(0), self.hx, self.cx)
        _check_finite(logits)
        prob = F.softmax(logits, dim=1)
        log_prob = F.log_softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1)
        action = prob.multinomial(1).detach()
        self._step_env(int(action.item()))
        self.values.append(value)
        self.log_probs.append(log_prob.gather(1, action))
        self.rewards.append(self.reward)
        self.entropies.append(entropy)
        return self

    @torch.no_grad()
    def action_explore(self) -> Agent:
        """Fast-path acting: sample like `action_train` but without autograd.

        Records the encoder's work on `tape`, the action and the reward; `replay_rollout`
        recomputes the values, log-probabilities and entropies with autograd for the whole
        rollout at once.

        Raises:
            NonFiniteError: the policy is NaN or inf (the env was not stepped).
        """
        if self.rollout_start is None:
            self.rollout_start = (self.hx.detach(), self.cx.detach())
        _, logits, self.hx, self.cx = self.model(
            self.state.unsqueeze(0), self.hx, self.cx, tape=self.tape
        )
        _check_finite(logits)
        prob = F.softmax(logits, dim=1)
        action = prob.multinomial(1)
        self.explored_actions.append(int(action.item()))
        self._step_env(self.explored_actions[-1])
        self.rewards.append(self.reward)
        return self

    def replay_rollout(self) -> Agent:
        """Fill the rollout buffers for the loss from what `action_explore` recorded.

        The recorded encoder features (`replay_features`, which backpropagates into the conv
        weights without a second forward) go through the LSTM as one sequence from the
        rollout's starting state. That gives the values and policy the per-step forwards gave
        (the weights have not changed since), so the loss and its gradients are those of the
        reference path.
        """
        if self.rollout_start is None:
            raise RuntimeError("replay_rollout() needs action_explore() steps first")
        hx, cx = self.rollout_start
        features = self.model.replay_features(self.tape)
        values, logits = self.model.sequence_from_features(features, hx, cx)
        log_prob = F.log_softmax(logits, dim=1)
        prob = F.softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1)
        actions = torch.tensor(self.explored_actions, device=self.device).unsqueeze(1)
        chosen = log_prob.gather(1, actions)
        self.values = list(values.split(1))
        self.log_probs = list(chosen.split(1))
        self.entropies = list(entropy.split(1))
        return self

    @torch.no_grad()
    def action_test(self) -> Agent:
        """Take the greedy (argmax) action and step the env; nothing is recorded."""
        _, logits, self.hx, self.cx = self.model(self.state.unsqueeze(0), self.hx, self.cx)
        self._step_env(int(logits.argmax(1).item()))
        return self

    @torch.no_grad()
    def bootstrap_value(self) -> torch.Tensor:
        """Value of the current state (0 after a terminal step), shape (1, 1), detached."""
        if self.done:
            return torch.zeros(1, 1, device=self.device)
        value, _, _, _ = self.model(self.state.unsqueeze(0), self.hx, self.cx)
        return value

    def clear_actions(self) -> Agent:
        """Empty the rollout buffers (after an update)."""
        self.values = []
        self.log_probs = []
        self.rewards.clear()
        self.entropies = []
        self.tape.clear()
        self.explored_actions.clear()
        self.rollout_start = None
        return self
