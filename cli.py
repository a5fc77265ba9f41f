"""The command lines of main.py and gym_eval.py: each flag declared once, in a typed config."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from environment import DEFAULT_CONFIG, FrameSkip, skip_from_flags
from model import HIDDEN_SIZE
from shared_optim import LR_SCHEDULES
from utils import OneLineParser, UsageError
from validate import DEFAULT_SKIP_RATE, SYNC_INTERVAL, eval_problems, train_problems

DEFAULT_ENV = "PongNoFrameskip-v4"


def flag(
    default: Any,
    *short: str,
    help: str,  # noqa: A002 - argparse's own name for it
    choices: Sequence[str] | None = None,
    item: type | None = None,
    negatable: bool = False,
) -> Any:
    """A config field that is also a flag ``--field-name``: a bool on/off, a tuple a list."""
    meta = {"short": short, "help": help, "choices": choices, "item": item, "negatable": negatable}
    return field(default=default, metadata=meta)


# The configurations


@dataclass(frozen=True)
class CommonConfig:
    """The flags main.py and gym_eval.py share: the game, its env, the network, the folders."""

    env: str = flag(DEFAULT_ENV, "-ev", help="gymnasium environment id")
    env_config: str = flag(
        DEFAULT_CONFIG,
        "-evc",
        help="per-game crop settings (JSON, read for ALE games only); without one in the current "
        "folder, the shipped one",
    )
    seed: int = flag(
        1,
        "-s",
        help="random seed: training worker RANK uses seed + RANK (a resumed or restarted one "
        "draws its own from it); gym_eval.py seeds its games from it",
    )
    max_episode_length: int = flag(
        10000,
        "-mel",
        help="agent steps before an episode (a game, in gym_eval) is cut; the steps of its "
        "reset (no-ops, FIRE) count, as in the original",
    )
    skip_rate: int = flag(
        DEFAULT_SKIP_RATE,
        "-sk",
        help="frame skip (NoFrameskip ids): raw frames each agent step repeats its action for, "
        "the observation the max over the last of them",
    )
    skip_rate_min: int | None = flag(
        None,
        item=int,
        help="random frame skip (NoFrameskip ids): each agent step repeats its action for a "
        "number of raw frames drawn uniformly from --skip-rate-min..--skip-rate, as the "
        "original's -v0 ids do (2 with --skip-rate 4); default: always --skip-rate",
    )
    hidden_size: int | None = flag(
        None,
        "-hs",
        item=int,
        help=f"LSTM hidden size; default: the loaded file's (main.py --load, gym_eval.py's "
        f"evaluated file), else {HIDDEN_SIZE} (the original's and the shipped agents')",
    )
    load_model_dir: str = flag(
        "trained_models/",
        "-lmd",
        help="folder holding <env>.dat (main.py --load resumes from <env>_state.pt there first)",
    )
    log_dir: str = flag("logs/", "-lg", "-lgd", help="folder of the logs and run records")
    vector_obs_norm: bool = flag(
        False,
        negatable=True,
        help="standardise vector observations (CartPole-like envs) with running statistics",
    )
    stall_steps: int = flag(
        0,
        help="end a test or evaluation game after this many agent steps in a row without a "
        "reward, logged as stalled (e.g. 2000 for Breakout, whose ball waits for a FIRE); 0: off",
    )
    repeat_action_probability: float | None = flag(
        None,
        item=float,
        help="sticky actions (ALE games): the chance each raw frame repeats the previous action "
        "instead of the agent's; 0.25 is the standard protocol (Machado et al. 2018, ALE v5, the "
        "original's -v0 ids); default: the id's own (0 for NoFrameskip-v4, 0.25 for ALE/*-v5)",
    )

    @property
    def frame_skip(self) -> FrameSkip:
        """The skip the env plays: ``--skip-rate``, or ``(--skip-rate-min, --skip-rate)``."""
        return skip_from_flags(self.skip_rate, self.skip_rate_min)


@dataclass(frozen=True)
class TrainConfig(CommonConfig):
    """A training run (main.py): the original A3G's flags, same names and defaults, and ours."""

    lr: float = flag(0.0001, "-l", help="learning rate")
    entropy_coef: float = flag(0.01, "-ec", help="entropy bonus weight")
    value_coef: float = flag(0.5, "-vc", help="value loss weight (0.5 reproduces the original)")
    gamma: float = flag(0.99, "-g", help="discount factor")
    tau: float = flag(1.00, "-t", help="GAE lambda")
    workers: int = flag(32, "-w", help="training processes")
    num_steps: int = flag(20, "-ns", help="forward steps per update (n-step)")
    shared_optimizer: bool = flag(
        True,
        "-so",
        negatable=True,
        help="optimizer statistics shared by all workers; -so is the same and takes no value "
        "(--no-shared-optimizer: one per worker)",
    )
    load: bool = flag(
        False,
        "-ld",
        help="resume from <load-model-dir><env>_state.pt, or start from <env>.dat without it",
    )
    save_max: bool = flag(
        False,
        "-sm",
        help="save <env>.dat only when a test score matches or beats the best so far (the "
        "final weights then go to <env>_last.dat)",
    )
    optimizer: str = flag("Adam", "-o", choices=("Adam", "RMSprop"), help="optimizer")
    save_model_dir: str = flag(
        "trained_models/",
        "-smd",
        help="folder for <env>.dat (the test process's saves and the final weights) and "
        "<env>_state.pt (the training state --load resumes from)",
    )
    gpu_ids: tuple[int, ...] = flag(
        (-1,), "-gp", item=int, help="GPU ids to spread workers over; -1 = CPU only"
    )
    amsgrad: bool = flag(False, "-a", help="AMSGrad variant of Adam")
    tensorboard_logger: bool = flag(False, "-tl", help="log to TensorBoard")
    distributed_step_size: tuple[int, ...] = flag(
        (),
        "-dss",
        item=int,
        help="n-step sizes dealt round-robin to workers (overrides --num-steps)",
    )
    max_steps: int = flag(
        0, help="stop after this many agent steps summed over workers (0 = until Ctrl-C)"
    )
    test_interval: float = flag(
        60.0, help="seconds the test process waits between evaluation games"
    )
    test_niceness: int = flag(
        10,
        help="niceness the test process adds to the launcher's (0-19): higher leaves busy cores "
        "to the workers; 0 when test games must keep up (--save-max, short --test-interval)",
    )
    status_interval: float = flag(
        20.0,
        help="seconds between status lines and TensorBoard training scalars (0 = no lines; "
        "TensorBoard then every 20 s)",
    )
    reward_scale: float = flag(
        1.0,
        help="multiply the clipped training rewards by this; below 1 keeps values small "
        "on dense-reward envs (CartPole: 0.1)",
    )
    fast_path: bool = flag(
        True,
        negatable=True,
        help="act without autograd, then backpropagate the whole rollout at once (same losses "
        "and gradients); --no-fast-path computes the original's way",
    )
    envs_per_worker: int = flag(
        1,
        help="envs each worker plays in lockstep, acting for all with one batched forward and "
        "making one update from their K rollouts (1 = the original's one env per worker)",
    )
    precision: str = flag(
        "fp32",
        choices=("fp32", "bf16"),
        help="bf16: run the conv stack under bfloat16 autocast when acting and in the backward "
        "(float32 weights, LSTM and optimizer); needs a CPU with AVX512-BF16/AMX or a GPU that "
        "has bfloat16",
    )
    bootstrap_truncated: bool = flag(
        False,
        help="an episode cut by the time limit (truncated, as gymnasium tells apart from "
        "terminated) ends its return with V of its last state; off: 0, as the original",
    )
    lr_schedule: str = flag(
        "constant",
        choices=LR_SCHEDULES,
        help="constant: --lr throughout (the original); linear: fall in a straight line from "
        "--lr to 0 at --max-steps (the A3C paper's annealing; needs --max-steps)",
    )
    ray_address: str | None = flag(
        None,
        help="train on a Ray cluster: auto or host:port joins a running one, local starts one "
        "here; --workers, --envs-per-worker and --gpu-ids then mean per node (default: this "
        "machine alone, without Ray)",
    )
    nodes: int = flag(0, help="with --ray-address: machines to train on (0 = every alive node)")
    sync_interval: float = flag(
        SYNC_INTERVAL,
        help="with --ray-address: seconds between a node's exchanges with the parameter server",
    )
    exchange_precision: str = flag(
        "fp32",
        choices=("fp32", "fp16"),
        help="with --ray-address: fp16 sends the exchanges' changes in half the bytes, each "
        "rounding carried into the next exchange (error feedback); the last exchange is fp32",
    )
    exchange_statistics: bool = flag(
        False,
        negatable=True,
        help="with --ray-address: exchange the optimizer's statistics with the server too, so "
        "that every node steps with the whole cluster's, as one machine's shared optimizer does",
    )
    state_interval: float = flag(
        300.0,
        help="seconds between writes of the training-state file <env>_state.pt (optimizer "
        "statistics, counters, normalisers; what --load resumes from); 0 = only at shutdown",
    )

    def gpu_for(self, rank: int) -> int:
        """The GPU of training worker `rank` (round-robin), or -1 for the CPU."""
        return self.gpu_ids[rank % len(self.gpu_ids)]

    @property
    def test_gpu(self) -> int:
        """The test process's GPU: the last of ``--gpu-ids`` (-1 for the CPU)."""
        return self.gpu_ids[-1]


@dataclass(frozen=True)
class EvalConfig(CommonConfig):
    """An evaluation (gym_eval.py): the original's flags, same names and defaults, and ours."""

    num_episodes: int = flag(100, "-ne", help="full games to play (lost lives continue a game)")
    render: bool = flag(False, "-r", help="show the game in a window")
    render_freq: int = flag(1, "-rf", help="with --render, show every Nth game")
    new_gym_eval: bool = flag(
        False, "-nge", help="record every game as an MP4 video in --video-dir"
    )
    video_dir: str | None = flag(
        None, item=str, help="where --new-gym-eval writes (default <log-dir>videos/)"
    )
    model: str | None = flag(
        None,
        item=str,
        help="the .dat (or training state <env>_state.pt) to evaluate, of any network for the "
        "env's spaces (default <load-model-dir><env>.dat)",
    )
    gpu_id: int = flag(-1, "-gid", help="GPU to run on; -1 = CPU")
    threads: int = flag(
        1,
        help="CPU threads for the network, at most the machine's cores; more help only on idle "
        "cores, and slow the games while training shares them",
    )
    processes: int = flag(
        1,
        help="processes playing the games side by side, one core each (game i goes to "
        "process (i-1) mod P; process 0's first game is seeded with --seed, the others' with "
        "seeds drawn from it)",
    )
    demo: bool = flag(False, help="write the first game as <demo-dir><env>.gif and .mp4")
    demo_dir: str = flag("demo/", help="where --demo writes")


# Parsing

Config = TypeVar("Config", TrainConfig, EvalConfig)


def _add_flag(parser: argparse.ArgumentParser, f: Field) -> None:
    meta = f.metadata
    names = ["--" + f.name.replace("_", "-"), *meta["short"]]
    help_text = meta["help"]
    if "default" not in help_text:  # a help that names its default says it better
        help_text += f" (default: {shown_default(f.default)})"
    kwargs: dict[str, Any] = {"default": f.default, "help": help_text, "dest": f.name}
    if isinstance(f.default, bool):
        kwargs["action"] = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
    elif isinstance(f.default, tuple):
        kwargs.update(type=meta["item"], nargs="+", default=list(f.default))
    elif f.default is None:
        kwargs["type"] = meta["item"]  # an optional value: None until given
    else:
        kwargs["type"] = type(f.default)
    if meta["choices"] is not None:
        kwargs["choices"] = list(meta["choices"])
    parser.add_argument(*names, **kwargs)


def build_parser(
    config_type: type[Config], description: str, prog: str | None = None
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `config_type`, errors in one line."""
    parser = OneLineParser(prog=prog, description=description)
    for f in fields(config_type):
        _add_flag(parser, f)
    return parser


# Fields naming files or folders: a leading ~ is expanded, which a shell leaves in --log-dir=~/x.
PATH_FLAGS = frozenset(
    {"env_config", "load_model_dir", "save_model_dir", "log_dir", "video_dir", "model", "demo_dir"}
)


def _parse(
    config_type: type[Config], description: str, argv: Sequence[str] | None, prog: str | None
) -> Config:
    namespace = build_parser(config_type, description, prog).parse_args(argv)
    values = {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in vars(namespace).items()
    }
    for name in PATH_FLAGS & values.keys():
        if isinstance(values[name], str):
            values[name] = os.path.expanduser(values[name])
    return config_type(**values)


TRAIN_DESCRIPTION = "A3G: train an A3C-LSTM agent with Hogwild workers on CPUs and GPUs."
EVAL_DESCRIPTION = "Evaluate a trained A3G model over many greedy games."


def parse_train_args(argv: Sequence[str] | None = None, prog: str | None = None) -> TrainConfig:
    """main.py's command line, parsed and checked (`prog`: the name errors begin with).

    Raises:
        UsageError: every value that cannot work, a line each.
    """
    config = _parse(TrainConfig, TRAIN_DESCRIPTION, argv, prog)
    if problems := train_problems(config):
        raise UsageError("\n".join(problems))
    if config.hidden_size is None and not config.load:  # --load: the file's (the plan reads it)
        config = replace(config, hidden_size=HIDDEN_SIZE)
    return config


def parse_eval_args(
    argv: Sequence[str] | None = None, description: str = EVAL_DESCRIPTION
) -> EvalConfig:
    """gym_eval.py's command line, parsed and checked; `description` heads ``--help``.

    Raises:
        UsageError: a value that cannot work.
    """
    config = _parse(EvalConfig, description, argv, None)
    if problems := eval_problems(config):
        raise UsageError("\n".join(problems))
    return config


def flag_reference() -> str:
    """``docs/cli.md`` from the config fields; ``python cli.py > docs/cli.md`` after a change."""
    lines = [
        "# Command-line flags",
        "",
        "Generated from `cli.py` by `python cli.py > docs/cli.md`; do not edit by hand.",
        "",
        "- [main.py](#mainpy)",
        "- [gym_eval.py](#gym_evalpy)",
    ]
    for script, config_type, description in (
        ("main.py", TrainConfig, TRAIN_DESCRIPTION),
        ("gym_eval.py", EvalConfig, EVAL_DESCRIPTION),
    ):
        lines += ["", f"## {script}", "", description, ""]
        lines += ["| flag | short | default | meaning |", "|---|---|---|---|"]
        lines += [_flag_row(f) for f in fields(config_type)]
    return "\n".join(lines) + "\n"


def shown_default(default: Any) -> str:
    """A flag's default as ``--help`` and docs/cli.md show it: on/off, (none), or the value."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return " ".join(map(str, default)) or "(none)"
    if default is None or default == "":
        return "(none)"
    return str(default)


def _flag_row(f: Field) -> str:
    meta = f.metadata
    name = "--" + f.name.replace("_", "-")
    if isinstance(f.default, bool) and meta["negatable"]:
        name += f" / --no-{f.name.replace('_', '-')}"
    meaning = meta["help"].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    if meta["choices"] is not None:
        meaning += f" (one of: {', '.join(meta['choices'])})"
    short = ", ".join(f"`{s}`" for s in meta["short"])
    return f"| `{name}` | {short} | {shown_default(f.default)} | {meaning} |"


def as_dict(config: CommonConfig) -> dict[str, Any]:
    """The configuration as plain values (lists for tuples), for logs and JSON records."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}


if __name__ == "__main__":
    print(flag_reference(), end="")
