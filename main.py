"""A3G: parse the configuration, plan the run folder, build and share the model, run."""

from __future__ import annotations

import signal
import sys

_INTERRUPTED_WHILE_IMPORTING: list[int] = []
# A Ctrl-C during the imports is noted, not raised inside them (it could leave numpy half-loaded).
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: _INTERRUPTED_WHILE_IMPORTING.append(signum))

import dataclasses
import logging

import torch
from torch import nn

import run_folder
from checkpoint import release_run_locks
from cli import TrainConfig, parse_train_args
from environment import EnvSpec, protocol, short_episode_warning
from launcher import Launcher, share_model
from utils import (
    INTERRUPTED_EXIT,
    UsageError,
    run_script,
    say_error,
    sigterm_interrupts,
)
from validate import check_gpus, check_precision


def prepare(config: TrainConfig, cluster: bool = False) -> Launcher:
    """Everything before the first process starts; all that can fail on bad input fails here.

    Raises:
        UsageError: a bad GPU id, folder, env, file to --load, or a state it would not resume.
    """
    log = logging.getLogger("a3g.main")
    check_gpus(config.gpu_ids)
    check_precision(config.precision, config.gpu_ids)
    run = run_folder.plan(config, cluster=cluster)
    config = dataclasses.replace(config, hidden_size=run.hidden_size)  # the file's, if --load
    spec = EnvSpec.of(config)  # config.json read once, here

    def load(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        run_folder.load(run, config, model, optimizer, log, cluster=cluster)

    shared = share_model(config, spec, 0 if cluster else config.workers, load)
    run_folder.apply(run, log)
    played = protocol(config.env, config.frame_skip, config.max_episode_length)
    short = short_episode_warning(played)
    if short is not None:
        log.warning(short)
    return Launcher(config, spec, shared, run, workers=0 if cluster else None)


STOPPED_BEFORE_TRAINING = "main.py: stopped before training started"
"""What a Ctrl-C before any child started prints (exit 130): torch importing, a state loading."""


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 ok or stopped, 1 a failure or lost save, 2 bad input, 130 stopped early."""
    logging.basicConfig(format="%(asctime)s : %(message)s", level=logging.INFO)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        try:
            with sigterm_interrupts():  # SIGTERM until the launcher catches it: as a Ctrl-C
                config = parse_train_args(argv)
                launcher = None if config.ray_address else prepare(config)
                if launcher is not None:
                    launcher.open_record()
            if launcher is None:  # a cluster's driver: it catches signals from its start
                from cluster import run_cluster

                return run_cluster(config, prepare)
        except UsageError as err:
            say_error("main.py", err)
            return 2
        except KeyboardInterrupt:  # while a state loads, say: no child started, nothing trained
            print(STOPPED_BEFORE_TRAINING, file=sys.stderr)
            return INTERRUPTED_EXIT
        return launcher.run()
    finally:  # the run's folders are free for the next (the process may go on: tests)
        release_run_locks()


if __name__ == "__main__":
    run_script(main, _INTERRUPTED_WHILE_IMPORTING, STOPPED_BEFORE_TRAINING)
