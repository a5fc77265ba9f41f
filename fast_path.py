"""The fast path of a worker's rollout: act without autograd, then backpropagate it at once.

It gives the reference path's losses and gradients (tested against it) in three moves
([performance](docs/performance.md)):

1. Act without autograd, with the conv weights in channels_last.
2. Record instead of recompute: `encode_recorded` keeps each conv layer's ReLU output and
   max-pool indices on an `EncoderTape`; `replay_features` backpropagates them, batched.
3. Run the rollout's LSTM as one fused sequence op (`sequence_from_features`), so each LSTM
   weight gradient is formed once per rollout.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from model import A3Clstm, ActorCriticLSTM

# cuDNN warns that it packs the LSTM cell's separate weights (`sequence_from_features`) into
# one buffer; the warning names nothing a user can change.
warnings.filterwarnings(
    "ignore",
    message="RNN module weights are not part of single contiguous chunk",
    category=UserWarning,
)


class EncoderTape:
    """What a network's encoder computed while acting without autograd, one row per step.

    For `A3Clstm` it keeps every conv layer's input, pool indices and ReLU output, so the
    backward needs no second conv forward; other networks keep the observations. Buffers last
    across rollouts and grow by doubling, so recording allocates nothing. Call `clear` after
    the backward.
    """

    def __init__(self) -> None:
        """An empty tape."""
        self.length = 0
        self.batch = 1
        self._buffers: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.length

    def row(
        self, key: str, shape: torch.Size, like: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The current step's rows of buffer `key`, a tensor of `shape` to write into.

        Step t, env k is row ``t * K + k``. The buffer takes `like`'s device, dtype (unless
        given) and memory layout.
        """
        batch = shape[0]
        if self.length and batch != self.batch:
            raise RuntimeError(f"a tape's steps keep one batch size: {self.batch}, then {batch}")
        self.batch = batch
        start, stop = self.length * batch, (self.length + 1) * batch
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < stop or buffer.shape[1:] != shape[1:]:
            rows = max(32, 2 * self.length) * batch
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
                grown[:start].copy_(buffer[:start])
            buffer = self._buffers[key] = grown
        return buffer[start:stop]

    def record(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one step's tensors into the current rows."""
        for key, tensor in tensors.items():
            self.row(key, tensor.shape, tensor).copy_(tensor)

    def advance(self) -> None:
        """The current step is complete; the next writes go to the next row."""
        self.length += 1

    def get(self, key: str) -> torch.Tensor:
        """Every recorded step of one tensor, shape (steps * batch, ...), step-major."""
        return self._buffers[key][: self.length * self.batch]

    def clear(self) -> None:
        """Start again from the first row (keeps the buffers)."""
        self.length = 0


def encode_recorded(
    model: ActorCriticLSTM, x: torch.Tensor, tape: EncoderTape, bf16: bool = False
) -> torch.Tensor:
    """`model.encode` without autograd, keeping on `tape` what `replay_features` needs.

    With `bf16` the encoder runs and records in bfloat16; the features come back float32.
    """
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        if model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        tape.record({"input": x})
        if not isinstance(model, A3Clstm):
            tape.advance()
            return model.encode(x).float()
        for i, conv in enumerate(model.convs()):
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
    return x.flatten(1).float()


def act_recorded(
    model: ActorCriticLSTM,
    x: torch.Tensor,
    hx: torch.Tensor,
    cx: torch.Tensor,
    tape: EncoderTape,
    bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of ``model(x, hx, cx)`` without autograd, recording the encoder on `tape`."""
    if torch.is_grad_enabled():
        raise RuntimeError("recording on an EncoderTape needs torch.no_grad()")
    return model.forward_features(encode_recorded(model, x, tape, bf16), hx, cx)


def replay_features(model: ActorCriticLSTM, tape: EncoderTape, bf16: bool = False) -> torch.Tensor:
    """The features of every recorded step, shape (T * K, features), step-major, with autograd.

    For `A3Clstm`, backward applies PyTorch's own ReLU, max-pool and convolution backward
    kernels to the recorded activations, in the tape's dtype. Other networks encode again.
    """
    if not len(tape):
        raise RuntimeError("replay_features() needs steps recorded by encode_recorded()")
    if not isinstance(model, A3Clstm):
        observations = tape.get("input")
        with torch.autocast(observations.device.type, torch.bfloat16, enabled=bf16):
            return model.encode(observations).float()
    params = [t for conv in model.convs() for t in (conv.weight, conv.bias)]
    return _ReplayConvStack.apply(model, tape, *params).float()


def sequence_from_features(
    model: ActorCriticLSTM, features: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """T steps of the LSTM and heads for K envs at once: what T `forward_features` calls give.

    The LSTM runs as PyTorch's fused sequence op with the cell's own weights, so backward
    forms each LSTM weight gradient once. `features` and the ``(values, logits)`` returned are
    step-major, as `EncoderTape.get` gives them.
    """
    lstm: nn.LSTMCell = model.lstm
    weights = [lstm.weight_ih, lstm.weight_hh, lstm.bias_ih, lstm.bias_hh]
    batch = hx.shape[0]
    hidden, _, _ = torch.lstm(
        features.view(-1, batch, features.shape[1]),  # (T, K, features)
        (hx.unsqueeze(0), cx.unsqueeze(0)),
        weights, True, 1, 0.0, True, False, False,
    )  # fmt: skip
    hidden = hidden.reshape(-1, hidden.shape[2])
    return model.critic_linear(hidden), model.actor_linear(hidden)


def max_unpool(grad: torch.Tensor, indices: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """Backward of a non-overlapping max-pool: each gradient goes to its max's position.

    Bit for bit ``max_pool2d_with_indices_backward``'s result, without the pool's input (which
    the tape does not keep). Returns a channels_last (N, C, H, W) tensor of `size`.
    """
    n, c, h, w = size
    grad_in = grad.new_zeros((n, h, w, c))
    grad_in.view(n, h * w, c).scatter_(
        1, indices.permute(0, 2, 3, 1).reshape(n, -1, c), grad.permute(0, 2, 3, 1).reshape(n, -1, c)
    )
    return grad_in.permute(0, 3, 1, 2)


class _ReplayConvStack(torch.autograd.Function):
    """Recorded conv-stack features as a function of the conv weights (see `replay_features`)."""

    @staticmethod
    def forward(ctx, model: A3Clstm, tape: EncoderTape, *params: torch.Tensor) -> torch.Tensor:
        ctx.model = model
        ctx.tape = tape
        return tape.get(f"relu{len(model.convs()) - 1}").flatten(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        model: A3Clstm = ctx.model
        tape: EncoderTape = ctx.tape
        last = tape.get(f"relu{len(model.convs()) - 1}")
        grad = grad.reshape(last.shape)
        total: list[torch.Tensor] | None = None
        # Rows in chunks that stay in the caches: see `BACKWARD_CHUNK`.
        chunk = backward_chunk(grad.device)
        for start in range(0, last.shape[0], chunk):
            rows = slice(start, start + chunk)
            grads = _conv_stack_backward(model, tape, grad[rows], rows)
            total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
        assert total is not None
        return (None, None, *total)


BACKWARD_CHUNK = 40
"""Frames per conv-stack backward call on the CPU: chunks of 20-40 frames keep the activations
in a core's caches (`benchmarks/bench_conv_layers.py`)."""

GPU_BACKWARD_CHUNK = 1 << 20
"""On a GPU the whole rollout goes in one call, whose kernel launches a bigger batch amortises."""


def backward_chunk(device: torch.device) -> int:
    """Frames per conv-stack backward call on `device` (`BACKWARD_CHUNK`, `GPU_BACKWARD_CHUNK`)."""
    return BACKWARD_CHUNK if device.type == "cpu" else GPU_BACKWARD_CHUNK


def _conv_stack_backward(
    model: A3Clstm, tape: EncoderTape, grad: torch.Tensor, rows: slice
) -> list[torch.Tensor]:
    """The conv stack's weight and bias gradients (conv1 first) for the tape's `rows`."""
    convs = model.convs()
    grads: list[torch.Tensor] = []
    dtype = tape.get("relu0").dtype  # bfloat16 when recorded under autocast
    grad = grad.to(dtype)
    for i in reversed(range(len(convs))):
        conv = convs[i]
        conv_input = tape.get("input" if i == 0 else f"relu{i - 1}")[rows].to(dtype)
        n, _, h, w = conv_input.shape
        out_h, out_w = (
            (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
            for size, k, pad, dil, stride in zip(
                (h, w), conv.kernel_size, conv.padding, conv.dilation, conv.stride, strict=True
            )
        )
        out_size = torch.Size((n, conv.out_channels, out_h, out_w))
        grad = torch.ops.aten.threshold_backward(grad, tape.get(f"relu{i}")[rows], 0)
        grad = max_unpool(grad, tape.get(f"indices{i}")[rows], out_size)
        grad, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad, conv_input, conv.weight.to(dtype), [conv.out_channels], list(conv.stride),
            list(conv.padding), list(conv.dilation), False, [0, 0], conv.groups,
            [i > 0, True, True],
        )  # fmt: skip
        grads[:0] = [grad_w.to(conv.weight.dtype), grad_b.to(conv.weight.dtype)]
    return grads
