"""What every process shares: logging, child-process failure reports, the step counter."""

from __future__ import annotations

import logging
import re

import torch.multiprocessing as mp

from utils import ProcessContext, child_process, setup_logger

# -- logging -----------------------------------------------------------------------------------


def test_logger_writes_the_original_format_once(tmp_path):
    log_file = tmp_path / "logs" / "PongNoFrameskip-v4_log"
    setup_logger("a3g.test", log_file)
    log = setup_logger("a3g.test", log_file)  # twice: must not duplicate lines
    log.info("episode reward -21.0")
    for handler in log.handlers:
        handler.flush()
    lines = log_file.read_text().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} : episode reward -21.0", lines[0])


def test_logger_leaves_the_root_logger_alone(tmp_path):
    before = list(logging.getLogger().handlers)
    log = setup_logger("a3g.root_check", tmp_path / "x_log")
    assert logging.getLogger().handlers == before
    assert not log.propagate  # lines are not printed twice through the root logger


# -- child processes ---------------------------------------------------------------------------


def _failing_child(ctx: ProcessContext) -> None:
    with child_process("Train Agent: 7", ctx):
        raise RuntimeError("disk on fire")


def test_child_failure_reaches_the_launcher_as_one_line_and_exit_1():
    spawn = mp.get_context("spawn")
    ctx = ProcessContext.create(spawn)
    proc = spawn.Process(target=_failing_child, args=(ctx,))
    proc.start()
    title, cause, trace = ctx.errors.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 1
    assert title == "Train Agent: 7" and cause == "RuntimeError: disk on fire"
    assert "Traceback" in trace and "_failing_child" in trace


def test_step_counter_and_budget():
    ctx = ProcessContext.create(mp.get_context("spawn"), max_steps=30)
    assert not ctx.should_stop()
    ctx.add_steps(20)
    assert ctx.total_steps() == 20 and not ctx.budget_reached()
    ctx.add_steps(10)
    assert ctx.budget_reached() and ctx.should_stop()
    unlimited = ProcessContext.create(mp.get_context("spawn"))
    unlimited.add_steps(10**9)
    assert not unlimited.should_stop()
    unlimited.stop_event.set()
    assert unlimited.should_stop()
