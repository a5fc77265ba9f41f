"""The A3C-LSTM networks: the original's conv net for 80x80 frames, an MLP for vector states."""

from __future__ import annotations

import gymnasium as gym
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

MLP_WIDTH = 128
"""Width of the two hidden layers of the vector-observation encoder."""
HIDDEN_SIZE = 512
"""The LSTM's width by default (the original's)."""


# Weight initialisation (the original's)


def norm_col_init(weights: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """Draw a normal matrix shaped like `weights` and rescale each output row to norm `std`."""
    x = torch.randn(weights.size())
    x *= std / torch.sqrt((x**2).sum(1, keepdim=True))
    return x


def init_lstm(lstm: nn.LSTMCell) -> None:
    """Xavier-uniform input weights, orthogonal recurrent weights, forget-gate bias 1.

    A forget bias of 1 keeps the cell state flowing before the gate has learnt anything.
    """
    hidden = lstm.hidden_size
    with torch.no_grad():
        nn.init.xavier_uniform_(lstm.weight_ih)
        nn.init.orthogonal_(lstm.weight_hh)
        lstm.bias_ih.zero_()
        lstm.bias_hh.zero_()
        lstm.bias_ih[hidden : 2 * hidden] = 1.0


# Networks


class ActorCriticLSTM(nn.Module):
    """What both networks share: an encoder (``encode``), an LSTMCell, value and policy heads.

    Subclasses build their encoder, call `_build_tail`, then `_init_tail` after their layers.
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

    channels_last = False

    @staticmethod
    def channels_last_suits(device: torch.device, bf16: bool = False) -> bool:
        """Whether `use_channels_last` pays on `device`.

        Always on the CPU (docs/performance.md); on a GPU only under bf16, for tensor cores.
        """
        return device.type == "cpu" or bf16

    def use_channels_last(self) -> ActorCriticLSTM:
        """Lay conv weights out as channels_last where the encoder has any (`A3Clstm`)."""
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Map a batch of observations to flat features."""
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step: ``(value, logits, hx, cx)``, value (batch, 1), logits (batch, n_actions)."""
        return self.forward_features(self.encode(x), hx, cx)

    def forward_features(
        self, features: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` after the encoder: features (batch, n) -> ``(value, logits, hx, cx)``."""
        hx, cx = self.lstm(features, (hx, cx))
        return self.critic_linear(hx), self.actor_linear(hx), hx, cx

    def initial_state(
        self, batch: int = 1, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero LSTM state ``(hx, cx)`` for `batch` sequences on `device`."""
        zeros = torch.zeros(batch, self.hidden_size, device=device)
        return zeros, zeros.clone()


class A3Clstm(ActorCriticLSTM):
    """The original A3G network for 1x80x80 frames.

    Four conv + 2x2 max-pool + ReLU layers (80->40->19->9->4) give 1024 features. Parameter
    names match the original's, so ``.dat`` checkpoints move between the two projects.
    """

    def __init__(
        self, num_inputs: int, action_space: gym.spaces.Discrete, hidden_size: int = HIDDEN_SIZE
    ):
        """Build and initialise the network for `num_inputs` channels."""
        super().__init__()
        self.conv1 = nn.Conv2d(num_inputs, 32, 5, stride=1, padding=2)
        self.conv2 = nn.Conv2d(32, 32, 5, stride=1, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 4, stride=1, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3, stride=1, padding=1)
        self._build_tail(1024, int(action_space.n), hidden_size)

        relu_gain = nn.init.calculate_gain("relu")
        with torch.no_grad():
            for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
                conv.weight.mul_(relu_gain)
                conv.bias.zero_()
        self._init_tail()

    def use_channels_last(self) -> A3Clstm:
        """Lay the conv weights (and inputs, in `encode`) out as channels_last.

        It speeds up the CPU's batch-1 forward (`benchmarks/bench_networks.py`, case ``act``).
        """
        self.to(memory_format=torch.channels_last)
        self.channels_last = True
        return self

    def convs(self) -> tuple[nn.Conv2d, ...]:
        """The conv layers, input to output."""
        return (self.conv1, self.conv2, self.conv3, self.conv4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Conv stack: (batch, C, 80, 80) -> (batch, 1024)."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        for conv in self.convs():
            x = F.relu(F.max_pool2d(conv(x), 2, 2))
        return x.flatten(1)


class A3CMlp(ActorCriticLSTM):
    """A3C-LSTM for flat vector observations (CartPole, Acrobot): a two-layer MLP encoder."""

    def __init__(
        self, num_inputs: int, action_space: gym.spaces.Discrete, hidden_size: int = HIDDEN_SIZE
    ):
        """Build and initialise the network for vectors of length `num_inputs`."""
        super().__init__()
        self.fc1 = nn.Linear(num_inputs, MLP_WIDTH)
        self.fc2 = nn.Linear(MLP_WIDTH, MLP_WIDTH)
        self._build_tail(MLP_WIDTH, int(action_space.n), hidden_size)
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
    observation_space: gym.spaces.Box,
    action_space: gym.spaces.Discrete,
    hidden_size: int = HIDDEN_SIZE,
) -> ActorCriticLSTM:
    """Build the network for the env's spaces, with an LSTM of `hidden_size`.

    `make_env` gives (C, 80, 80) frames, which get `A3Clstm`, or flat vectors, which get
    `A3CMlp`; it refuses any other env, and actions that are not Discrete.
    """
    shape = observation_space.shape
    network = A3Clstm if len(shape) == 3 else A3CMlp
    return network(shape[0], action_space, hidden_size)
