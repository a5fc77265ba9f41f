"""The networks: shapes, initialisation statistics, checkpoint keys, model choice."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from checkpoint import cpu_state_dict
from fast_path import EncoderTape, act_recorded, encode_recorded, max_unpool, replay_features
from model import A3Clstm, A3CMlp, build_model, norm_col_init

ORIGINAL_KEYS = [
    "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
    "conv3.weight", "conv3.bias", "conv4.weight", "conv4.bias",
    "lstm.weight_ih", "lstm.weight_hh", "lstm.bias_ih", "lstm.bias_hh",
    "critic_linear.weight", "critic_linear.bias", "actor_linear.weight", "actor_linear.bias",
]  # fmt: skip

FRAMES = gym.spaces.Box(-np.inf, np.inf, (1, 80, 80), np.float32)


@pytest.fixture(scope="module")
def model() -> A3Clstm:
    torch.manual_seed(0)
    return A3Clstm(1, gym.spaces.Discrete(6))


def test_forward_shapes(model):
    x = torch.randn(3, 1, 80, 80)
    hx, cx = model.initial_state(3)
    value, logits, hx2, cx2 = model(x, hx, cx)
    assert value.shape == (3, 1)
    assert logits.shape == (3, 6)
    assert hx2.shape == cx2.shape == (3, 512)
    assert model.encode(x).shape == (3, 1024)


def test_state_dict_keys_and_shapes_match_the_original(model):
    sd = model.state_dict()
    assert list(sd) == ORIGINAL_KEYS
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes["conv1.weight"] == (32, 1, 5, 5)
    assert shapes["conv2.weight"] == (32, 32, 5, 5)
    assert shapes["conv3.weight"] == (64, 32, 4, 4)
    assert shapes["conv4.weight"] == (64, 64, 3, 3)
    assert shapes["lstm.weight_ih"] == (2048, 1024)
    assert shapes["lstm.weight_hh"] == (2048, 512)
    assert shapes["actor_linear.weight"] == (6, 512)
    assert shapes["critic_linear.weight"] == (1, 512)


def test_hidden_size_flag_sizes_the_lstm():
    m = A3Clstm(1, gym.spaces.Discrete(4), 64)
    assert m.lstm.hidden_size == 64 and m.actor_linear.weight.shape == (4, 64)


def test_conv_init_is_default_scaled_by_relu_gain(model):
    for conv in (model.conv1, model.conv2, model.conv3, model.conv4):
        fan_in = conv.weight[0].numel()
        # PyTorch's default conv init is uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = math.sqrt(2) / math.sqrt(fan_in)
        w = conv.weight.abs()
        assert w.max() <= bound + 1e-6
        assert w.max() > 0.95 * bound
        assert conv.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
        assert torch.count_nonzero(conv.bias) == 0


def test_heads_are_row_normalised(model):
    actor_norms = model.actor_linear.weight.norm(dim=1)
    critic_norms = model.critic_linear.weight.norm(dim=1)
    torch.testing.assert_close(actor_norms, torch.full((6,), 0.01))
    torch.testing.assert_close(critic_norms, torch.ones(1))
    assert torch.count_nonzero(model.actor_linear.bias) == 0
    assert torch.count_nonzero(model.critic_linear.bias) == 0


def test_lstm_init(model):
    lstm, h = model.lstm, 512
    bound = math.sqrt(6 / (1024 + 2048))  # xavier_uniform on the (4h, 1024) matrix
    assert lstm.weight_ih.abs().max() <= bound + 1e-6
    assert lstm.weight_ih.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    w = lstm.weight_hh
    torch.testing.assert_close(w.T @ w, torch.eye(h), atol=1e-4, rtol=0)
    expected_ih = torch.zeros(4 * h)
    expected_ih[h : 2 * h] = 1.0
    torch.testing.assert_close(lstm.bias_ih, expected_ih)
    assert torch.count_nonzero(lstm.bias_hh) == 0


def test_first_policy_is_near_uniform(model):
    hx, cx = model.initial_state()
    _, logits, _, _ = model(torch.randn(1, 1, 80, 80), hx, cx)
    probs = torch.softmax(logits, 1)
    assert (probs - 1 / 6).abs().max() < 0.01


def test_checkpoint_round_trip_with_weights_only(model, tmp_path):
    path = tmp_path / "PongNoFrameskip-v4.dat"
    torch.save(model.state_dict(), path)
    loaded = A3Clstm(1, gym.spaces.Discrete(6))
    loaded.load_state_dict(torch.load(path, weights_only=True))
    x = torch.randn(1, 1, 80, 80)
    hx, cx = model.initial_state()
    for a, b in zip(model(x, hx, cx), loaded(x, hx, cx), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_channels_last_acts_greedily_like_the_saved_layout_and_saves_it(model, tmp_path):
    """The test process and gym_eval.py play in channels_last; files keep the usual layout."""
    fast = A3Clstm(1, gym.spaces.Discrete(6))
    fast.load_state_dict(model.state_dict())
    fast.use_channels_last()
    assert not fast.conv2.weight.is_contiguous()
    hx, cx = model.initial_state(8)
    x = torch.randn(8, 1, 80, 80)
    with torch.no_grad():
        expected, got = model(x, hx, cx), fast(x, hx, cx)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(expected[1].argmax(1), got[1].argmax(1))

    saved = cpu_state_dict(fast)
    assert all(t.is_contiguous() for t in saved.values())
    torch.save(saved, tmp_path / "m.dat")
    reloaded = A3Clstm(1, gym.spaces.Discrete(6))
    reloaded.load_state_dict(torch.load(tmp_path / "m.dat", weights_only=True))
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_every_parameter_gets_a_gradient(model):
    hx, cx = torch.randn(1, 512), torch.randn(1, 512)  # non-zero so weight_hh matters
    value, logits, _, _ = model(torch.randn(1, 1, 80, 80), hx, cx)
    model.zero_grad()
    (value.sum() + logits.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# -- vector observations and model choice -----------------------------------------------------


def test_build_model_picks_the_network_from_the_observation_space():
    assert isinstance(build_model(FRAMES, gym.spaces.Discrete(6), 32), A3Clstm)
    mlp = build_model(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), 32)
    assert isinstance(mlp, A3CMlp)
    hx, cx = mlp.initial_state(5)
    value, logits, hx, cx = mlp(torch.randn(5, 4), hx, cx)
    assert value.shape == (5, 1) and logits.shape == (5, 2) and hx.shape == (5, 32)
    assert {"lstm.weight_ih", "actor_linear.weight", "critic_linear.weight"} <= set(
        mlp.state_dict()
    )


# -- the encoder tape (fast path) ----------------------------------------------------------------


def taped_gradients(model, frames: torch.Tensor, tape) -> list[torch.Tensor]:
    """Record `frames` one step at a time without autograd, replay, backprop a fixed loss."""
    tape = EncoderTape() if tape is None else tape
    tape.clear()
    with torch.no_grad():
        recorded = [encode_recorded(model, frames[t : t + 1], tape) for t in range(len(frames))]
    features = replay_features(model, tape)
    torch.testing.assert_close(features, torch.cat(recorded), rtol=0, atol=0)
    model.zero_grad(set_to_none=True)
    (features * torch.linspace(-1, 1, features.shape[1])).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("channels_last", [False, True])
def test_encoder_tape_gives_the_gradients_of_autograd(channels_last):
    """Two rollouts on one tape (the second longer than its first buffers) vs autograd."""
    torch.manual_seed(0)
    model = A3Clstm(1, gym.spaces.Discrete(6))
    if channels_last:
        model.use_channels_last()
    tape = EncoderTape()
    for steps in (5, 40):
        frames = torch.rand(steps, 1, 80, 80)
        taped = taped_gradients(model, frames, tape)
        assert len(tape) == steps
        model.zero_grad(set_to_none=True)
        features = model.encode(frames)
        (features * torch.linspace(-1, 1, features.shape[1])).sum().backward()
        reference = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(taped) == len(reference) == 8  # the conv weights and biases
        for mine, theirs in zip(taped, reference, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-5)


def test_max_unpool_is_the_max_pool_backward_bit_for_bit():
    for size in ((3, 32, 80, 80), (2, 64, 9, 9)):  # even, and odd (last row/column dropped)
        x = torch.randn(size).contiguous(memory_format=torch.channels_last)
        pooled, indices = torch.nn.functional.max_pool2d(x, 2, 2, return_indices=True)
        grad = torch.randn_like(pooled)
        expected = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices
        )
        assert torch.equal(max_unpool(grad, indices, x.shape), expected)


def test_recording_needs_no_grad(model):
    hx, cx = model.initial_state()
    with pytest.raises(RuntimeError, match="no_grad"):
        act_recorded(model, torch.zeros(1, 1, 80, 80), hx, cx, EncoderTape())
    with pytest.raises(RuntimeError, match="needs steps"):
        replay_features(model, EncoderTape())


# -- init ----------------------------------------------------------------------------------------


def test_norm_col_init_rescales_each_row():
    out = norm_col_init(torch.empty(7, 40), 0.25)
    torch.testing.assert_close(out.norm(dim=1), torch.full((7,), 0.25))


# -- per-device choices --------------------------------------------------------------------------


def test_layout_and_backward_chunks_are_chosen_per_device_type():
    from fast_path import BACKWARD_CHUNK, backward_chunk
    from model import ActorCriticLSTM

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    suits = ActorCriticLSTM.channels_last_suits
    assert suits(cpu) and suits(cpu, bf16=True)
    assert not suits(cuda)  # fp32: cuDNN's default layout
    assert suits(cuda, bf16=True)  # tensor cores
    assert backward_chunk(cpu) == BACKWARD_CHUNK == 40  # the CPU's measured choice
    assert backward_chunk(cuda) >= 16 * 20 * 64  # a GPU takes any rollout in one call
