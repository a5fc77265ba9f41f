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


class EncoderTape:
    """What a network's encoder computed while acting without autograd, one row per step.

    `A3Clstm` records every conv layer's input, its max-pool indices and its ReLU output, so
    the backward of a rollout needs no second forward through the conv stack (see
    `A3Clstm.replay_features`). Other networks record the observations alone and re-encode.
    Each named tensor lives in a buffer that is kept across rollouts and grows by doubling;
    layers write their outputs straight into the current row, so recording allocates nothing.
    Call `clear` after the backward: the next rollout overwrites the rows.
    """

    def __init__(self) -> None:
        """An empty tape."""
        self.length = 0
        self._buffers: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.length

    def row(
        self, key: str, shape: torch.Size, like: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The current step's row of buffer `key`, as a batch-1 tensor of `shape` to write into.

        The buffer takes the device, dtype (unless given) and memory layout of `like`.
        """
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] <= self.length or buffer.shape[1:] != shape[1:]:
            rows = max(32, 2 * self.length)
            layout = torch.contiguous_format
            if like.dim() == 4 and like.is_contiguous(memory_format=torch.channels_last):
                layout = torch.channels_last
            grown = torch.empty(
                (rows, *shape[1:]),
                dtype=dtype or like.dtype,
                device=like.device,
                memory_format=layout,
            )
            if buffer is not None and buffer.shape[1:] == shape[1:]:
                grown[: self.length].copy_(buffer[: self.length])
            buffer = self._buffers[key] = grown
        return buffer[self.length : self.length + 1]

    def record(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy batch-1 tensors into the current row."""
        for key, tensor in tensors.items():
            self.row(key, tensor.shape, tensor).copy_(tensor)

    def advance(self) -> None:
        """The current step is complete; the next writes go to the next row."""
        self.length += 1

    def get(self, key: str) -> torch.Tensor:
        """Every recorded step of one tensor, shape (steps, ...)."""
        return self._buffers[key][: self.length]

    def clear(self) -> None:
        """Start again from the first row (keeps the buffers)."""
        self.length = 0


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

    def encode_recorded(self, x: torch.Tensor, tape: EncoderTape) -> torch.Tensor:
        """`encode` without autograd, keeping on `tape` what `replay_features` needs."""
        tape.record({"input": x})
        tape.advance()
        return self.encode(x)

    def replay_features(self, tape: EncoderTape) -> torch.Tensor:
        """The features of every recorded step, shape (T, features), with autograd.

        This default encodes the recorded observations again as one batch.
        """
        return self.encode(tape.get("input"))

    def forward(
        self,
        x: torch.Tensor,
        hx: torch.Tensor,
        cx: torch.Tensor,
        tape: EncoderTape | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of the network.

        Args:
            x: observations, shape (batch, *observation_shape).
            hx: LSTM hidden state, shape (batch, hidden_size).
            cx: LSTM cell state, shape (batch, hidden_size).
            tape: record the encoder's work here for `replay_features` (only without
                autograd: the fast path's acting).

        Returns:
            ``(value, logits, hx, cx)`` with value (batch, 1) and logits (batch, n_actions).
        """
        if tape is not None:
            if torch.is_grad_enabled():
                raise RuntimeError("recording on an EncoderTape needs torch.no_grad()")
            features = self.encode_recorded(x, tape)
        else:
            features = self.encode(x)
        hx, cx = self.lstm(features, (hx, cx))
        return self.critic_linear(hx), self.actor_linear(hx), hx, cx

    def forward_sequence(
        self, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T steps of one sequence at once: the same numbers as T calls of `forward`.

        The encoder sees all T observations as one batch and the LSTM runs as PyTorch's fused
        sequence op with this cell's weights (same gate order), so backward computes each
        weight gradient once for the whole sequence instead of once per step. (The fast path
        skips the encoder here: it takes recorded features, `replay_features`, into
        `sequence_from_features`.)

        Args:
            x: observations of one sequence, shape (T, *observation_shape).
            hx: LSTM hidden state before the first step, shape (1, hidden_size).
            cx: LSTM cell state before the first step, shape (1, hidden_size).

        Returns:
            ``(values, logits)`` with shapes (T, 1) and (T, n_actions).
        """
        return self.sequence_from_features(self.encode(x), hx, cx)

    def sequence_from_features(
        self, features: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_sequence` after the encoder: features (T, n) -> ``(values, logits)``."""
        features = features.unsqueeze(1)  # (T, batch 1, features)
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

    def encode_recorded(self, x: torch.Tensor, tape: EncoderTape) -> torch.Tensor:
        """`encode`, keeping each layer's conv output, pool indices and ReLU output."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        tape.record({"input": x})
        for i, conv in enumerate(self.convs()):
            out = conv(x)
            n, c, h, w = out.shape
            shape = torch.Size((n, c, h // 2, w // 2))
            x = tape.row(f"relu{i}", shape, out)
            indices = tape.row(f"indices{i}", shape, out, torch.long)
            torch.ops.aten.max_pool2d_with_indices.out(
                out, [2, 2], [2, 2], [0, 0], [1, 1], False, out=x, indices=indices
            )
            x.relu_()
        tape.advance()
        return x.flatten(1)

    def replay_features(self, tape: EncoderTape) -> torch.Tensor:
        """The recorded features with autograd, without running the conv stack again.

        Backward applies PyTorch's own backward kernels (ReLU, max-pool, convolution) to the
        recorded activations, batched over the rollout: the gradients autograd would give
        for `encode` of the same observations. On the 2-core CPU this saves the batched
        forward of a 20-step replay (about 1.2 ms per step; see benchmarks/).
        """
        if not len(tape):
            raise RuntimeError("replay_features() needs steps recorded by encode_recorded()")
        params = [t for conv in self.convs() for t in (conv.weight, conv.bias)]
        return _ReplayConvStack.apply(self, tape, *params)


def _max_unpool(grad: torch.Tensor, indices: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """Backward of a non-overlapping max-pool: each gradient goes to its max's position.

    Bit for bit what ``max_pool2d_with_indices_backward`` gives when windows do not overlap,
    without the pool's input (which the tape does not keep). Works in channels_last: the
    result is a channels_last (N, C, H, W) tensor of `size`.
    """
    n, c, h, w = size
    grad_in = grad.new_zeros((n, h, w, c))
    grad_in.view(n, h * w, c).scatter_(
        1, indices.permute(0, 2, 3, 1).reshape(n, -1, c), grad.permute(0, 2, 3, 1).reshape(n, -1, c)
    )
    return grad_in.permute(0, 3, 1, 2)


class _ReplayConvStack(torch.autograd.Function):
    """Recorded conv-stack features as a function of the conv weights (see replay_features)."""

    @staticmethod
    def forward(ctx, model: A3Clstm, tape: EncoderTape, *params: torch.Tensor) -> torch.Tensor:
        ctx.model = model
        ctx.tape = tape
        return tape.get(f"relu{len(model.convs()) - 1}").flatten(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        model: A3Clstm = ctx.model
        tape: EncoderTape = ctx.tape
        convs = model.convs()
        grads: list[torch.Tensor | None] = []
        grad = grad.reshape(tape.get(f"relu{len(convs) - 1}").shape)
        for i in reversed(range(len(convs))):
            conv = convs[i]
            conv_input = tape.get("input" if i == 0 else f"relu{i - 1}")
            n, _, h, w = conv_input.shape
            out_h, out_w = (
                (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                for size, k, pad, dil, stride in zip(
                    (h, w), conv.kernel_size, conv.padding, conv.dilation, conv.stride, strict=True
                )
            )
            out_size = torch.Size((n, conv.out_channels, out_h, out_w))
            grad = torch.ops.aten.threshold_backward(grad, tape.get(f"relu{i}"), 0)
            grad = _max_unpool(grad, tape.get(f"indices{i}"), out_size)
            grad, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad, conv_input, conv.weight, [conv.out_channels], list(conv.stride),
                list(conv.padding), list(conv.dilation), False, [0, 0], conv.groups,
                [i > 0, True, True],
            )  # fmt: skip
            grads[:0] = [grad_w, grad_b]
        return (None, None, *grads)


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
