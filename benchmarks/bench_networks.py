"""Time the A3C-LSTM network on the A3G hot paths, per device and execution mode.

Cases (1x80x80 frames, LSTM hidden 512, 6 actions, as for Pong):

- ``act``: batch-1 forward without autograd, what acting needs.
- ``rollout20``: the original's way of training, 20 batch-1 forwards with autograd, then one
  backward through all of them.
- ``replay20``: 20 frames through the conv stack as one batch and the LSTM step by step, then
  backward (a rollout recomputed after acting without autograd).
- ``fast20``: the fast path's whole rollout: 20 batch-1 forwards without autograd that record
  the conv activations on an `EncoderTape`, then the taped features through the fused LSTM
  sequence op and backward (no second conv forward).
- ``infer16``: batch-16 forward without autograd.
- ``train128``: batch-128 forward and backward.

Modes: ``eager``; ``channels_last``; ``compile`` (``torch.compile``, with ``--compile``: the
first call compiles for minutes on a small CPU); ``cuda_graph`` (``act`` on a GPU only).

Reports the median and the spread (25th-75th percentile) of the milliseconds per call over
``--repeats`` timed calls, and GPU utilisation when ``nvidia-smi`` answers. One thread on CPU,
as in a worker.

    python benchmarks/bench_networks.py                 # CPU (and GPU 0 when present)
    python benchmarks/bench_networks.py --json out.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_training import output_file, run_script  # noqa: E402

from checkpoint import write_json_atomic  # noqa: E402
from fast_path import (  # noqa: E402
    EncoderTape,
    act_recorded,
    replay_features,
    sequence_from_features,
)
from model import A3Clstm  # noqa: E402

STEPS = 20


def make_model(device: torch.device, mode: str) -> A3Clstm:
    """The Pong network on `device`, laid out for `mode`."""
    args = argparse.Namespace(hidden_size=512)
    model = A3Clstm(1, gym.spaces.Discrete(6), args.hidden_size).to(device)
    if mode == "channels_last":
        model.use_channels_last()
    return model


def frames(batch: int, device: torch.device, mode: str) -> torch.Tensor:
    """Random input frames in the layout `mode` wants."""
    x = torch.randn(batch, 1, 80, 80, device=device)
    return x.contiguous(memory_format=torch.channels_last) if mode == "channels_last" else x


def case_functions(
    model: A3Clstm, device: torch.device, mode: str
) -> dict[str, Callable[[], object]]:
    """The timed callables for one model."""
    forward = torch.compile(model) if mode == "compile" else model
    hx, cx = model.initial_state(1, device)
    x1 = frames(1, device, mode)
    x20 = frames(STEPS, device, mode)
    x16 = frames(16, device, mode)
    x128 = frames(128, device, mode)
    h16, c16 = model.initial_state(16, device)
    h128, c128 = model.initial_state(128, device)

    def act() -> object:
        with torch.no_grad():
            return forward(x1, hx, cx)

    def rollout20() -> object:
        h, c = hx, cx
        total = torch.zeros((), device=device)
        for t in range(STEPS):
            value, logits, h, c = forward(x20[t : t + 1], h, c)
            total = total + value.sum() + logits.logsumexp(1).sum()
        model.zero_grad(set_to_none=True)
        total.backward()
        return total

    def replay20() -> object:
        feats = model.encode(x20)
        h, c = hx, cx
        hs = []
        for t in range(STEPS):
            h, c = model.lstm(feats[t : t + 1], (h, c))
            hs.append(h)
        hidden = torch.cat(hs)
        total = model.critic_linear(hidden).sum() + model.actor_linear(hidden).logsumexp(1).sum()
        model.zero_grad(set_to_none=True)
        total.backward()
        return total

    tape = EncoderTape()

    def fast20() -> object:
        tape.clear()
        h, c = hx, cx
        with torch.no_grad():
            for t in range(STEPS):
                _, _, h, c = act_recorded(model, x20[t : t + 1], h, c, tape)
        values, logits = sequence_from_features(model, replay_features(model, tape), hx, cx)
        total = values.sum() + logits.logsumexp(1).sum()
        model.zero_grad(set_to_none=True)
        total.backward()
        return total

    def infer16() -> object:
        with torch.no_grad():
            return forward(x16, h16, c16)

    def train128() -> object:
        value, logits, _, _ = forward(x128, h128, c128)
        model.zero_grad(set_to_none=True)
        (value.sum() + logits.logsumexp(1).sum()).backward()
        return value

    cases = {"act": act, "rollout20": rollout20, "infer16": infer16, "train128": train128}
    if mode != "compile":
        cases["replay20"] = replay20
        cases["fast20"] = fast20
    return cases


def cuda_graph_act(model: A3Clstm, device: torch.device) -> Callable[[], object]:
    """Batch-1 acting replayed from a captured CUDA graph."""
    static_x = torch.randn(1, 1, 80, 80, device=device)
    hx, cx = model.initial_state(1, device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            model(static_x, hx, cx)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(static_x, hx, cx)
    return graph.replay


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Milliseconds per call, `repeats` times, after a warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def gpu_utilisation() -> str | None:
    """``nvidia-smi``'s utilisation figure, if it answers."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 else None


def summarise(samples: list[float]) -> dict[str, float]:
    """Median and quartiles in milliseconds."""
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return {"median_ms": median, "p25_ms": q1, "p75_ms": q3, "repeats": len(samples)}


def main(argv: list[str] | None = None) -> int:
    """Run every case in every mode on every device; print a table, optionally save JSON."""
    p = argparse.ArgumentParser(description="A3C-LSTM network timings.")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per case")
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow)")
    p.add_argument("--cpu-only", action="store_true", help="skip the GPU even if present")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    output_file(p, "--json", args.json)
    if args.repeats < 4:
        print(
            f"bench_networks.py: error: --repeats must be at least 4, got {args.repeats}",
            file=sys.stderr,
        )
        return 2

    torch.set_num_threads(1)
    torch.manual_seed(0)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and not args.cpu_only:
        devices.append(torch.device("cuda", 0))
    modes = ["eager", "channels_last"] + (["compile"] if args.compile else [])

    results = []
    for device in devices:
        for mode in modes:
            model = make_model(device, mode)
            for case, fn in case_functions(model, device, mode).items():
                stats = summarise(time_call(fn, device, args.repeats))
                results.append({"device": str(device), "mode": mode, "case": case, **stats})
        if device.type == "cuda":
            graph = cuda_graph_act(make_model(device, "eager"), device)
            stats = summarise(time_call(graph, device, args.repeats))
            results.append({"device": str(device), "mode": "cuda_graph", "case": "act", **stats})
            results[-1]["gpu_utilisation"] = gpu_utilisation()

    print(f"{'device':8} {'mode':14} {'case':10} {'median ms':>10} {'p25-p75 ms':>16}")
    for r in results:
        spread = f"{r['p25_ms']:.3f}-{r['p75_ms']:.3f}"
        print(f"{r['device']:8} {r['mode']:14} {r['case']:10} {r['median_ms']:10.3f} {spread:>16}")
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(0) if len(devices) > 1 else None,
        "threads": 1,
    }
    if args.json:
        write_json_atomic({"machine": machine, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run_script("bench_networks.py", main))
