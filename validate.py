"""Every check of the command lines' flags, in one place: the envs built later trust them."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch

import utils
from environment import ATARI_ENTRY_POINT, MAX_EPISODE_FRAMES, episode_frames, lookup_spec
from utils import UsageError, require_at_least

if TYPE_CHECKING:
    from cli import CommonConfig, EvalConfig, TrainConfig

DEFAULT_SKIP_RATE = 4  # raw frames per agent step on NoFrameskip ids (the original's)
SYNC_INTERVAL = 3.0  # a cluster node's seconds between exchanges (docs/cluster.md)


def _check(problems: list[str], check: Callable[..., Any], *args: Any) -> bool:
    """Run a check that raises `UsageError`; its message joins `problems`. Whether it passed."""
    try:
        check(*args)
    except UsageError as err:
        problems.append(str(err))
        return False
    return True


MAX_SEED = 2**32 - 1  # the largest --seed: numpy's range


def _refuse_empty(problems: list[str], config: CommonConfig, name: str, fix: str) -> None:
    """Refuse a flag given as "": an unset shell variable, which would mean another file."""
    if getattr(config, name) == "":
        problems.append(f"--{name.replace('_', '-')} is empty (an unset shell variable?); {fix}")


def _given(config: CommonConfig, name: str) -> bool:
    """Field `name` of `config` differs from its default (a value equal to it changes nothing)."""
    return getattr(config, name) != next(f.default for f in fields(config) if f.name == name)


def _refuse_unread(
    problems: list[str], config: CommonConfig, name: str, reader: str, fix: str
) -> None:
    """Refuse a value no part of this run reads (it lacks `reader`); "" is `_refuse_empty`'s."""
    if _given(config, name) and getattr(config, name) != "":
        value = getattr(config, name)
        problems.append(f"--{name.replace('_', '-')} {value!r} is read only with {reader}; {fix}")


def _require_folders(problems: list[str], config: CommonConfig, *names: str) -> None:
    """Refuse an empty folder flag: an unset shell variable would write in the current folder."""
    for name in names:
        _refuse_empty(problems, config, name, "give a folder, . for the current one")


def _common_problems(problems: list[str], config: CommonConfig) -> None:
    _require_folders(problems, config, "load_model_dir", "log_dir")
    _refuse_empty(
        problems,
        config,
        "env_config",
        "give a JSON file, or leave the flag out for the shipped one",
    )
    for flag_name, value in (
        ("--max-episode-length", config.max_episode_length),
        ("--skip-rate", config.skip_rate),
        ("--skip-rate-min", config.skip_rate_min),
        ("--hidden-size", config.hidden_size),
    ):
        if value is not None:  # --hidden-size: None until given (the file's width)
            _check(problems, require_at_least, flag_name, value)
    sticky = config.repeat_action_probability
    if sticky is not None and not 0.0 <= sticky <= 1.0:
        problems.append(
            f"--repeat-action-probability must be in [0, 1], got {sticky}; 0.25 is the standard "
            "sticky-actions protocol, 0 a deterministic emulator"
        )
    if not 0 <= config.seed <= MAX_SEED:
        problems.append(f"--seed must be in 0..{MAX_SEED}, got {config.seed}")
    if config.skip_rate_min is not None and config.skip_rate_min > config.skip_rate:
        problems.append(
            f"--skip-rate-min {config.skip_rate_min} is more than --skip-rate "
            f"{config.skip_rate}; give a minimum of {config.skip_rate} or less, or raise "
            f"--skip-rate to {config.skip_rate_min} or more (the -v0 ids' 2-4 frames: "
            "--skip-rate-min 2 --skip-rate 4)"
        )
    if _check(problems, lookup_spec, config.env):  # a known id: what applies to it
        _env_problems(problems, config)
    if config.stall_steps < 0:
        problems.append(f"--stall-steps must be 0 (off) or more, got {config.stall_steps}")


def train_problems(config: TrainConfig) -> list[str]:
    """Every value of main.py's command line that cannot work, one line each: value and fix."""
    problems: list[str] = []
    _check(problems, require_at_least, "--workers", config.workers)
    _check(problems, require_at_least, "--num-steps", config.num_steps)
    _check(problems, require_at_least, "--envs-per-worker", config.envs_per_worker)
    _common_problems(problems, config)
    _require_folders(problems, config, "save_model_dir")
    # A forgotten --load would train afresh; the save folder named as both is a first sitting.
    same = os.path.abspath(config.load_model_dir) == os.path.abspath(config.save_model_dir)
    if not config.load and not same:
        _refuse_unread(
            problems, config, "load_model_dir", "--load",
            "add --load to go on from what it holds, or drop --load-model-dir to start afresh",
        )  # fmt: skip
    if config.max_steps < 0:
        problems.append(f"--max-steps must be 0 (no limit) or more, got {config.max_steps}")
    if config.lr_schedule == "linear" and config.max_steps == 0:
        problems.append(
            "--lr-schedule linear falls to 0 at --max-steps, which is 0 (no limit); give "
            "--max-steps N, or use --lr-schedule constant"
        )
    if not 0 <= config.test_niceness <= 19:
        problems.append(f"--test-niceness must be in 0..19, got {config.test_niceness}")
    for size in config.distributed_step_size:
        if size < 1:
            problems.append(f"--distributed-step-size values must be at least 1, got {size}")
    for name, value in (("--lr", config.lr), ("--reward-scale", config.reward_scale)):
        if not (math.isfinite(value) and value > 0):
            problems.append(f"{name} must be a positive number, got {value}")
    for name, value in (("--gamma", config.gamma), ("--tau", config.tau)):
        if not 0 < value <= 1:
            problems.append(f"{name} must be in (0, 1], got {value}")
    for name, value in (
        ("--entropy-coef", config.entropy_coef),
        ("--value-coef", config.value_coef),
    ):
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{name} must be a non-negative number, got {value}")
    for name, value in (
        ("--test-interval", config.test_interval),
        ("--state-interval", config.state_interval),
        ("--status-interval", config.status_interval),
    ):
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{name} must be 0 or more seconds, got {value}")
    if config.nodes < 0:
        problems.append(f"--nodes must be 0 (every node) or more, got {config.nodes}")
    if not (math.isfinite(config.sync_interval) and config.sync_interval > 0):
        problems.append(
            f"--sync-interval must be a positive number of seconds, got {config.sync_interval}"
        )
    if config.ray_address == "":  # "$RAY_ADDRESS" unset, say: not a run on this machine
        problems.append(
            "--ray-address is empty (an unset variable?); pass auto, local or host:port, or "
            "drop --ray-address to train on this machine alone"
        )
    if config.ray_address and not ray_address_ok(config.ray_address):
        problems.append(
            f"--ray-address {config.ray_address!r} is not an address; pass auto, local or "
            "host:port (the port 'ray start --head' printed, 6379 by default; an IPv6 host in "
            "brackets, [::1]:6379)"
        )
    cluster_only = (
        (config.sync_interval != SYNC_INTERVAL, f"--sync-interval {config.sync_interval:g}"),
        (config.exchange_precision != "fp32", f"--exchange-precision {config.exchange_precision}"),
        (config.exchange_statistics, "--exchange-statistics"),
        (config.nodes, f"--nodes {config.nodes}"),
    )
    for given, flag in cluster_only if not config.ray_address else ():
        if given:
            problems.append(
                f"{flag} needs --ray-address (auto, host:port or local); drop it to train on "
                "this machine alone"
            )
    if config.amsgrad and config.optimizer != "Adam":
        problems.append(
            f"--amsgrad is a variant of Adam and --optimizer is {config.optimizer}; drop "
            "--amsgrad, or pass --optimizer Adam"
        )
    if config.exchange_statistics and not config.shared_optimizer:
        problems.append(
            "--exchange-statistics exchanges the shared optimizer's statistics; drop "
            "--no-shared-optimizer (one optimizer per worker has none to exchange)"
        )
    if -1 in config.gpu_ids and len(config.gpu_ids) > 1:
        problems.append(
            f"--gpu-ids mixes -1 (CPU) with GPU ids {list(config.gpu_ids)}; give only GPU ids, "
            "or -1"
        )
    return problems


def ray_address_ok(address: str) -> bool:
    """`address` is ``auto``, ``local`` or ``host:port`` with a port in 1-65535."""
    return address in ("auto", "local") or host_port(address) is not None


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port`` (IPv6 in brackets), else None."""
    host, _, port = address.rpartition(":")
    name = host.rpartition("://")[2]  # ray://host:port: the host after the scheme
    if not name or (":" in name and not (name.startswith("[") and name.endswith("]"))):
        return None
    if not (port.isascii() and port.isdecimal() and 0 < int(port) < 65536):
        return None
    return name.strip("[]"), int(port)


def eval_problems(config: EvalConfig) -> list[str]:
    """Every value of gym_eval.py's command line that cannot work, one line each."""
    problems: list[str] = []
    _check(problems, require_at_least, "--num-episodes", config.num_episodes)
    _check(problems, require_at_least, "--render-freq", config.render_freq)
    _check(problems, require_at_least, "--threads", config.threads)
    cores = os.cpu_count() or 1
    if config.threads > cores:  # never faster, and in the tens of thousands torch crashes
        problems.append(
            f"--threads {config.threads} is more than this machine's {cores} cores; give at "
            f"most {cores} (1 where training shares the cores)"
        )
    _check(problems, require_at_least, "--processes", config.processes)
    _common_problems(problems, config)
    _require_folders(problems, config, "demo_dir")
    _refuse_empty(
        problems, config, "video_dir", "give a folder, or leave it out for <log-dir>videos/"
    )
    _refuse_empty(
        problems,
        config,
        "model",
        "give the path of a .dat or training-state file, or leave it out for "
        "<load-model-dir><env>.dat",
    )
    if not config.new_gym_eval:
        _refuse_unread(
            problems, config, "video_dir", "--new-gym-eval",
            "add --new-gym-eval to record the games there, or drop --video-dir",
        )  # fmt: skip
    if not config.demo:
        _refuse_unread(
            problems, config, "demo_dir", "--demo",
            "add --demo to write the first game there, or drop --demo-dir",
        )  # fmt: skip
    if not config.render:
        _refuse_unread(
            problems, config, "render_freq", "--render", "add --render to show the games, or drop "
            "--render-freq",
        )  # fmt: skip
    if config.model is not None and _given(config, "load_model_dir"):
        problems.append(
            f"--load-model-dir {config.load_model_dir!r} is not read when --model names the "
            "file; drop one of the two"
        )
    if config.render and min(config.processes, config.num_episodes) > 1:
        problems.append(
            f"--render shows the games in one window and cannot with --processes "
            f"{config.processes}; use --processes 1"
        )
    if config.render and (config.demo or config.new_gym_eval):
        recorded = "--demo" if config.demo else "--new-gym-eval"
        problems.append(
            f"--render shows the games in a window and cannot record them with {recorded}; "
            f"drop --render to record (or evaluate twice)"
        )
    if config.render and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        problems.append(
            "--render needs a display, and none is set here (DISPLAY is empty); "
            "use --new-gym-eval to record videos instead"
        )
    return problems


def _env_problems(problems: list[str], config: CommonConfig) -> None:
    """The flags `config.env` would ignore, and an episode cap past what ALE counts."""
    spec = lookup_spec(config.env)
    atari = spec.entry_point == ATARI_ENTRY_POINT
    we_skip = atari and spec.kwargs.get("frameskip", 1) == 1
    why = f"skips frames itself (frameskip {spec.kwargs.get('frameskip')})" if atari else ""
    for flag, value, given in (
        ("--skip-rate-min", config.skip_rate_min, config.skip_rate_min is not None),
        ("--skip-rate", config.skip_rate, config.skip_rate != DEFAULT_SKIP_RATE),
    ):
        if given and not we_skip:
            problems.append(
                f"{flag} {value} applies to NoFrameskip ids only and {config.env} "
                f"{why or 'is not an ALE game'}; drop {flag}, or use a NoFrameskip id "
                "(e.g. PongNoFrameskip-v4)"
            )
    if atari and config.vector_obs_norm:
        problems.append(
            f"--vector-obs-norm applies to vector observations only, and {config.env}'s frames "
            "are always normalised (as in the original); drop the flag"
        )
    if not atari and config.repeat_action_probability is not None:
        problems.append(
            f"--repeat-action-probability {config.repeat_action_probability} applies to ALE "
            f"games only, and {config.env!r} is not one; drop the flag"
        )
    length = config.max_episode_length
    frames, step_frames = episode_frames(config.env, length, config.frame_skip)
    if frames > MAX_EPISODE_FRAMES:
        problems.append(
            f"--max-episode-length {length} x {step_frames} raw frames a step on "
            f"{config.env} is {frames:,} frames, more than ALE counts ({MAX_EPISODE_FRAMES:,}); "
            f"give --max-episode-length {MAX_EPISODE_FRAMES // step_frames} or less"
        )


# Flags against this machine's hardware: run where the processes run, not at parsing


def check_gpus(gpu_ids: Sequence[int], flag: str = "--gpu-ids") -> None:
    """Reject GPU ids that do not exist here (-1 alone means the CPU); `flag` named them.

    Raises:
        UsageError: CUDA is unavailable, or an id is out of range.
    """
    if list(gpu_ids) == [-1]:
        return
    given = f"{flag} {' '.join(map(str, gpu_ids))}"
    if any(gpu_id < 0 for gpu_id in gpu_ids):
        raise UsageError(
            f"{given}: GPU ids are 0 and up, and -1 (alone) means the CPU; pass one or the other"
        )
    if not torch.cuda.is_available():
        raise UsageError(
            f"{given} asks for a GPU but CUDA is not available here; drop {flag} (or pass -1) "
            "to run on the CPU"
        )
    count = torch.cuda.device_count()
    for gpu_id in gpu_ids:
        if not 0 <= gpu_id < count:
            raise UsageError(
                f"{flag} names GPU {gpu_id}, but this machine has {count} "
                f"(ids 0..{count - 1}); pass ids from that range"
            )


def check_precision(precision: str, gpu_ids: Sequence[int]) -> None:
    """Reject ``--precision bf16`` where the hardware lacks bfloat16 arithmetic.

    Call after `check_gpus`. A GPU needs compute capability 8.0+ (Ampere, Hopper, ...): older
    ones emulate bf16 slowly. The capability comes from the device's properties, which creates
    no CUDA context (that would hold memory on every GPU for the whole run).

    Raises:
        UsageError: bf16 asked for and not supported here.
    """
    if precision != "bf16":
        return
    if list(gpu_ids) == [-1]:
        if not utils.cpu_has_bf16():  # by the module: tests stand in for it
            raise UsageError(
                "--precision bf16 needs a CPU with bfloat16 instructions (AVX512-BF16 or AMX), "
                "and this one has none; use --precision fp32"
            )
        return
    for gpu_id in gpu_ids:
        if torch.cuda.get_device_capability(gpu_id) < (8, 0):
            raise UsageError(
                f"--precision bf16 needs bfloat16 on GPU {gpu_id} "
                f"({torch.cuda.get_device_name(gpu_id)}), which lacks it; use --precision fp32"
            )
