r"""The GPU check: on one lent GPU, the GPU tests and the time to a Pong score, in one command.

Before the lease, on a machine that reaches the package index, fetch the wheels the GPU
machine lacks (it has torch with CUDA, numpy, pytest, tensorboard, matplotlib, opencv):

    python benchmarks/gpu_check.py --fetch-wheels

Then one device call from the repository root, carrying ``.whl`` (9 minutes in all):

    python3 benchmarks/gpu_check.py --out $OUT

On a CPU-only machine ``--dry-run`` runs the same steps with tiny budgets (about a minute;
CI does), so a typo cannot waste the one day a GPU is there:

    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check

The steps, each writing into ``--out`` as it ends, so a call cut off by its limit still
returns what it measured:

1. ``machine.txt``: the date, ``nvidia-smi``, the host's cores and CPU, the versions.
2. ``pytest_gpu.txt``: ``pytest -m gpu`` (every GPU test; on a CPU they skip).
3. ``time_to_score.txt`` and ``.json``, the test log under ``logs/``:
   ``benchmarks/time_to_score.py`` on Pong with one worker per host core, under CUDA's MPS
   daemon where it starts, for what the deadline leaves, stopping at a 10-game mean of 18.
4. ``results.json``, rewritten after every step: each step's exit code and seconds, the
   machine, and the frames and minutes to 10-game means of 0, 10 and 18 with the best mean.

The mode, `GPU_MODE`: K=16 envs a worker, fp32, AMSGrad at the original's constant lr 0.0001.
It is the one GPU setting that has learnt Pong from frame 0 (12 workers won a test game at
6.9M frames); 16 workers at lr 0.0003 and 0.0005 stalled at -21.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/site")

GPU_MODE = ["--envs-per-worker", "16", "--amsgrad", "--lr", "0.0001"]
"""The time-to-score run's main.py flags, besides ``--gpu-ids 0`` and ``--workers``."""
TARGETS = [0.0, 10.0, 18.0]
MISSING_THERE = ["gymnasium==1.4.0", "ale-py==0.12.1", "setproctitle==1.3.8",
                 "farama-notifications==0.0.4"]  # fmt: skip
"""The packages the GPU machine's image lacks (device KINDS.md), as tested here."""


def fetch_wheels() -> int:
    """Download `MISSING_THERE` as Python 3.12 x86-64 wheels into ``.whl/``."""
    WHEELS.mkdir(exist_ok=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS)]  # fmt: skip
    for platform in platforms:
        cmd += ["--platform", platform]
    return subprocess.run([*cmd, *MISSING_THERE]).returncode


def child_env(dry_run: bool) -> dict[str, str]:
    """The steps' environment: the carried wheels installed into `SITE` (once) and on the path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels and not dry_run:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
             *map(str, wheels)], check=True,
        )  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    return env


def run_step(cmd: list[str], out: Path, seconds: float, env: dict[str, str]) -> int:
    """Run `cmd` with its output in `out`; past `seconds` SIGTERM it (it saves), then kill it."""
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()


def machine(env: dict[str, str]) -> dict:
    """What the machine is: GPU, driver, cores, CPU, the packages' versions."""
    smi = shutil.which("nvidia-smi")
    gpu = None
    if smi:
        query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True).stdout.strip() or None
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), None,
    )  # fmt: skip
    probe = (
        "import json, torch, gymnasium, ale_py; print(json.dumps({'torch': torch.__version__, "
        "'gymnasium': gymnasium.__version__, 'ale_py': ale_py.__version__, "
        "'cuda': torch.cuda.is_available()}))"
    )
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    versions = json.loads(found.stdout) if found.returncode == 0 else {"error": found.stderr[-500:]}
    python = sys.version.split()[0]
    return {"gpu": gpu, "cores": os.cpu_count(), "cpu": cpu, "python": python, **versions}


@contextlib.contextmanager
def mps_daemon(env: dict[str, str], wanted: bool):
    """CUDA's multi-process service for the block where it starts (it sped GPU workers up)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if not (wanted and control):
        yield False
        return
    folders = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps_pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/mps_log"}
    for folder in folders.values():
        Path(folder).mkdir(exist_ok=True)
    env.update(folders)
    started = subprocess.run([control, "-d"], env=env).returncode == 0
    try:
        yield started
    finally:
        if started:
            subprocess.run([control], input="quit\n", text=True, env=env)
        for name in folders:
            env.pop(name)


def milestones(rows: list[dict]) -> dict:
    """Frames and minutes to each target's 10-game mean, the best mean, frames/s, from the JSON."""
    if not rows:
        return {}
    row = rows[0]
    reached = {
        target: None if hit is None else {"frames": hit["frames"], "minutes": hit["seconds"] / 60}
        for target, hit in row.get("milestones", {}).items()
    }
    keys = ("best_window_mean", "test_games", "frames_per_s", "frames_at_end", "wall_seconds")
    return {"to_mean": reached, **{key: row.get(key) for key in keys}, "command": row["command"]}


def main(argv: list[str] | None = None) -> int:
    """Run the steps in turn, writing ``results.json`` after each; 0 when every step passed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    p.add_argument("--dry-run", action="store_true", help="CPU only, tiny budgets (CI)")
    p.add_argument("--deadline", type=float, help="seconds for all steps (default 540; dry 60)")
    p.add_argument("--fetch-wheels", action="store_true", help="download .whl/ and stop")
    args = p.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels()
    started = time.monotonic()
    deadline = args.deadline or (60 if args.dry_run else 540)

    def left() -> float:
        return deadline - (time.monotonic() - started)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                     time.gmtime()), "steps": {}}  # fmt: skip

    def done(step: str, code: int, since: float) -> None:
        results["steps"][step] = {"exit_code": code, "seconds": round(time.monotonic() - since)}
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    since = time.monotonic()
    env = child_env(args.dry_run)
    results["machine"] = machine(env)
    (out / "machine.txt").write_text(json.dumps(results["machine"], indent=1) + "\n")
    done("machine", 0 if "torch" in results["machine"] else 1, since)

    since = time.monotonic()
    pytest = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider"]
    code = run_step(pytest, out / "pytest_gpu.txt", min(150, left() / 3), env)
    lines = (out / "pytest_gpu.txt").read_text().strip().splitlines()
    results["pytest_gpu"] = lines[-1].strip("= ") if lines else ""
    done("pytest_gpu", code, since)

    since = time.monotonic()
    cores = os.cpu_count() or 2
    workers = 2 if args.dry_run else cores
    flags = GPU_MODE if args.dry_run else [*GPU_MODE, "--gpu-ids", "0"]
    with mps_daemon(env, wanted=not args.dry_run) as mps:
        # A minute kept for the stop and the summary; a dry run trains for 30 s at least.
        minutes = max(left() - (20 if args.dry_run else 60), 30) / 60
        results["time_to_score_setting"] = {"workers": workers, "flags": " ".join(flags),
                                            "minutes": round(minutes, 2), "mps": mps}  # fmt: skip
        score = [
            sys.executable, "benchmarks/time_to_score.py", "--env", "PongNoFrameskip-v4",
            "--workers", str(workers), "--minutes", f"{minutes:.2f}", "--test-niceness", "0",
            "--target", *map(str, TARGETS), "--config", " ".join(flags),
            "--warmup", "5" if args.dry_run else "60", "--json", str(out / "time_to_score.json"),
            "--keep-logs", str(out / "logs"),
        ]  # fmt: skip
        code = run_step(score, out / "time_to_score.txt", minutes * 60 + 50, env)
    rows_file = out / "time_to_score.json"
    results["time_to_score"] = milestones(
        json.loads(rows_file.read_text()) if rows_file.exists() else []
    )
    done("time_to_score", code, since)
    failed = [step for step, outcome in results["steps"].items() if outcome["exit_code"]]
    print(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
