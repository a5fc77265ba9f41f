"""The acting agent: one model, one env, its LSTM state and the rollout buffers."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from environment import was_real_done
from fast_path import EncoderTape, act_recorded, replay_features, sequence_from_features


class NonFiniteError(ArithmeticError):
    """The policy came out NaN or inf (a broken observation or model); nothing was sampled."""


def _check_finite(logits: torch.Tensor) -> None:
    # Sampling from NaN probabilities fails on CPU and trips a device assert on CUDA, which
    # would end the process's CUDA context; a small check per step avoids both.
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError("the policy's logits hold a NaN or inf")


class Agent:
    """Plays one env with one model, on any device, and records a rollout for the loss.

    Training acts on one of two paths, chosen once when the agent is made: the reference path
    (the original's: every step's forward with autograd) or the fast path (`fast_path.py`:
    act without autograd, recording the encoder, then replay the rollout with autograd at
    once). Both give the same losses and gradients; the worker loop does not know which runs.

    Attributes:
        model: the network (the worker's own copy, or the test process's).
        env: the environment it acts in.
        device: where the model, the state and the rollout tensors live.
        state: the current observation as a float32 tensor on `device`.
        hx, cx: LSTM state, shape (1, hidden_size).
        done: the last step ended the episode (a lost life counts in Atari training).
        reward: the last step's training reward: clipped to [-1, 1] when ``clip_rewards``,
            then times ``reward_scale``.
        raw_reward: the last step's reward as the game gave it.
        actions, rewards: the rollout's actions and training rewards since `clear_actions`.
        values, log_probs, entropies: the rollout's loss inputs, complete after
            `prepare_loss_inputs`.
        tape: the fast path's record of the encoder's work (None on the reference path).
    """

    def __init__(
        self,
        model: nn.Module,
        env: gym.Env,
        device: torch.device | str = "cpu",
        clip_rewards: bool = True,
        reward_scale: float = 1.0,
        fast_path: bool = False,
    ):
        """Create an agent; call `reset` before acting.

        Args:
            model: the network.
            env: the environment.
            device: where the model lives.
            clip_rewards: clip training rewards to [-1, 1] (the original's rule).
            reward_scale: multiply the (clipped) training rewards by this.
            fast_path: train on the fast path (see `fast_path.py`) instead of the reference.
        """
        self.model = model
        self.env = env
        self.device = torch.device(device)
        self.clip_rewards = clip_rewards
        self.reward_scale = reward_scale
        self.state = torch.zeros(0)
        self.hx, self.cx = model.initial_state(1, self.device)
        self.done = True
        self.reward = 0.0
        self.raw_reward = 0.0
        self.actions: list[int] = []
        self.rewards: list[float] = []
        self.values: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []
        self.tape = EncoderTape() if fast_path else None
        self._rollout_start: tuple[torch.Tensor, torch.Tensor] | None = None
        # The one place the path is chosen: how a training step acts, and how the rollout's
        # loss inputs are completed.
        if fast_path:
            self.action_train = self._act_recording
            self.prepare_loss_inputs = self._replay_rollout
        else:
            self.action_train = self._act_with_autograd
            self.prepare_loss_inputs = self._loss_inputs_ready

    # -- state ------------------------------------------------------------------------------

    def _to_state(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)

    def reset(self, seed: int | None = None) -> None:
        """Reset the env and the LSTM state."""
        obs, _ = self.env.reset(seed=seed)
        self.state = self._to_state(obs)
        self.reset_lstm()
        self.done = False

    def reset_lstm(self) -> None:
        """Zero the LSTM state (at the start of an episode)."""
        self.hx, self.cx = self.model.initial_state(1, self.device)

    def detach_lstm(self) -> None:
        """Cut the graph between rollouts while keeping the LSTM's memory."""
        self.hx = self.hx.detach()
        self.cx = self.cx.detach()

    def start_rollout(self) -> None:
        """A new episode after one ended; otherwise go on with the LSTM state cut from the graph."""
        if self.done:
            self.reset()
        else:
            self.detach_lstm()

    @property
    def real_done(self) -> bool:
        """The episode ended with a real game over (not just a lost life)."""
        return self.done and was_real_done(self.env)

    # -- acting -----------------------------------------------------------------------------

    def _step_env(self, action: int) -> None:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.state = self._to_state(obs)
        self.done = bool(terminated or truncated)
        self.raw_reward = float(reward)
        reward = max(min(self.raw_reward, 1.0), -1.0) if self.clip_rewards else self.raw_reward
        self.reward = reward * self.reward_scale

    def play_rollout(self, num_steps: int) -> int:
        """Take up to `num_steps` training steps, stopping at the end of an episode.

        Returns:
            The steps taken.

        Raises:
            NonFiniteError: the policy came out NaN or inf (the env was not stepped).
        """
        for _ in range(num_steps):
            self.action_train()
            if self.done:
                break
        return len(self.rewards)

    def _act_with_autograd(self) -> Agent:
        """Reference path: sample from the policy, step the env, keep the step's graph.

        Raises:
            NonFiniteError: the policy is NaN or inf (the env was not stepped).
        """
        value, logits, self.hx, self.cx = self.model(self.state.unsqueeze(0), self.hx, self.cx)
        _check_finite(logits)
        prob = F.softmax(logits, dim=1)
        log_prob = F.log_softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1)
        action = prob.multinomial(1).detach()
        self.actions.append(int(action.item()))
        self._step_env(self.actions[-1])
        self.values.append(value)
        self.log_probs.append(log_prob.gather(1, action))
        self.rewards.append(self.reward)
        self.entropies.append(entropy)
        return self

    def _loss_inputs_ready(self) -> Agent:
        """Reference path: acting kept every step's graph; nothing left to do."""
        return self

    @torch.no_grad()
    def _act_recording(self) -> Agent:
        """Fast path: sample like the reference path, without autograd, recording the encoder.

        Raises:
            NonFiniteError: the policy is NaN or inf (the env was not stepped).
        """
        assert self.tape is not None
        if self._rollout_start is None:
            self._rollout_start = (self.hx.detach(), self.cx.detach())
        _, logits, self.hx, self.cx = act_recorded(
            self.model, self.state.unsqueeze(0), self.hx, self.cx, self.tape
        )
        _check_finite(logits)
        self.actions.append(int(F.softmax(logits, dim=1).multinomial(1).item()))
        self._step_env(self.actions[-1])
        self.rewards.append(self.reward)
        return self

    def _replay_rollout(self) -> Agent:
        """Fast path: the rollout's values, log-probabilities and entropies, with autograd.

        The recorded encoder features (`replay_features`, which backpropagates into the conv
        weights without a second forward) go through the LSTM as one sequence from the
        rollout's starting state. That gives the values and policy the per-step forwards gave
        (the weights have not changed since), so the loss and its gradients are those of the
        reference path.
        """
        if self._rollout_start is None or self.tape is None:
            raise RuntimeError("replaying a rollout needs fast-path steps first")
        hx, cx = self._rollout_start
        features = replay_features(self.model, self.tape)
        values, logits = sequence_from_features(self.model, features, hx, cx)
        log_prob = F.log_softmax(logits, dim=1)
        prob = F.softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1)
        actions = torch.tensor(self.actions, device=self.device).unsqueeze(1)
        self.values = list(values.split(1))
        self.log_probs = list(log_prob.gather(1, actions).split(1))
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
        self.actions.clear()
        self.rewards.clear()
        self.values = []
        self.log_probs = []
        self.entropies = []
        if self.tape is not None:
            self.tape.clear()
        self._rollout_start = None
        return self
