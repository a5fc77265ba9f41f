"""The fast path of a worker's rollout: act without autograd, then backpropagate it at once.

The reference path (the original's) runs every step's forward with autograd and keeps 20
graphs alive until the loss. The fast path computes the same losses and gradients (tested
against it) in three moves, each timed by `benchmarks/bench_step.py` and
`benchmarks/bench_networks.py` ([performance](docs/performance.md)):

1. Act without autograd, with the conv weights in channels_last (`A3Clstm.use_channels_last`),
   the faster layout for a batch-1 forward on a CPU.
2. Record instead of recompute: while acting, `encode_recorded` writes each conv layer's ReLU
   output and max-pool indices into an `EncoderTape`; the rollout's backward
   (`replay_features`) applies PyTorch's own ReLU and convolution backward kernels to the
   recorded activations, batched over the rollout. The conv stack never runs a second time.
3. Fused LSTM over the rollout (`sequence_from_features`): the recorded features go through
   PyTorch's fused LSTM sequence op with the LSTMCell's own weights, so the LSTM weight
   gradients are formed once per rollout instead of once per step.

`model.py` is the network alone and does not import this module.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from model import A3Clstm, ActorCriticLSTM

# On a GPU, `sequence_from_features` hands cuDNN the LSTM cell's four separate weight tensors,
# which cuDNN packs into one buffer every call (12.6 MB at hidden size 512: microseconds on a
# GPU) and warns once per process that it does; the warning names nothing a user can change.
warnings.filterwarnings(
    "ignore",
    message="RNN module weights are not part of single contiguous chunk",
    category=UserWarning,
)


class EncoderTape:
    """What a network's encoder computed while acting without autograd, one row per step.

    For `A3Clstm`, `encode_recorded` keeps every conv layer's input, its max-pool indices and
    its ReLU output, so the backward of a rollout needs no second forward through the conv
    stack (see `replay_features`). Other networks record the observations alone and re-encode.
    Each named tensor lives in a buffer that is kept across rollouts and grows by doubling;
    layers write their outputs straight into the current row, so recording allocates nothing.
    Call `clear` after the backward: the next rollout overwrites the rows.
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

        A step holds ``shape[0]`` rows (one per env the worker acts for; the same every step
        of a rollout), so `get` returns them step-major: step t, env k is row ``t * K + k``.
        The buffer takes the device, dtype (unless given) and memory layout of `like`.
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

    `A3Clstm` keeps each conv layer's pool indices and ReLU output (written straight into the
    tape's rows: no allocation per step); other networks keep the observation. With `bf16` the
    encoder runs under bfloat16 autocast and records in bfloat16; the features come back as
    float32 either way.
    """
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        if not isinstance(model, A3Clstm):
            tape.record({"input": x})
            tape.advance()
            return model.encode(x).float()
        if model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        tape.record({"input": x})
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
    """One step of ``model(x, hx, cx)`` without autograd, recording the encoder on `tape`.

    `x` holds one observation per env the worker acts for (batch K); the LSTM and heads run
    in float32, the encoder in bfloat16 with `bf16`.

    Raises:
        RuntimeError: called with autograd on (recording replaces the autograd graph).
    """
    if torch.is_grad_enabled():
        raise RuntimeError("recording on an EncoderTape needs torch.no_grad()")
    return model.forward_features(encode_recorded(model, x, tape, bf16), hx, cx)


def replay_features(model: ActorCriticLSTM, tape: EncoderTape, bf16: bool = False) -> torch.Tensor:
    """The features of every recorded step, shape (T * K, features), step-major, with autograd.

    For `A3Clstm`, backward applies PyTorch's own backward kernels (ReLU, max-pool,
    convolution) to the recorded activations, batched over the rollout: the gradients autograd
    would give for `encode` of the same observations, without running the conv stack again.
    A tape recorded in bfloat16 is
    backpropagated in bfloat16 (the weight gradients come back float32). Other networks
    encode the recorded observations again, as one batch (under bfloat16 autocast with `bf16`).
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

    The LSTM runs as PyTorch's fused sequence op with the cell's own weights (same gate
    order), so backward forms each LSTM weight gradient once for the whole sequence.

    Args:
        model: the network.
        features: encoder features, shape (T * K, features), step-major (step t, env k is
            row ``t * K + k``, as `EncoderTape.get` gives them).
        hx: LSTM hidden state before the first step, shape (K, hidden_size).
        cx: LSTM cell state before the first step, shape (K, hidden_size).

    Returns:
        ``(values, logits)`` with shapes (T * K, 1) and (T * K, n_actions), step-major.
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
        # Rows in chunks: K envs' rollouts are hundreds of frames, whose activations (65 MB
        # for 320 frames' first layer) fall out of the caches when done as one batch.
        chunk = backward_chunk(grad.device)
        for start in range(0, last.shape[0], chunk):
            rows = slice(start, start + chunk)
            grads = _conv_stack_backward(model, tape, grad[rows], rows)
            total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
        assert total is not None
        return (None, None, *total)


BACKWARD_CHUNK = 40
"""Frames per conv-stack backward call (`_ReplayConvStack`) on the CPU; a 20-step rollout of
one env is one call. Chunks of 20-40 frames keep the activations in a core's caches, faster
per frame than larger batches (`benchmarks/bench_conv_layers.py`)."""

GPU_BACKWARD_CHUNK = 1 << 20
"""On a GPU the whole rollout goes in one call: the CPU's reason for chunks (activations
falling out of a core's caches) does not apply, and each call is a few kernel launches that
a bigger batch amortises (not timed against chunks on a GPU)."""


def backward_chunk(device: torch.device) -> int:
    """Frames per conv-stack backward call on `device` (`BACKWARD_CHUNK`, `GPU_BACKWARD_CHUNK`)."""
    return BACKWARD_CHUNK if device.type == "cpu" else GPU_BACKWARD_CHUNK


def _conv_stack_backward(
    model: A3Clstm, tape: EncoderTape, grad: torch.Tensor, rows: slice
) -> list[torch.Tensor]:
    """The conv stack's weight and bias gradients (conv1 first) for the tape's `rows`.

    Args:
        model: the network.
        tape: the recorded activations.
        grad: the gradient of the last layer's output for those rows.
        rows: which of the tape's rows.
    """
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
