"""What every process shares: logging, child-process failure reports, the step counter."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import pytest
import torch.multiprocessing as mp

from checkpoint import TrainingState
from utils import ProcessContext, ReportChannels, child_process, setup_logger, sigint_ignored

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


def receive_until(channels: ReportChannels, done, seconds: float = 60) -> list:
    received = []
    deadline = time.monotonic() + seconds
    while not done(received) and time.monotonic() < deadline:
        received += channels.receive()
        time.sleep(0.02)
    return received


def test_child_failure_reaches_the_launcher_as_one_line_and_exit_1():
    spawn = mp.get_context("spawn")
    channels = ReportChannels(spawn)
    child_ctx = channels.open("worker 7", ProcessContext.create(spawn, slots=8), slot=7)
    proc = spawn.Process(target=_failing_child, args=(child_ctx,))
    proc.start()
    channels.started(child_ctx)
    proc.join(60)
    assert proc.exitcode == 1
    [(key, kind, error)] = receive_until(channels, bool)
    assert key == "worker 7" and kind == "error"
    assert error["title"] == "Train Agent: 7" and error["cause"] == "RuntimeError: disk on fire"
    assert "Traceback" in error["traceback"] and "_failing_child" in error["traceback"]
    assert channels.receive() == [] and "worker 7" not in channels.readers  # read to its end


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
    unlimited.request_stop()
    assert unlimited.should_stop() and unlimited.wait(60)


def test_counters_sum_every_slot_and_a_resumed_base():
    resumed = TrainingState(model={}, steps=1000, skipped_updates=2)
    ctx = ProcessContext.create(mp.get_context("spawn"), slots=3, resumed=resumed)
    workers = [ctx.for_child(rank, None) for rank in range(3)]
    for rank, worker in enumerate(workers):
        worker.add_steps(10 * (rank + 1))
    workers[2].count_skipped()
    assert ctx.total_steps() == 1060 and workers[0].total_steps() == 1060
    assert ctx.total_skipped() == 3


def _count_forever(ctx: ProcessContext) -> None:
    while True:
        ctx.add_steps(1)
        ctx.count_skipped()
        ctx.stopping()


def _count_until_stopped(ctx: ProcessContext) -> None:
    while not ctx.should_stop():
        ctx.add_steps(1)
        ctx.count_skipped()


def test_a_worker_sigkilled_while_counting_leaves_the_run_able_to_stop():
    # With a locked counter, a SIGKILL that lands while the lock is held leaves it held:
    # every later add or read (the launcher's included) blocks for good.
    spawn = mp.get_context("spawn")
    ctx = ProcessContext.create(spawn, slots=2)
    victim = spawn.Process(target=_count_forever, args=(ctx.for_child(0, None),))
    survivor = spawn.Process(target=_count_until_stopped, args=(ctx.for_child(1, None),))
    victim.start()
    survivor.start()
    try:
        for _ in range(5):  # kill it mid-loop, several times over
            mark = ctx.steps[0]
            deadline = time.monotonic() + 30
            while ctx.steps[0] - mark < 10_000 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            before = ctx.total_steps()
            victim = spawn.Process(target=_count_forever, args=(ctx.for_child(0, None),))
            victim.start()
        # The survivor kept counting, and the launcher's reads never blocked.
        deadline = time.monotonic() + 10
        while ctx.total_steps() <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctx.total_steps() > before
        ctx.request_stop()
        survivor.join(10)
        assert survivor.exitcode == 0
    finally:
        for proc in (victim, survivor):
            if proc.is_alive():
                proc.kill()
                proc.join()


def _report_forever(ctx: ProcessContext) -> None:
    payload = {"numbers": list(range(2000))}  # ~10 KB: killed mid-message often
    while True:
        ctx.report("train", payload)


def _report_numbered(ctx: ProcessContext, count: int) -> None:
    for n in range(count):
        ctx.report("test", {"n": n})
        time.sleep(0.01)


def test_a_child_sigkilled_while_reporting_silences_only_itself():
    spawn = mp.get_context("spawn")
    channels = ReportChannels(spawn)
    ctx = ProcessContext.create(spawn, slots=2)
    noisy_ctx = channels.open("noisy", ctx, 0)
    noisy = spawn.Process(target=_report_forever, args=(noisy_ctx,))
    noisy.start()
    channels.started(noisy_ctx)
    received = receive_until(channels, lambda got: len(got) > 20)
    os.kill(noisy.pid, signal.SIGKILL)  # mid-write, with the pipe full or filling
    noisy.join(10)

    quiet_ctx = channels.open("quiet", ctx, 1)
    quiet = spawn.Process(target=_report_numbered, args=(quiet_ctx, 50))
    quiet.start()
    channels.started(quiet_ctx)
    later = receive_until(channels, lambda got: sum(key == "quiet" for key, _, _ in got) == 50)
    quiet.join(30)
    assert [payload["n"] for key, _, payload in later if key == "quiet"] == list(range(50))
    assert all(kind == "train" for key, kind, _ in received + later if key == "noisy")
    assert "noisy" not in channels.readers  # read to the end its death left, then closed
    # Its replacement gets a pipe of its own and is heard.
    again_ctx = channels.open("noisy", ctx, 0)
    again = spawn.Process(target=_report_numbered, args=(again_ctx, 3))
    again.start()
    channels.started(again_ctx)
    replaced = receive_until(channels, lambda got: len(got) == 3)
    again.join(30)
    assert [payload["n"] for _, _, payload in replaced] == [0, 1, 2]


def test_receive_reads_a_bounded_number_of_reports_per_pipe_per_call():
    # A child writing as fast as the launcher reads must not keep the launcher's loop reading.
    spawn = mp.get_context("spawn")
    channels = ReportChannels(spawn)
    channels.MAX_REPORTS_PER_CALL = 5
    child_ctx = channels.open("worker", ProcessContext.create(spawn, slots=1), 0)
    child = spawn.Process(target=_report_numbered, args=(child_ctx, 12))
    child.start()
    channels.started(child_ctx)
    child.join(60)  # its 12 reports wait in the pipe
    batches = [channels.receive() for _ in range(3)]
    assert [len(batch) for batch in batches] == [5, 5, 2]
    assert [payload["n"] for batch in batches for _, _, payload in batch] == list(range(12))
    assert "worker" not in channels.readers  # the third call reached the end and closed it


# -- GPU settings, checked without a GPU ---------------------------------------------------------


def test_fp32_on_a_gpu_means_no_tf32(monkeypatch):
    import torch

    from utils import worker_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)  # no GPU needed
    # Set and put back by hand: torch.backends.cuda.matmul serves allow_tf32 through
    # __getattr__/__setattr__, and pytest 9.2's monkeypatch undoes it by deleting the
    # attribute, an error there.
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = True
        assert worker_device(-1) == torch.device("cpu")  # the CPU has no TF32: nothing changes
        assert matmul.allow_tf32 and cudnn.allow_tf32 and made_current == []
        assert worker_device(1) == torch.device("cuda", 1)
        assert not matmul.allow_tf32 and not cudnn.allow_tf32 and made_current == [1]
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


@pytest.mark.parametrize(
    ("capability", "allowed"), [((7, 5), False), ((8, 0), True), ((9, 0), True)]
)
def test_bf16_on_gpus_is_judged_by_capability_without_a_cuda_context(
    monkeypatch, capability, allowed
):
    import torch

    import utils
    import validate

    def no_context(*_args, **_kwargs):
        raise AssertionError("torch.cuda.device() creates a context on the GPU for the whole run")

    monkeypatch.setattr(torch.cuda, "device", no_context)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda gpu_id: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda gpu_id: "Tesla T4")
    if allowed:
        validate.check_precision("bf16", [0, 1])
    else:
        with pytest.raises(utils.UsageError, match=r"bfloat16 on GPU 0 \(Tesla T4\), which lacks"):
            validate.check_precision("bf16", [0, 1])


def _report_sigint(results, name: str) -> None:
    results.put((name, signal.getsignal(signal.SIGINT) == signal.SIG_IGN))


def test_a_child_started_with_sigint_ignored_ignores_it_from_its_start():
    context = mp.get_context("spawn")
    results = context.Queue()
    # Python's own handler, as in a terminal (pytest may start with SIGINT ignored, in the
    # background of a CI script, and a child would inherit that).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigint_ignored():
            child = context.Process(target=_report_sigint, args=(results, "guarded"))
            child.start()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # back
        unguarded = context.Process(target=_report_sigint, args=(results, "unguarded"))
        unguarded.start()
    finally:
        signal.signal(signal.SIGINT, outer)
    # Python's startup ignored it in the first (no KeyboardInterrupt while it starts up) and
    # set its default handler in the second, which a Ctrl-C would interrupt.
    assert dict([results.get(timeout=60), results.get(timeout=60)]) == {
        "guarded": True,
        "unguarded": False,
    }
    child.join(60)
    unguarded.join(60)
