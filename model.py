"""The A3C-LSTM networks: the original's conv net for 80x80 frames, an MLP for vector states."""

from __future__ import annotations

import argparse

import gymnasium as gym
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from utils import UsageError, init_lstm, norm_col_init

MLP_WIDTH = 128
"""Width of the two hidden layers of the vector-observation encoder."""


class _ActorCriticLSTM(nn.Module):
    """Shared tail of both networks: LSTMCell, then value and policy heads.

    Subclasses define ``encode(x) -> features`` and call `_init_tail` after building layers.
    """

    hidden_size: int

    def _build_tail(self, features: int, num_actions: int, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.lstm = nn.LSTMCell(features, hidden_size)
        self.critic_linear = nn.Linear(hidden_size, 1)
        self.actor_linear = nn.Linear(hidden_size, num_actions)

    def _init_tail(self) -> None:
        with torch.no_grad():
            self.actor_linear.weight.copy_(norm_col_init(self.actor_linear.weight, 0.01))
            self.actor_linear.bias.zero_()
            self.critic_linear.weight.copy_(norm_col_init(self.critic_linear.weight, 1.0))
            self.critic_linear.bias.zero_()
        init_lstm(self.lstm)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Map a batch of observations to flat features."""
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of the network.

        Args:
            x: observations, shape (batch, *observation_shape).
            hx: LSTM hidden state, shape (batch, hidden_size).
            cx: LSTM cell state, shape (batch, hidden_size).

        Returns:
            ``(value, logits, hx, cx)`` with value (batch, 1) and logits (batch, n_actions).
        """
        hx, cx = self.lstm(self.encode(x), (hx, cx))
        return self.critic_linear(hx), self.actor_linear(hx), hx, cx

    def forward_sequence(
        self, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T steps of one sequence at once: the same numbers as T calls of `forward`.

        The encoder sees all T observations as one batch and the LSTM runs as PyTorch's fused
        sequence op with this cell's weights (same gate order), so backward computes each
        weight gradient once for the whole sequence instead of once per step. On the 2-core
        CPU this replays a 20-step Pong rollout with backward in 110 ms, against 218 ms for 20
        `forward` calls and one backward (see benchmarks/).

        Args:
            x: observations of one sequence, shape (T, *observation_shape).
            hx: LSTM hidden state before the first step, shape (1, hidden_size).
            cx: LSTM cell state before the first step, shape (1, hidden_size).

        Returns:
            ``(values, logits)`` with shapes (T, 1) and (T, n_actions).
        """
        features = self.encode(x).unsqueeze(1)  # (T, batch 1, features)
        weights = [self.lstm.weight_ih, self.lstm.weight_hh, self.lstm.bias_ih, self.lstm.bias_hh]
        hidden, _, _ = torch.lstm(
            features, (hx.unsqueeze(0), cx.unsqueeze(0)), weights, True, 1, 0.0, True, False, False
        )
        hidden = hidden.squeeze(1)
        return self.critic_linear(hidden), self.actor_linear(hidden)

    def initial_state(
        self, batch: int = 1, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero LSTM state ``(hx, cx)`` for `batch` sequences on `device`."""
        zeros = torch.zeros(batch, self.hidden_size, device=device)
        return zeros, zeros.clone()


class A3Clstm(_ActorCriticLSTM):
    """The original A3G network for 1x80x80 frames.

    Four conv layers, each followed by 2x2 max-pool then ReLU (80->40->19->9->4), flattened to
    1024 features, an LSTMCell, and linear critic and actor heads. Parameter names match the
    original's, so ``.dat`` checkpoints move between the two projects.
    """

    def __init__(
        self, num_inputs: int, action_space: gym.spaces.Discrete, args: argparse.Namespace
    ):
        """Build and initialise the network.

        Args:
            num_inputs: input channels (1 for the preprocessed frames).
            action_space: the env's discrete action space; sets the actor's outputs.
            args: needs ``hidden_size``.
        """
        super().__init__()
        self.conv1 = nn.Conv2d(num_inputs, 32, 5, stride=1, padding=2)
        self.conv2 = nn.Conv2d(32, 32, 5, stride=1, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 4, stride=1, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3, stride=1, padding=1)
        self._build_tail(1024, int(action_space.n), args.hidden_size)

        relu_gain = nn.init.calculate_gain("relu")
        with torch.no_grad():
            for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
                conv.weight.mul_(relu_gain)
                conv.bias.zero_()
        self._init_tail()

    channels_last = False

    def use_channels_last(self) -> A3Clstm:
        """Lay the conv weights (and inputs, in `encode`) out as channels_last.

        channels_last: batch-1 forward 2.9 ms instead of 4.4 ms eager on the 2-core CPU,
        same numbers within float rounding (see benchmarks/).
        """
        self.to(memory_format=torch.channels_last)
        self.channels_last = True
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Conv stack: (batch, C, 80, 80) -> (batch, 1024)."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x = F.relu(F.max_pool2d(self.conv1(x), 2, 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2, 2))
        x = F.relu(F.max_pool2d(self.conv3(x), 2, 2))
        x = F.relu(F.max_pool2d(self.conv4(x), 2, 2))
        return x.flatten(1)


class A3CMlp(_ActorCriticLSTM):
    """A3C-LSTM for flat vector observations (CartPole, Acrobot): a two-layer MLP encoder."""

    def __init__(
        self, num_inputs: int, action_space: gym.spaces.Discrete, args: argparse.Namespace
    ):
        """Build and initialise the network.

        Args:
            num_inputs: length of the observation vector.
            action_space: the env's discrete action space.
            args: needs ``hidden_size``.
        """
        super().__init__()
        self.fc1 = nn.Linear(num_inputs, MLP_WIDTH)
        self.fc2 = nn.Linear(MLP_WIDTH, MLP_WIDTH)
        self._build_tail(MLP_WIDTH, int(action_space.n), args.hidden_size)
        relu_gain = nn.init.calculate_gain("relu")
        with torch.no_grad():
            for fc in (self.fc1, self.fc2):
                nn.init.orthogonal_(fc.weight, relu_gain)
                fc.bias.zero_()
        self._init_tail()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """MLP: (batch, n) -> (batch, MLP_WIDTH)."""
        return F.relu(self.fc2(F.relu(self.fc1(x))))


def build_model(
    observation_space: gym.spaces.Space, action_space: gym.spaces.Space, args: argparse.Namespace
) -> _ActorCriticLSTM:
    """Build the network that fits the environment's spaces.

    Frames shaped (C, 80, 80) get `A3Clstm`; flat vectors get `A3CMlp`.

    Raises:
        UsageError: the action space is not discrete, or the observations are neither.
    """
    if not isinstance(action_space, gym.spaces.Discrete):
        raise UsageError(
            f"A3G needs a discrete action space, got {action_space}; choose an env with "
            "Discrete actions (Atari games, CartPole-v1, Acrobot-v1)"
        )
    shape = getattr(observation_space, "shape", None)
    if not isinstance(observation_space, gym.spaces.Box) or shape is None:
        raise UsageError(f"unsupported observation space {observation_space}; need a Box")
    if len(shape) == 3 and shape[1:] == (80, 80):
        return A3Clstm(shape[0], action_space, args)
    if len(shape) == 1:
        return A3CMlp(shape[0], action_space, args)
    raise UsageError(
        f"unsupported observation shape {shape}; A3G takes (C, 80, 80) frames from its Atari "
        "wrappers or flat vectors"
    )
