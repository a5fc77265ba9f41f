"""How close each conv layer of the Pong network runs to what one core can do.

For each of the four conv layers of `model.A3Clstm` (1x80x80 frames, channels_last, one
thread, as in a worker) times the three calls a training step makes per frame: the forward
while acting (at ``--batch`` frames, the envs a worker acts for), and in the rollout's backward
the weight gradient and the input gradient (``aten.convolution_backward`` on the rollout's
frames, main.py's default ``--num-steps`` (20) x ``--batch``, in chunks of at most
`fast_path.BACKWARD_CHUNK`, as `fast_path` calls it; conv1 needs no input gradient).
Each is reported in ms per frame and in GFLOP/s against the core's single-thread float32
matmul rate, the most this core's vector units give PyTorch. The sum over the layers is the
conv arithmetic of one agent step, and what it would cost at the matmul rate is its floor.

    python benchmarks/bench_conv_layers.py
    python benchmarks/bench_conv_layers.py --batch 1 --precision bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_networks import time_call  # noqa: E402
from bench_training import output_file, run_script  # noqa: E402

from checkpoint import write_json_atomic  # noqa: E402
from cli import TrainConfig  # noqa: E402
from fast_path import BACKWARD_CHUNK  # noqa: E402
from model import A3Clstm  # noqa: E402
from utils import UsageError  # noqa: E402
from validate import check_precision  # noqa: E402


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` calls on the CPU (`bench_networks.time_call`)."""
    return statistics.median(time_call(fn, torch.device("cpu"), repeats)) / 1e3


def matmul_gflops(dtype: torch.dtype, repeats: int) -> float:
    """Single-thread GFLOP/s of a 1024x1024 matmul in `dtype`."""
    a = torch.randn(1024, 1024).to(dtype)
    b = torch.randn(1024, 1024).to(dtype)
    return 2 * 1024**3 / median_seconds(lambda: a @ b, repeats) / 1e9


def layer_inputs(model: A3Clstm, batch: int) -> list[torch.Tensor]:
    """Each conv layer's input for `batch` random frames (the previous layer's ReLU'd pool)."""
    inputs = []
    x = torch.rand(batch, 1, 80, 80).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for conv in model.convs():
            inputs.append(x)
            x = F.relu(F.max_pool2d(conv(x), 2, 2))
    return inputs


def time_layers(batch: int, dtype: torch.dtype, repeats: int) -> list[dict[str, float]]:
    """Milliseconds per frame and GFLOP/s of each layer's forward, weight and input gradient."""
    model = A3Clstm(1, gym.spaces.Discrete(6)).use_channels_last()
    acting = layer_inputs(model, batch)
    # The rollout's frames (main.py's default --num-steps x the envs) in chunks of at most
    # BACKWARD_CHUNK: a K=1 rollout's backward is one call of 20 frames.
    chunk = layer_inputs(model, min(BACKWARD_CHUNK, TrainConfig().num_steps * batch))
    rows = []
    for i, conv in enumerate(model.convs()):
        weight = conv.weight.detach().to(dtype)
        bias = conv.bias.detach().to(dtype)
        x_act = acting[i].to(dtype)
        x = chunk[i].to(dtype)
        with torch.no_grad():
            out = torch.conv2d(x, weight, bias, conv.stride, conv.padding)
        grad = torch.randn_like(out)
        flop_per_frame = 2 * out[0].numel() * conv.in_channels * weight[0, 0].numel()

        def backward(mask: list[bool], x=x, grad=grad, weight=weight, conv=conv) -> object:
            return torch.ops.aten.convolution_backward(
                grad, x, weight, [conv.out_channels], list(conv.stride), list(conv.padding),
                list(conv.dilation), False, [0, 0], conv.groups, mask,
            )  # fmt: skip

        def forward(x=x_act, weight=weight, bias=bias, conv=conv) -> object:
            return torch.conv2d(x, weight, bias, conv.stride, conv.padding)

        calls: dict[str, tuple[Callable[[], object], int]] = {
            "forward": (forward, batch),
            "weight grad": (lambda: backward([False, True, True]), BACKWARD_CHUNK),
        }
        if i > 0:
            calls["input grad"] = (lambda: backward([True, False, False]), BACKWARD_CHUNK)
        row: dict[str, float] = {"mflop_per_frame": flop_per_frame / 1e6}
        with torch.no_grad():
            for name, (fn, frames) in calls.items():
                seconds = median_seconds(fn, repeats) / frames
                row[f"{name} ms"] = 1e3 * seconds
                row[f"{name} GFLOP/s"] = flop_per_frame / seconds / 1e9
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print one row per layer, the totals per agent step, and the floor."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="frames per acting forward (K envs)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per median")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    output_file(p, "--json", args.json)
    if args.batch < 1:
        p.error(f"--batch must be at least 1, got {args.batch}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        check_precision(args.precision, [-1])  # main.py's own check, on the CPU
    except UsageError as err:
        print(f"bench_conv_layers.py: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_gflops(dtype, args.repeats)
    rows = time_layers(args.batch, dtype, args.repeats)
    print(f"single-thread {args.precision} matmul: {peak:.0f} GFLOP/s")
    print(f"{'layer':6} {'MFLOP':>6}  {'forward':>16}  {'weight grad':>16}  {'input grad':>16}")
    for i, row in enumerate(rows):
        cells = [
            f"{row[f'{name} ms']:6.3f} ms {row[f'{name} GFLOP/s']:3.0f} GF/s"
            if f"{name} ms" in row
            else f"{'-':>16}"
            for name in ("forward", "weight grad", "input grad")
        ]
        print(f"conv{i + 1:<2} {row['mflop_per_frame']:6.1f}  " + "  ".join(cells))
    parts = ("forward", "weight grad", "input grad")
    spent = sum(row[f"{name} ms"] for row in rows for name in parts if f"{name} ms" in row)
    mflop = sum(row["mflop_per_frame"] for row in rows for name in parts if f"{name} ms" in row)
    floor = mflop / peak  # MFLOP / (GFLOP/s) = ms
    print(
        f"per agent step (one frame forward and backward): {spent:.2f} ms for {mflop:.0f} MFLOP; "
        f"at the matmul rate {floor:.2f} ms"
    )
    if args.json:
        results = {
            "matmul_gflops": peak, "batch": args.batch, "precision": args.precision,
            "layers": rows, "ms_per_step": spent, "floor_ms_per_step": floor,
        }  # fmt: skip
        write_json_atomic(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run_script("bench_conv_layers.py", main))
